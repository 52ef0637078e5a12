"""A program's federated evaluation (``fcir.program(evaluate=fn)``, ``fcir.evaluation``)
and the names of a program's outputs (``fcir.frontend.pytrees.leaf_names``)."""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fcir.interpreters import reference, xla

import fcir
from fcir.frontend.pytrees import leaf_names
from fcir.ir.types import structure_of


def names(tree):
    treedef = jax.tree_util.tree_structure(tree)
    return leaf_names(structure_of(treedef), treedef.num_leaves)


def test_output_names_come_from_dict_keys_and_namedtuple_fields():
    State = collections.namedtuple("State", "params train_loss")
    assert names({"params": {"w": 1, "b": 2}, "train_loss": 3}) == ["params.b", "params.w", "train_loss"]
    assert names(State({"w": 1}, 2)) == ["params.w", "train_loss"]
    # The position in the results tuple is left out where the rest is unique; a leaf
    # with no key keeps its position.
    assert names(({"w": 1, "b": 2}, 3)) == ["b", "w", "arr_2"]
    assert names(({"x": 1}, {"x": 2})) == ["0.x", "1.x"]
    assert names((1, 2)) == ["arr_0", "arr_1"]


def loss(p, x, y):
    return jnp.mean(jnp.square(x @ p["w"] - y))


def ev(p, x, y):
    return {"test_loss": loss(p, x, y), "bias": jnp.mean(x @ p["w"] - y)}


@fcir.program(placements={"clients": 3}, client_data=("x", "y"), evaluate=ev)
def rnd(p, x, y):
    return fcir.reduce_mean(fcir.map_fn(lambda p, x, y: p, (fcir.broadcast(p), x, y)))


def test_the_evaluation_is_each_member_s_metrics_weighted_by_its_examples():
    rng = np.random.RandomState(0)
    p = {"w": rng.randn(2).astype(np.float32)}
    x, y = rng.randn(3, 4, 2).astype(np.float32), rng.randn(3, 4).astype(np.float32)
    module = fcir.capture(fcir.evaluation(rnd), p, x, y)
    assert module.name == "ev"
    want = {k: np.mean([float(ev(p, x[i], y[i])[k]) for i in range(3)]) for k in ("test_loss", "bias")}
    for got in (reference.run(module, p, x, y), xla.compile(module)(p, x, y)):
        assert sorted(got) == ["bias", "test_loss"]
        for k in want:
            assert np.isclose(float(got[k]), want[k], rtol=1e-5)


def test_a_one_leaf_dict_takes_one_weight_per_member():
    @fcir.program(placements={"clients": 2})
    def weighted(x, w):
        return fcir.reduce_weighted_mean({"loss": x}, w)

    x, w = np.array([1.0, 4.0], np.float32), np.array([3.0, 1.0], np.float32)
    assert np.isclose(float(reference.run(fcir.capture(weighted, x, w), x, w)["loss"]), 7 / 4)


def test_an_evaluation_needs_client_data_named_and_scalar_metrics():
    with pytest.raises(fcir.PlacementError, match="declare which arguments are client data"):
        fcir.program(placements={"clients": 2}, evaluate=ev)
    with pytest.raises(fcir.PlacementError, match="evaluate must be a function"):
        fcir.program(placements={"clients": 2}, client_data=("x",), evaluate=3)
    with pytest.raises(fcir.PlacementError, match="declares no evaluation"):
        fcir.evaluation(fcir.program(placements={"clients": 2})(lambda x: x))

    @fcir.program(placements={"clients": 2}, client_data=("x",), evaluate=lambda p, x: {"v": x})
    def vector(p, x):
        return p

    with pytest.raises(fcir.PlacementError, match="metric 'v' .* has shape"):
        fcir.capture(fcir.evaluation(vector), jnp.ones(()), jnp.ones((2, 3)))
