"""The accountant counts only what was added: a Poisson-sampled ddp round is refused,
a NumPy integer is a count of rounds (anything else a PrivacyError), and a budget
names a bad delta or sampling rate."""

from __future__ import annotations

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fcir

N = 4
HIER = {"silos": 2, "clients": 2}
W = jnp.asarray([0.5, -1.0, 2.0], jnp.float32)
KEY = jax.random.key(3)
X = jnp.asarray(np.random.default_rng(0).normal(size=(N, 3)), jnp.float32)


def private(fn, placements=HIER):
    return fcir.program(placements=placements, private=True)(fn)


def updates(w, x):
    return fcir.map_fn(lambda w, x: x - w, (fcir.broadcast(w), x))


# --- distributed DP: the noise accounted is the noise added -------------------------------


def test_a_poisson_sampled_ddp_round_is_refused_since_only_sampled_clients_add_noise():
    # Each client adds 1/n of the noise's variance; a round sampled at q sums about q*n
    # shares. Before, epsilon at q=0.1 was the figure at q=1 (as if all n shares were in
    # the sum), for a sum that carries about a tenth of that noise's variance.
    def ddp_round(w, keys, x):
        return w + fcir.ddp_mean(updates(w, x), 1.0, 1.0, keys, bits=16)

    m = fcir.capture(private(ddp_round, {"clients": N}), W, jax.random.split(KEY, N), X)
    everyone = fcir.privacy.epsilon(m, 10, 1e-5)
    assert everyone > 0
    with pytest.raises(fcir.PrivacyError, match=r"sampled at rate 0.1 .*sampling_rate=1.0"):
        fcir.privacy.epsilon(m, 10, 1e-5, sampling_rate=0.1)
    with pytest.raises(fcir.PrivacyError, match="sampled at rate 0.5"):
        fcir.privacy.Budget(m, 1e-5, 50.0, sampling_rate=0.5)
    assert fcir.privacy.Budget(m, 1e-5, 50.0).epsilon_after(10) == everyone

    # Central DP's noise is the server's, whoever is sampled: amplified as before.
    def dp_round(w, key, x):
        return w + fcir.dp_mean(updates(w, x), 1.0, 1.0, key)

    c = fcir.capture(private(dp_round, {"clients": N}), W, KEY, X)
    assert fcir.privacy.epsilon(c, 10, 1e-5, sampling_rate=0.1) < fcir.privacy.epsilon(c, 10, 1e-5)


# --- a number of rounds from NumPy (a config, np.arange) is a count like a Python int -----


@fcir.program(placements={"clients": 4}, private=True)
def _dp_round(w, key, x):
    upd = fcir.map_fn(lambda w, x: x - w, (fcir.broadcast(w), x))
    return w + fcir.dp_mean(upd, 1.0, 1.1, key)


def _dp_module():
    return fcir.capture(_dp_round, jnp.zeros(3), jax.random.key(0), jnp.ones((4, 3)))


def test_epsilon_sampler_tv_and_budget_take_numpy_integer_rounds_as_ints():
    module = _dp_module()
    rounds = np.arange(1, 4)[-1]  # np.int64(3)
    assert fcir.privacy.epsilon(module, rounds, 1e-5) == fcir.privacy.epsilon(module, 3, 1e-5)
    assert fcir.privacy.sampler_tv(module, rounds) == fcir.privacy.sampler_tv(module, 3)
    budget = fcir.privacy.Budget(module, 1e-5, 100.0)
    assert budget.spend(rounds=rounds) == fcir.privacy.epsilon(module, 3, 1e-5)
    state = json.loads(json.dumps(budget.state()))  # still JSON-able: a Python int
    assert state["rounds"] == 3 and type(state["rounds"]) is int


def test_a_sampled_round_s_rdp_epsilon_is_near_pld_s_without_dp_accounting_s_warnings(caplog):
    """docs/population.md's private cohorts: noise 1.0, 20 rounds at q = 0.1, δ = 1e-5.
    dp-accounting's RDP accountant gives up on the series of orders 1.1 to 1.5 and logs
    a warning for each, orders that could not give the smallest ε: none is printed, ε
    is dp-accounting's own, an upper bound at most 20% above the privacy loss
    distribution's (the page says so)."""
    import logging

    import dp_accounting as dpa

    @fcir.program(placements={"clients": 4}, private=True)
    def dp_round(w, key, x):
        return w + fcir.dp_sum(updates(w, x), 0.5, 1.0, key)

    module = fcir.capture(dp_round, jnp.zeros(3), KEY, jnp.ones((4, 3)))
    with caplog.at_level(logging.WARNING):
        rdp = fcir.privacy.epsilon(module, 20, 1e-5, 0.1)
    assert caplog.records == []
    sampled = dpa.PoissonSampledDpEvent(0.1, dpa.GaussianDpEvent(1.0))
    logging.disable(logging.WARNING)  # dp-accounting's own warnings, when asked directly
    try:
        want = dpa.rdp.RdpAccountant().compose(dpa.SelfComposedDpEvent(sampled, 20))
    finally:
        logging.disable(logging.NOTSET)
    assert rdp == want.get_epsilon(1e-5)
    pld = fcir.privacy.epsilon(module, 20, 1e-5, 0.1, accountant="pld")
    assert pld <= rdp <= 1.2 * pld, (rdp, pld)
    page = (pathlib.Path(__file__).parents[2] / "docs" / "population.md").read_text()
    assert f"ε = {rdp:.2f}" in page and f"{pld:.2f}" in page and "20%" in page


@pytest.mark.parametrize("rounds", [np.True_, True, 1.0, np.float32(2), -1, np.int32(-1)])
def test_rounds_that_are_not_a_count_are_still_a_privacy_error(rounds):
    with pytest.raises(fcir.PrivacyError, match="rounds must be an int >= 0"):
        fcir.privacy.epsilon(_dp_module(), rounds, 1e-5)


# --- the budget ---------------------------------------------------------------------------


def test_a_budget_names_a_bad_delta_or_sampling_rate_in_a_privacy_error():
    # Before: a raw ValueError / TypeError from float() (and a state edited to
    # delta="x" failed the same way on resume).
    def dp_round(w, key, x):
        return w + fcir.dp_mean(updates(w, x), 1.0, 1.0, key)

    m = fcir.capture(private(dp_round, {"clients": N}), W, KEY, X)
    for args, name in [
        (("x", 1.0), "delta"),
        ((None, 1.0), "delta"),
        ((1e-5, 1.0, "a"), "sampling_rate"),
    ]:
        with pytest.raises(
            fcir.PrivacyError, match=rf"^fcir.privacy.Budget: {name} must be a number"
        ):
            fcir.privacy.Budget(m, *args)
    state = fcir.privacy.Budget(m, 1e-5, 50.0).state()
    with pytest.raises(fcir.PrivacyError, match="delta must be a number"):
        fcir.privacy.Budget.from_state(m, {**state, "delta": "x"})
