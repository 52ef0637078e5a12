"""Privacy leaks the check used to accept, and accounting that used to be unsound: each
test is a realistic private program (or accountant call) that fcir got wrong before."""

from __future__ import annotations

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
XH = X.reshape(2, 2, 3)  # {{f32[3]}@clients}@silos
SILO_KEYS = jax.random.split(KEY, 2)  # {key}@silos: one key per silo, as an argument


def private(fn, placements=HIER):
    return fcir.program(placements=placements, private=True)(fn)


def updates(w, x):
    return fcir.map_fn(lambda w, x: x - w, (fcir.broadcast(w), x))


# --- hierarchical programs: a silo is a party above its clients --------------------------


def test_an_unnoised_sum_of_a_silos_clients_is_rejected_though_the_server_adds_noise():
    # The server's dp_mean clips each silo's sum: it bounds what one *silo* adds. One
    # client moves its silo's clipped sum by up to 2 * clip_norm, twice the sensitivity
    # the accountant used for its client-level epsilon; and the silo holds the clients'
    # un-noised sum. Before, this passed with epsilon of a client-level release.
    def silo_sums(w, key, x):
        per_silo = fcir.map_fn(lambda w, x: fcir.reduce_sum(updates(w, x)), (fcir.broadcast(w), x))
        return w + fcir.dp_mean(per_silo, 1.0, 1.0, key)

    with pytest.raises(
        fcir.PrivacyError,
        match=r"^fed.sum \(op 1/0/2, .*privacy/C1: fed.sum releases a value derived from "
        r"client data to each member of 'silos' without noise",
    ):
        fcir.capture(private(silo_sums), W, KEY, XH)
    # Not declared private, the same program is an ordinary one.
    fcir.capture(fcir.program(placements=HIER)(silo_sums), W, KEY, XH)


def test_a_silos_unnoised_client_sum_fed_into_its_clients_updates_is_rejected():
    # Each silo adds its clients' sum to every client's update, then releases with DP:
    # one client's data is then in every clipped update of its silo, so the per-client
    # clip no longer bounds what one client adds. Before, this passed.
    def contaminated(w, keys, x):
        def silo(w, k, x):
            total = fcir.reduce_sum(x)
            u = fcir.map_fn(lambda t, x: x + 100.0 * t, (fcir.broadcast(total), x))
            return fcir.dp_sum(u, 1.0, 1.0, k)

        return w + fcir.reduce_sum(fcir.map_fn(silo, (fcir.broadcast(w), keys, x)))

    with pytest.raises(fcir.PrivacyError, match=r"^fed.sum \(op 1/0/0, .*privacy/C1: .*'silos'"):
        fcir.capture(private(contaminated), W, SILO_KEYS, XH)


def test_a_silo_branching_on_the_max_of_its_clients_is_rejected():
    def branch(w, key, x):
        def silo(w, x):
            top = fcir.reduce_max(fcir.map_fn(jnp.sum, x))
            return jax.lax.cond(top > 0, lambda: 2.0 * w, lambda: w)

        return fcir.dp_mean(fcir.map_fn(silo, (fcir.broadcast(w), x)), 1.0, 1.0, key)

    with pytest.raises(fcir.PrivacyError, match=r"^fed.max \(op 1/0/1, .*privacy/C1"):
        fcir.capture(private(branch), W, KEY, XH)
    # The leak check names the one op; the cond after it is not reported again.
    public = fcir.capture(fcir.program(placements=HIER)(branch), W, KEY, XH)
    (leak,) = fcir.privacy.leaks(public)
    assert (leak.code, leak.op.name, leak.path) == ("privacy/C1", "fed.max", (1, 0, 1))


def test_per_silo_dp_releases_and_a_silos_own_data_still_pass():
    # The hierarchical programs that are private: each silo releases its clients' data
    # through a DP op of its own (central, in a scan, or distributed), and a silo's own
    # data (a {T}@silos argument) may go to its clients and back un-noised.
    def per_silo_scan(w, keys, x):
        def silo(w, k, x):
            def body(c, i):
                return c + fcir.dp_sum(updates(c, x), 1.0, 1.0, jax.random.fold_in(k, i)), None

            return jax.lax.scan(body, w, jnp.arange(3))[0]

        return fcir.reduce_mean(fcir.map_fn(silo, (fcir.broadcast(w), keys, x)))

    def own_data(w, keys, s, x):
        def silo(w, k, s, x):
            back = fcir.reduce_sum(fcir.map_fn(lambda s: 2.0 * s, fcir.broadcast(s)))
            return fcir.dp_sum(updates(w + back, x), 1.0, 1.0, k)

        return w + fcir.reduce_sum(fcir.map_fn(silo, (fcir.broadcast(w), keys, s, x)))

    def distributed(w, keys, x):
        def silo(w, k, x):
            return fcir.ddp_sum(updates(w, x), 1.0, 1.0, k, bits=16)

        return w + fcir.reduce_sum(fcir.map_fn(silo, (fcir.broadcast(w), keys, x)))

    m = fcir.capture(private(per_silo_scan), W, SILO_KEYS, XH)
    assert [(r.op, r.count) for r in fcir.privacy.releases(m)] == [("fed.dp_sum", 3)]
    fcir.capture(private(own_data), W, SILO_KEYS, jnp.ones((2, 3)), XH)
    client_keys = jax.random.split(KEY, 4).reshape(2, 2)
    m = fcir.capture(private(distributed), W, client_keys, XH)
    assert [r.op for r in fcir.privacy.releases(m)] == ["fed.ddp_sum"]


