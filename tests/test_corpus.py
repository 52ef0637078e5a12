"""Every corpus program captures, checks, matches its golden, round-trips through text
and protobuf to identical text, and runs on the reference interpreter to what
``jax.jit`` computes (within 1e-5 relative; integers bitwise)."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest
from corpus import CASES, case
from fcir.interpreters import reference

import fcir

NAMES = [c.name for c in CASES]


@functools.cache
def captured(name: str) -> fcir.Module:
    c = case(name)
    return fcir.capture(c.fn, *c.make_args(), name=name)


def assert_close(actual, expected, rtol=1e-5, atol=1e-6):
    a_leaves, e_leaves = jax.tree.leaves(actual), jax.tree.leaves(expected)
    assert len(a_leaves) == len(e_leaves)
    for a, e in zip(a_leaves, e_leaves):
        a, e = np.asarray(a), np.asarray(e)
        assert a.shape == e.shape and a.dtype == e.dtype, (a.shape, a.dtype, e.shape, e.dtype)
        if np.issubdtype(e.dtype, np.inexact):
            np.testing.assert_allclose(a.astype(np.float64), e.astype(np.float64),
                                       rtol=rtol, atol=atol)
        else:
            np.testing.assert_array_equal(a, e)


@pytest.mark.parametrize("name", NAMES)
def test_captures_checks_and_matches_golden(name, golden):
    module = captured(name)
    fcir.check(module)
    golden(name, module.to_text())


@pytest.mark.parametrize("name", NAMES)
def test_round_trips_to_identical_text(name):
    module = captured(name)
    text = module.to_text()
    assert fcir.parse(text).to_text() == text
    data = module.serialize()
    again = fcir.Module.deserialize(data)
    assert again.to_text() == text
    assert again.serialize() == data
    full = module.to_text(full_constants=True)
    assert fcir.parse(full).to_text(full_constants=True) == full


@pytest.mark.parametrize("name", NAMES)
def test_reference_matches_jit(name):
    c = case(name)
    args = c.make_args()
    expected = jax.jit(c.fn)(*args)
    actual = reference.run(captured(name), *args)
    assert jax.tree.structure(actual) == jax.tree.structure(expected) or len(
        jax.tree.leaves(actual)
    ) == len(jax.tree.leaves(expected))
    assert_close(actual, expected)


@pytest.mark.parametrize("name", ["fedavg_mlp", "secure_histogram"])
def test_parsed_text_with_full_constants_runs_to_same_values(name):
    c = case(name)
    args = c.make_args()
    module = fcir.parse(captured(name).to_text(full_constants=True))
    assert_close(reference.run(module, *args), reference.run(captured(name), *args), 0, 0)
