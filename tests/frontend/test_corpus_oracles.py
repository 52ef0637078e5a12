"""Every corpus program, jit-compiled, computes what its plain-JAX oracle computes."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from corpus import CASES, DRJAX_NAMES, assert_trees_match, case, drjax_program

NAMES = [c.name for c in CASES]


@functools.cache
def jitted_output(name: str):
    """``jax.jit(fn)(*make_args())`` of case ``name``, computed once per test session."""
    c = case(name)
    return jax.jit(c.fn)(*c.make_args())


@pytest.mark.parametrize("name", NAMES)
def test_program_matches_oracle(name):
    c = case(name)
    assert_trees_match(jitted_output(name), c.oracle(*c.make_args()))


def test_int_mean_dtype():
    c = case("int_mean")
    args = c.make_args()
    declared = jax.eval_shape(c.fn, *args)
    for leaf in jax.tree.leaves(declared):
        assert leaf.dtype == jnp.float32
    values = jitted_output("int_mean")
    for leaf in jax.tree.leaves(values):
        assert leaf.dtype == jnp.float32
    labels = np.asarray(args[0])
    # Not bitwise: XLA turns division by the constant n into multiplication by 1/n.
    np.testing.assert_allclose(
        values["label_mean"], labels.sum(axis=0) / len(labels), rtol=1e-6, atol=0
    )


def key_data(tree):
    """PRNG key arrays as their uint32 data, so they compare like other arrays."""
    return jax.tree.map(
        lambda x: jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x,
        tree,
    )


@pytest.mark.parametrize("name", NAMES)
def test_case_is_well_formed(name):
    c = case(name)
    assert re.fullmatch(r"[a-z][a-z0-9_]*", c.name)
    # Deterministic arguments: the goldens and the backends all see the same values.
    assert_trees_match(key_data(c.make_args()), key_data(c.make_args()), rtol=0, atol=0)
    if c.grad_argnums is not None:
        assert c.loss is not None
        args = c.make_args()
        for i in c.grad_argnums:
            for leaf in jax.tree.leaves(args[i]):
                assert jnp.issubdtype(jnp.result_type(leaf), jnp.floating), (name, i)
    assert not (c.hierarchical and c.exportable)


# One case per API feature DrJAX shares with fcir (scalar and pytree broadcast, tuple
# results from map_fn, grad inside the body, weighted mean): each costs a full compile,
# and bench/ runs the transformer on drjax at scale.
DRJAX_CHECKED = ("temperature_sensors", "fedsgd_linreg", "fedavg_weighted")


def test_drjax_checked_cases_are_expressible():
    assert set(DRJAX_CHECKED) <= set(DRJAX_NAMES)


@pytest.mark.parametrize("name", DRJAX_CHECKED)
def test_same_body_on_drjax_matches(name):
    pytest.importorskip("drjax")
    c = case(name)
    expected = jax.jit(drjax_program(name))(*c.make_args())
    assert_trees_match(jitted_output(name), expected)
