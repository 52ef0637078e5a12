"""The algorithm object's skeleton (fcir/learning/algorithm.py): counts mask the local
steps and weigh the members, the metrics, the state as a checkpointable pytree, and
the round's IR showing the algorithm's structure."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from fcir.interpreters import reference
from learning_cases import (
    ALGORITHMS,
    BATCH,
    COUNTS,
    SGD,
    N,
    init,
    init_params,
    loss_with_metrics,
    make_data,
    round_args,
)

import fcir
from fcir import checkpoint, learning


def test_steps_past_a_count_and_a_count_0_member_change_nothing():
    """Member 1 (count 1 of 2) never reads its second step, member 2 (count 0) trains
    nothing and weighs nothing: NaN there changes no bit, and dropping member 2 from
    the round gives the same model (to rounding: one term fewer in the sums)."""
    algo = ALGORITHMS["fedavg"]()
    data, counts = make_data(), COUNTS.copy()
    counts[2] = 0.0
    poisoned = jax.tree.map(np.copy, data)
    for leaf in poisoned.values():
        leaf[1, 1:] = np.nan
        leaf[2] = np.nan
    state = init(algo)
    rnd = algo.round(clients=N)
    clean, m_clean = jax.jit(rnd)(state, data, counts)
    dirty, m_dirty = jax.jit(rnd)(state, poisoned, counts)
    for a, b in zip(jax.tree.leaves((clean, m_clean)), jax.tree.leaves((dirty, m_dirty))):
        np.testing.assert_array_equal(a, b)
    keep = [i for i in range(N) if i != 2]
    fewer, m_fewer = algo.round(clients=N - 1)(
        state, jax.tree.map(lambda x: x[keep], data), counts[keep]
    )
    for a, b in zip(jax.tree.leaves((clean, m_clean)), jax.tree.leaves((fewer, m_fewer))):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_metrics_are_the_example_weighted_means_of_the_loss_and_loss_fn_s_own():
    algo = learning.fedavg(loss_with_metrics, client_optimizer=SGD)
    data, state = make_data(), init(algo)
    _, metrics = algo.round(clients=N)(state, data, COUNTS)
    assert sorted(metrics) == ["loss", "mae"]
    per_member = [
        algo.train(state["params"], {k: v[i] for k, v in data.items()}, COUNTS[i])[1]
        for i in range(N)
    ]
    w = COUNTS * BATCH
    for name in ("loss", "mae"):
        want = sum(wi * float(m[name]) for wi, m in zip(w, per_member)) / w.sum()
        np.testing.assert_allclose(metrics[name], want, rtol=1e-6)


@pytest.mark.parametrize("name", ["fedopt", "scaffold"])
def test_the_state_checkpoints_as_it_is_and_the_next_round_resumes_bit_for_bit(name, tmp_path):
    """An optax state (namedtuples), the clients' controls: the state is a pytree of
    arrays that fcir.checkpoint saves and restores unchanged."""
    algo = ALGORITHMS[name]()
    data = make_data()
    rnd = jax.jit(algo.round(clients=N))
    args = round_args(algo, init(algo), data, COUNTS)
    state, _ = rnd(*args)
    checkpoint.save(tmp_path / "ckpt", state)
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                          state)  # fmt: skip
    restored = checkpoint.restore(tmp_path / "ckpt", target)
    assert jax.tree.structure(restored) == jax.tree.structure(state)
    went_on, _ = rnd(state, *args[1:])
    resumed, _ = rnd(restored, *args[1:])
    for a, b in zip(jax.tree.leaves(went_on), jax.tree.leaves(resumed)):
        np.testing.assert_array_equal(a, b)
    assert int(resumed["round"]) == 2


# name -> the fed ops of the round's main body, in order, a run of one op once (with
# counts: the weighted means)
STRUCTURE = {
    "fedavg": ["fed.broadcast", "fed.map", "fed.weighted_mean"],
    "qfedavg": ["fed.broadcast", "fed.map", "fed.sum", "fed.weighted_mean"],
    "scaffold": ["fed.broadcast", "fed.map", "fed.weighted_mean"],
    "krum": ["fed.broadcast", "fed.map", "fed.krum", "fed.weighted_mean"],
    "dp": ["fed.broadcast", "fed.map", "fed.dp_mean"],
    "ddp": ["fed.broadcast", "fed.map", "fed.broadcast", "fed.map", "fed.ddp_mean"],
}


@pytest.mark.parametrize("name", sorted(STRUCTURE))
def test_the_captured_round_shows_the_algorithm_s_structure(name):
    algo = ALGORITHMS[name]()
    module = fcir.capture(algo.round(clients=N), *round_args(algo, init(algo), make_data(),
                                                            COUNTS))  # fmt: skip
    ops = [op.name for op in module.main.body.ops if op.name.startswith("fed.")]
    runs = [o for i, o in enumerate(ops) if i == 0 or ops[i - 1] != o]
    assert runs == STRUCTURE[name], ops
    assert module.name == f"{algo.name}_round"
    assert module.private == algo.aggregator.private


def test_a_round_takes_the_model_through_jit_grad_and_the_reference_alike():
    """The round is an ordinary JAX function: called as it is, jitted, captured and run
    on the reference interpreter, it computes the same state; and jax.grad reaches
    through it (a meta-learning step on the model)."""
    algo = ALGORITHMS["fedadam"]()
    data, state = make_data(), init(algo)
    rnd = algo.round(clients=N)
    eager = rnd(state, data, COUNTS)
    module = fcir.capture(rnd, state, data, COUNTS)
    for other in (jax.jit(rnd)(state, data, COUNTS), reference.run(module, state, data, COUNTS)):
        for a, b in zip(jax.tree.leaves(eager), jax.tree.leaves(other)):
            np.testing.assert_allclose(a, b, rtol=2e-6, atol=1e-7)

    def after(params):
        new, _ = rnd({**state, "params": params}, data, COUNTS)
        return sum(jnp.sum(jnp.square(x)) for x in jax.tree.leaves(new["params"]))

    g = jax.jit(jax.grad(after))(init_params())
    assert all(np.all(np.isfinite(x)) and np.any(x != 0) for x in jax.tree.leaves(g))


def test_a_member_takes_one_client_optimizer_step_per_local_steps_entry():
    """A constant gradient: each Adam step moves by lr * sign(g) (to its eps), so 2
    rounds of 3 entries move each coordinate by 6 * lr."""
    algo = learning.fedavg(lambda p, b: jnp.sum(p * b), client_optimizer=optax.adam(0.5))
    state = algo.init(jnp.zeros(3))
    data = jnp.ones((2, 3, 1, 3)) * jnp.array([1.0, -2.0, 4.0])
    for _ in range(2):
        state, _ = algo.round(clients=2)(state, data)
    np.testing.assert_allclose(state["params"], [-3.0, 3.0, -3.0], rtol=1e-5)


def test_the_package_docstring_example_runs():
    import re

    (code,) = re.findall(r"^```python\n(.*?)^```", learning.__doc__, re.S | re.M)
    exec(compile(code, "fcir.learning docstring", "exec"), {"__name__": "__doc__"})
