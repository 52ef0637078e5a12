"""fcir.privacy.Budget: spending ε round by round, refusing past max_epsilon, state."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import pytest

import fcir


def _module(z=1.0, n=10, name="round_"):
    @fcir.program(placements={"clients": n}, private=True)
    def round_(w, key, x):
        upd = fcir.map_fn(lambda w, x: x - w, (fcir.broadcast(w), x))
        return w + fcir.dp_mean(upd, 1.0, z, key)

    return fcir.capture(round_, jnp.zeros(3), jax.random.key(0), jnp.ones((n, 3)), name=name)


def test_spend_returns_the_accountants_epsilon_of_all_rounds_so_far():
    m = _module()
    b = fcir.privacy.Budget(m, 1e-5, 100.0)
    assert (b.rounds, b.epsilon) == (0, 0.0)
    e1 = b.spend()
    e3 = b.spend(rounds=2)
    assert b.rounds == 3 and b.epsilon == e3
    assert e1 == fcir.privacy.epsilon(m, 1, 1e-5)
    assert e3 == fcir.privacy.epsilon(m, 3, 1e-5)


def test_spend_past_max_epsilon_raises_and_spends_nothing():
    m = _module()
    limit = fcir.privacy.epsilon(m, 4, 1e-5)
    b = fcir.privacy.Budget(m, 1e-5, limit * 1.0001)
    b.spend(rounds=3)
    assert b.can_spend(1) and not b.can_spend(2)
    with pytest.raises(fcir.PrivacyError, match="past max_epsilon"):
        b.spend(rounds=2)
    assert b.rounds == 3 and b.epsilon == fcir.privacy.epsilon(m, 3, 1e-5)
    b.spend()
    with pytest.raises(fcir.PrivacyError):
        b.spend()
    assert b.rounds == 4


def test_state_is_json_and_restores_for_the_same_program_only():
    m = _module()
    b = fcir.privacy.Budget(m, 1e-5, 50.0, sampling_rate=0.5)
    b.spend(rounds=5)
    state = json.loads(json.dumps(b.state()))
    again = fcir.privacy.Budget.from_state(_module(), state)
    assert (again.rounds, again.epsilon, again.max_epsilon) == (5, b.epsilon, 50.0)
    assert again.spend() == fcir.privacy.epsilon(m, 6, 1e-5, 0.5)
    with pytest.raises(fcir.PrivacyError, match="another program"):
        fcir.privacy.Budget.from_state(_module(z=2.0), state)
    with pytest.raises(fcir.PrivacyError, match="version"):
        fcir.privacy.Budget.from_state(m, {"rounds": 1})


def test_budget_of_a_ddp_program_uses_its_accounting():
    n = 10

    @fcir.program(placements={"clients": n}, private=True)
    def round_(w, keys, x):
        upd = fcir.map_fn(lambda w, x: x - w, (fcir.broadcast(w), x))
        return w + fcir.ddp_mean(upd, 1.0, 1.0, keys, bits=12)

    m = fcir.capture(round_, jnp.zeros(3), jax.random.split(jax.random.key(0), n), jnp.ones((n, 3)))
    b = fcir.privacy.Budget(m, 1e-5, 100.0)
    assert b.spend(rounds=7) == fcir.privacy.epsilon(m, 7, 1e-5)
    assert b.epsilon > fcir.privacy.epsilon(_module(), 7, 1e-5)


@pytest.mark.parametrize(
    "kw",
    [
        {"max_epsilon": 0.0},
        {"max_epsilon": float("inf")},
        {"delta": 0.0},
        {"sampling_rate": 2.0},
        {"accountant": "moments"},
    ],
)
def test_bad_parameters_are_privacy_errors(kw):
    args = {"delta": 1e-5, "max_epsilon": 1.0, **kw}
    with pytest.raises(fcir.PrivacyError):
        fcir.privacy.Budget(_module(), **args)
    with pytest.raises(fcir.PrivacyError):
        fcir.privacy.Budget(_module(), 1e-5, 10.0).spend(rounds=-1)


@pytest.mark.slow  # runs the digits example end to end (docs/contributing.md: examples are slow)
def test_the_digits_example_stops_before_the_round_that_would_pass_max_epsilon(tmp_path, capsys):
    from examples_testing import load

    example = load("dp_fedavg_digits")
    # ε after 2 rounds at the example's defaults is 1.48, after 3 rounds 1.85
    curves = example.main(
        ["--rounds", "5", "--max-epsilon", "1.6", "--ddp-bits", "--output", str(tmp_path / "p.png")]
    )
    assert len(curves["dp_fedavg"]) == 2 and curves["epsilon"][-1] <= 1.6
    assert "stopping before round 3" in capsys.readouterr().out
