"""A round of secure sums for the SecAgg+ tests: full width on uint32, 12 bits on
int32, full width on int16, beside a plain mean."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

import fcir

from .rounds import NODES


@fcir.program(placements={"clients": NODES})
def secure_mix(scale, u, s, f):
    """Secure sums at full width on uint32 and at 12 bits on int32, a full-width int16
    one, and a plain mean of values scaled by a broadcast, in one exchange."""
    return {
        "u32": fcir.secure_sum(u, bitwidth=32),
        "s12": fcir.secure_sum(s, bitwidth=12),
        "s16": fcir.secure_sum(fcir.map_fn(lambda s: s.astype(jnp.int16), s), bitwidth=16),
        "mean": fcir.reduce_mean(fcir.map_fn(lambda f, c: f * c, (f, fcir.broadcast(scale)))),
    }


def make_args(clients: int = NODES):
    """(scale, u, s, f): the server's scale, then the clients' arrays."""
    rng = np.random.default_rng(4)
    u = rng.integers(0, 2**32, (clients, 5), dtype=np.uint32)  # sums wrap modulo 2**32
    s = rng.integers(-(2**31), 2**31, (clients, 5), dtype=np.int32)  # negative inputs too
    f = rng.normal(size=(clients, 3)).astype(np.float32)
    return np.float32(1.5), u, s, f


def assert_matches(got, expected):
    """Secure sums bit for bit the reference's; the float mean within 1e-6 (its order of
    additions is run_bundle's, not the reference's)."""
    assert len(got) == len(expected) == 4
    for g, e in zip(got, expected):
        assert g.dtype == e.dtype and g.shape == e.shape
        if g.dtype.kind in "iu":
            assert g.tobytes() == e.tobytes(), (g, e)
        else:
            np.testing.assert_allclose(g, e, rtol=1e-6, atol=1e-6)
