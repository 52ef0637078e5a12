"""The float32 discrete Gaussian sampler's distance from the exact law
(fcir.privacy_float32) and the δ it adds in what fcir reports."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fcir
from fcir import ddp
from fcir import privacy_float32 as pf


def _direct_tv(s: float) -> float:
    """The sampler's law by plain enumeration (direct correlation, no FFT), against the
    exact pmf: every float32 uniform of the 2**23 grid, its exponential and geometric,
    the acceptance count of each proposal, MAX_PASSES passes."""
    t = float(math.floor(s) + 1)
    u = jnp.arange(1 << 23, dtype=jnp.uint32).astype(jnp.float32) * jnp.float32(2.0**-23)
    g = np.asarray(jnp.floor(jnp.float32(t) * (-jnp.log1p(-u)))).astype(np.int64)
    pg = np.bincount(g) / 2.0**23
    K = len(pg)
    ys = np.arange(-(K - 1), K)
    py = np.array([sum(pg[j + y] * pg[j] for j in range(K) if 0 <= j + y < K) for y in ys])
    a = np.asarray(
        jnp.exp(-jnp.square(jnp.abs(jnp.asarray(ys, jnp.float32)) - s * s / t) / (2.0 * s * s))
    ).astype(np.float64)
    f = py * np.ceil(a * 2.0**23) / 2.0**23
    miss = (1 - f.sum()) ** ddp.MAX_PASSES
    law = f * (1 - miss) / f.sum()
    law[K - 1] += miss
    R = 60 * int(s + 1)
    yy = np.arange(-R, R + 1)
    exact = np.exp(-(yy**2) / (2 * s * s))
    exact /= exact.sum()
    full = np.zeros(len(yy))
    full[ys + R] = law
    return 0.5 * float(np.abs(full - exact).sum())


@pytest.mark.parametrize("s", [0.5, 2.5])
def test_sampler_tv_matches_a_direct_enumeration(s):
    assert pf.sampler_tv(s) == pytest.approx(_direct_tv(s), rel=1e-6, abs=1e-15)


@pytest.mark.parametrize("s", [0.5, 30.0, 300.0])
def test_sampler_tv_is_about_the_resolution_of_float32(s):
    """Not zero (the float32 law is not the exact one), and near 2**-24."""
    assert 2.0**-27 < pf.sampler_tv(s) < 2.0**-21


def test_sampler_tv_sees_a_sampler_that_stops_too_early(monkeypatch):
    """With one pass the rejected coordinates (about half) come out 0: a large TV."""
    monkeypatch.setattr(ddp, "MAX_PASSES", 1)
    pf.sampler_tv.cache_clear()
    try:
        assert pf.sampler_tv(3.0) > 0.1
    finally:
        pf.sampler_tv.cache_clear()


def _modules(n=8, d=3, bits=16):
    @fcir.program(placements={"clients": n}, private=True)
    def ddp_round(w, keys, x):
        upd = fcir.map_fn(lambda w, x: x - w, (fcir.broadcast(w), x))
        return w + fcir.ddp_mean(upd, 1.0, 1.1, keys, bits=bits)

    @fcir.program(placements={"clients": n}, private=True)
    def dp_round(w, key, x):
        upd = fcir.map_fn(lambda w, x: x - w, (fcir.broadcast(w), x))
        return w + fcir.dp_mean(upd, 1.0, 1.1, key)

    x, w = jnp.ones((n, d)), jnp.zeros(d)
    keys = jax.random.split(jax.random.key(0), n)
    return fcir.capture(ddp_round, w, keys, x), fcir.capture(dp_round, w, jax.random.key(0), x)


def test_round_cost_and_budget_report_delta_with_the_sampler_term():
    m, central = _modules()
    p = ddp.params(3, 8, 1.0, 1.1, 16)
    tv = 8 * 4 * pf.sampler_tv(p.local_stddev)  # n clients x D = 4 coordinates
    assert fcir.privacy.sampler_tv(m, 5) == pytest.approx(5 * tv, rel=1e-12)
    cost = fcir.privacy.round_cost(m, 1e-5)
    eps1 = fcir.privacy.epsilon(m, 1, 1e-5)
    assert cost["sampler_tv_per_round"] == pytest.approx(tv, rel=1e-12)
    assert cost["delta_with_sampler"] == pytest.approx(1e-5 + (1 + math.exp(eps1)) * tv)
    assert cost["delta_with_sampler"] > 1e-5
    text = "\n".join(fcir.privacy.format_round_cost(cost))
    assert "float32 discrete Gaussian" in text and "within TV" in text

    b = fcir.privacy.Budget(m, 1e-5, 50.0)
    assert b.delta_with_sampler == 1e-5  # nothing spent yet
    eps = b.spend(3)
    assert b.sampler_tv == pytest.approx(3 * tv, rel=1e-12)
    assert b.delta_with_sampler == pytest.approx(1e-5 + (1 + math.exp(eps)) * 3 * tv)
    assert b.state()["delta_with_sampler"] == b.delta_with_sampler
    again = fcir.privacy.Budget.from_state(m, b.state())
    assert again.delta_with_sampler == b.delta_with_sampler

    # central DP samples no discrete Gaussian: nothing is added
    assert fcir.privacy.sampler_tv(central, 5) == 0
    assert "delta_with_sampler" not in fcir.privacy.round_cost(central, 1e-5)
    cb = fcir.privacy.Budget(central, 1e-5, 50.0)
    cb.spend(3)
    assert cb.delta_with_sampler == 1e-5


def test_delta_with_sampler_is_capped_at_one():
    assert pf.delta_with_sampler(8.0, 1e-5, 0.2) == 1.0
    assert pf.delta_with_sampler(1.0, 1e-5, 0.0) == 1e-5