# --- DP ops the accountant cannot count ---------------------------------------------------


def test_a_dp_op_in_a_while_loop_is_rejected_by_the_check_not_only_by_the_accountant():
    # Before, the check passed it: fcir.check said "private" of a program whose epsilon
    # no one can state (fcir.privacy.epsilon raised only when asked).
    def until(w, key, x):
        def body(c):
            i, w = c
            noisy = fcir.dp_mean(updates(w, x), 1.0, 1.0, jax.random.fold_in(key, i))
            return i + 1, w + noisy

        return jax.lax.while_loop(lambda c: jnp.sum(c[1]) < 10.0, body, (0, w))[1]

    with pytest.raises(fcir.PrivacyError, match=r"^jax.while \(op .*privacy/C6: .*jax.lax.scan"):
        fcir.capture(private(until, {"clients": N}), W, KEY, X)

    # A fori_loop with Python bounds is a scan: counted, and it passes.
    def fixed(w, key, x):
        def body(i, w):
            return w + fcir.dp_mean(updates(w, x), 1.0, 1.0, jax.random.fold_in(key, i))

        return jax.lax.fori_loop(0, 3, body, w)

    m = fcir.capture(private(fixed, {"clients": N}), W, KEY, X)
    assert [(r.op, r.count) for r in fcir.privacy.releases(m)] == [("fed.dp_mean", 3)]
    assert "privacy/C6" in fcir.privacy.CONSTRAINTS


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


# --- the Gaussian noise itself ------------------------------------------------------------


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_noise_of_a_half_precision_leaf_has_gaussian_tails_beyond_three_sigma(dtype):
    # jax.random.normal drawn in bf16 takes 128 values, all within 2.9 sigma (f16:
    # 3.5): an output past the edge is possible only for the neighbour whose sum is
    # clip_norm higher, a delta of 3% per release at noise multiplier 1. Now the noise
    # is drawn in float32 and rounded once to the leaf's dtype.
    from fcir.interpreters import reference, xla

    def release(key, x):
        return fcir.dp_sum(x, 1.0, 1.0, key)

    x = jnp.zeros((N, 100_000), dtype)  # all-zero members: the release is the noise
    m = fcir.capture(private(release, {"clients": N}), KEY, x)
    for noise in (reference.run(m, KEY, x), xla.compile(m)(KEY, x)):
        assert noise.dtype == dtype
        noise = np.asarray(noise, np.float64)
        # 100k draws of N(0, 1): max |n| below 3.9 has probability under 1e-4.
        assert np.abs(noise).max() > 3.9
        assert len(np.unique(noise)) > 1000
        assert abs(noise.std() - 1.0) < 0.02


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


def test_a_flower_server_app_refuses_a_poisson_sampled_ddp_round_before_round_one():
    # With fraction < 1 a private app samples Poisson; for a ddp round its progress line
    # would otherwise claim every client's noise share. It now fails at start, saying why.
    pytest.importorskip("flwr", reason="the ServerApp needs flwr")
    import types

    from fcir.interpreters.flower.app import runtime, server_app

    def ddp_round(w, keys, x):
        return w + fcir.ddp_mean(updates(w, x), 1.0, 1.0, keys, bits=16)

    m = fcir.capture(private(ddp_round, {"clients": N}), W, jax.random.split(KEY, N), X)
    plan = {"privacy": {"ir": m.to_text(), "delta": 1e-5}}
    cfg = types.SimpleNamespace(fraction=0.5, poisson=True, clients=0, max_epsilon=None)
    with pytest.raises(runtime.AppError, match=r"^Poisson sampling q=0.5: .*sampled at rate 0.5"):
        server_app.Accounting(plan, cfg)
    every = types.SimpleNamespace(fraction=1.0, poisson=False, clients=0, max_epsilon=None)
    line = server_app.Accounting(plan, every).line(2)
    assert line.startswith(f"epsilon={fcir.privacy.epsilon(m, 2, 1e-5):.4g} after 2 round(s)")
