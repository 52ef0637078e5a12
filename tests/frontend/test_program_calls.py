"""A program calling another program: one cardinality per placement, or refused at
capture."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fcir.interpreters import reference

import fcir
from fcir.errors import PlacementError

# --- one cardinality per placement ------------------------------------------------


@fcir.program(placements={"clients": 3})
def _inner(v):
    return fcir.reduce_sum(fcir.broadcast(v))


@fcir.program(placements={"clients": 4})
def _outer(x):
    return _inner(fcir.reduce_mean(x))


@fcir.program(placements={"clients": 4})
def _outer_loop(x):
    w = fcir.reduce_mean(x)
    return jax.lax.scan(lambda w, _: (_inner(w), None), w, None, length=2)[0]


@fcir.program(placements={"clients": 3})
def _same(x):
    return _inner(fcir.reduce_mean(x))


@pytest.mark.parametrize("fn", [_outer, _outer_loop], ids=["direct", "inside_scan"])
def test_calling_a_program_with_other_cardinality_is_refused_at_capture(fn):
    x = jnp.arange(8.0).reshape(4, 2)
    with pytest.raises(PlacementError, match=r"cardinality 3.*declares clients:4.*declare"):
        fcir.capture(fn, x)


def test_jit_of_a_program_calling_another_cardinality_still_runs():
    x = jnp.arange(8.0).reshape(4, 2)
    np.testing.assert_array_equal(jax.jit(_outer)(x), [9.0, 12.0])  # 3 × mean, as written


def test_calling_a_program_with_the_same_cardinality_captures():
    x = jnp.arange(6.0).reshape(3, 2)
    m = fcir.capture(_same, x)
    np.testing.assert_array_equal(reference.run(m, x), [6.0, 9.0])
