"""Regression tests for the defects real programs hit (issue 10: 4, 8, 9, 11, 12).

Each test reproduces the program from the issue and runs it the way a user would.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from fcir.interpreters import production, reference, xla

import fcir
from fcir.check import verify

N = 3


# --- defect 8: a collective over the client's own vmap axis is local -----------------------


def _normalize(g):
    return jax.vmap(lambda r: r / jax.lax.psum(r, "batch"), axis_name="batch")(g)


@fcir.program(placements={"clients": N})
def normalized_mean(x):
    return fcir.reduce_mean(fcir.map_fn(_normalize, x))


def test_psum_over_a_vmap_axis_in_client_code_is_local(tmp_path):
    x = jnp.arange(1.0, 13.0).reshape(N, 4)
    m = fcir.capture(normalized_mean, x)  # checks: the psum's axis is not a placement
    assert "jax.psum" in m.to_text()
    assert verify(fcir.parse(m.to_text())) == []
    want = jax.jit(normalized_mean)(x)
    np.testing.assert_allclose(reference.run(m, x), want, rtol=1e-6)
    np.testing.assert_array_equal(xla.compile(m)(x), want)
    production.export(m).write(tmp_path / "b")
    np.testing.assert_allclose(production.run_bundle(tmp_path / "b", x), want, rtol=1e-6)
