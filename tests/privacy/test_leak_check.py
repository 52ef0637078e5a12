"""The privacy check rejects what would release client data not noised as accounted: a
DP op without noise, a silo's unnoised sum of its clients, a DP op in a while loop;
per-silo releases and a silo's own data still pass."""

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


# --- private programs: a DP op without noise is no DP op -------------------------------------


@pytest.mark.parametrize("op", [fcir.dp_sum, fcir.dp_mean])
def test_a_private_program_whose_dp_op_has_no_noise_is_rejected(op):
    """Before: ``noise_multiplier=0`` passed the private check (the clipped sum of client
    data reached the server un-noised) and only ``fcir.privacy.epsilon`` said inf."""

    @fcir.program(placements={"clients": N}, private=True)
    def round_(w, key, x):
        upd = fcir.map_fn(lambda w, x: x - w, (fcir.broadcast(w), x))
        return w + op(upd, 1.0, 0.0, key)

    with pytest.raises(fcir.PrivacyError, match="privacy/C1: fed.dp_.* has noise_multiplier=0"):
        fcir.capture(round_, jnp.zeros(3), jax.random.key(0), jnp.ones((N, 3)))
    # without private=True it is a clipped sum, as documented
    plain = fcir.program(placements={"clients": N})(round_.__wrapped__)
    fcir.capture(plain, jnp.zeros(3), jax.random.key(0), jnp.ones((N, 3)))


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
