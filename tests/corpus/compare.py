"""Comparing program outputs: one helper for every test that checks a backend against
``jax.jit`` or an oracle."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def assert_trees_match(actual, expected, *, rtol=1e-5, atol=1e-6):
    """Same structure, dtypes and shapes; floats within tolerance, integers bitwise."""
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    flat_actual, _ = jax.tree_util.tree_flatten_with_path(actual)
    for (path, a), e in zip(flat_actual, jax.tree.leaves(expected)):
        assert_leaf_matches(a, e, jax.tree_util.keystr(path) or "<root>", rtol=rtol, atol=atol)


def assert_leaf_matches(actual, expected, where: str, *, rtol=1e-5, atol=1e-6):
    """Same dtype and shape; floats within tolerance (compared in float64), others
    bitwise. ``where`` names the leaf in the failure message."""
    a, e = np.asarray(actual), np.asarray(expected)
    assert a.dtype == e.dtype, f"{where}: dtype {a.dtype} != {e.dtype}"
    assert a.shape == e.shape, f"{where}: shape {a.shape} != {e.shape}"
    if jnp.issubdtype(a.dtype, jnp.inexact):
        np.testing.assert_allclose(
            a.astype(np.float64), e.astype(np.float64), rtol=rtol, atol=atol, err_msg=where
        )
    else:
        np.testing.assert_array_equal(a, e, err_msg=where)
