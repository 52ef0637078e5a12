"""The discrete Gaussian sampler's distance from the exact law (fcir.mechanisms.ddgauss.sampler_tv,
reported through fcir.privacy.sampler_error) and the δ it adds in what fcir reports."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import pytest

import fcir
from fcir.mechanisms import ddgauss as ddp
from fcir.privacy import sampler_error as pf


def _modules(n=8, d=3, bits=16, z=1.1, clip=1.0):
    @fcir.program(placements={"clients": n}, private=True)
    def ddp_round(w, keys, x):
        upd = fcir.map_fn(lambda w, x: x - w, (fcir.broadcast(w), x))
        return w + fcir.ddp_mean(upd, clip, z, keys, bits=bits)

    @fcir.program(placements={"clients": n}, private=True)
    def dp_round(w, key, x):
        upd = fcir.map_fn(lambda w, x: x - w, (fcir.broadcast(w), x))
        return w + fcir.dp_mean(upd, clip, z, key)

    x, w = jnp.ones((n, d)), jnp.zeros(d)
    keys = jax.random.split(jax.random.key(0), n)
    return fcir.capture(ddp_round, w, keys, x), fcir.capture(dp_round, w, jax.random.key(0), x)


def test_round_cost_and_budget_report_delta_with_the_sampler_term():
    m, central = _modules()
    p = ddp.params(3, 8, 1.0, 1.1, 16)
    tv = 8 * 4 * ddp.sampler_tv(p.local_stddev)  # n clients x D = 4 coordinates
    assert tv > 0 and pf.sampler_tv(p.local_stddev) == ddp.sampler_tv(p.local_stddev)
    assert fcir.privacy.sampler_tv(m, 5) == pytest.approx(5 * tv, rel=1e-12)
    cost = fcir.privacy.round_cost(m, 1e-5)
    eps1 = fcir.privacy.epsilon(m, 1, 1e-5)
    assert cost["sampler_tv_per_round"] == pytest.approx(tv, rel=1e-12)
    assert cost["delta_with_sampler"] == pytest.approx(1e-5 + (1 + math.exp(eps1)) * tv)
    text = "\n".join(fcir.privacy.format_round_cost(cost))
    assert "discrete Gaussian sampler" in text and "within TV" in text

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


@pytest.mark.parametrize("bits", [16, 20])
def test_the_digits_example_run_keeps_its_delta(bits):
    """The digits example (650 elements, D = 1024, 50 clients, clip 0.5, 40 rounds, at
    the noise matching central DP's 4.0): with the float32 sampler the run's δ was
    vacuous (about 0.18 of TV); with the integer one the added term is below 1e-10."""
    z = ddp.noise_multiplier_for(4.0, 650, 50, 0.5, bits)
    m, _ = _modules(n=50, d=650, bits=bits, z=z, clip=0.5)
    eps = fcir.privacy.epsilon(m, 40, 1e-5)
    tv = fcir.privacy.sampler_tv(m, 40)
    assert 0 < tv < 1e-15
    assert pf.delta_with_sampler(eps, 1e-5, tv) - 1e-5 < 1e-10
    b = fcir.privacy.Budget(m, 1e-5, 100.0)
    b.spend(40)
    assert 1e-5 < b.delta_with_sampler < 1e-5 + 1e-10


def test_delta_with_sampler_is_capped_at_one():
    assert pf.delta_with_sampler(8.0, 1e-5, 0.2) == 1.0
    assert pf.delta_with_sampler(1.0, 1e-5, 0.0) == 1e-5
