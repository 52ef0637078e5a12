"""Defects a first-time user finds writing ordinary programs from the README and the docs.

Each test is the program a new user writes, compared with the same program written in
plain JAX (no fcir) or with what the program actually releases.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fcir.interpreters import reference, xla

import fcir

N = 4


# --- f16 / bf16 client data: sums and means accumulate as jnp.sum / jnp.mean do --------------


@fcir.program(placements={"clients": N})
def _sum_and_mean(x):
    return fcir.reduce_sum(x), fcir.reduce_mean(x)


def _plain_sum_and_mean(x):  # the same round without fcir: the member axis is axis 0
    return jnp.sum(x, axis=0), jnp.mean(x, axis=0)


_HALF = [
    # an intermediate sum overflows f16 (max 65504) though the total does not
    np.array([[60000.0], [60000.0], [-60000.0], [-60000.0]], np.float16),
    np.full((N, 1), 60000.0, np.float16),  # the mean is representable, the sum is not
    np.array([[256.0], [1.0], [1.0], [1.0]], jnp.bfloat16),  # bf16 drops the 1s one by one
]


@pytest.mark.parametrize("x", _HALF, ids=["f16-cancel", "f16-mean-of-big", "bf16-small-terms"])
def test_half_precision_sum_and_mean_equal_plain_jax_on_every_backend(x):
    want = jax.jit(_plain_sum_and_mean)(x)
    module = fcir.capture(_sum_and_mean, x)
    for name, got in [
        ("jit", jax.jit(_sum_and_mean)(x)),
        ("reference", reference.run(module, x)),
        ("xla", xla.compile(module)(x)),
    ]:
        for g, w in zip(got, want):
            assert g.dtype == w.dtype, name
            np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32), name)
