"""privacy/C7: the key of a DP release reaches nothing but that release (no result, no
other draw); keys apart from every release key are free to use."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fcir
from fcir.mechanisms import gaussian as dp_noise

N = 4
W = jnp.asarray([0.5, -1.0, 2.0], jnp.float32)
KEY = jax.random.key(3)
X = jnp.asarray(np.random.default_rng(0).normal(size=(N, 3)), jnp.float32)


def private(fn, private=True):
    return fcir.program(placements={"clients": N}, private=private)(fn)


def updates(w, x):
    return fcir.map_fn(lambda w, x: x - w, (fcir.broadcast(w), x))


# --- privacy/C7: the key of a release reaches something else -------------------------------


def dp(w, key, x):
    return w + fcir.dp_mean(updates(w, x), 1.0, 1.0, key)


def returns_the_key_argument(w, key, x):
    return dp(w, jax.random.fold_in(key, 0), x), key  # the caller feeds it back


def returns_the_release_key(w, key, x):
    sub = jax.random.fold_in(key, 0)
    return dp(w, sub, x), sub


def returns_a_key_derived_from_the_release_key(w, key, x):
    _, sub = jax.random.split(key)
    return dp(w, sub, x), jax.random.fold_in(sub, 0)  # leaf 0's noise key


def returns_a_carry_the_releases_derive(w, key, x):
    def step(c, _):
        w, k = c
        w = dp(w, k, x)
        return (w, jax.random.split(k)[0]), None  # the next key is fold_in(k, 0)

    return jax.lax.scan(step, (w, key), None, length=3)[0]


def returns_the_key_a_scan_folds_in(w, key, x):
    def step(w, i):
        return dp(w, jax.random.fold_in(key, i), x), None

    return jax.lax.scan(step, w, jnp.arange(3))[0], key


def returns_a_key_through_a_cond(w, key, x):
    k = jax.lax.cond(w[0] > 0, lambda k: k, lambda k: k, key)
    return dp(w, jax.random.fold_in(key, 1), x), k


def returns_the_key_data(w, key, x):
    return dp(w, jax.random.fold_in(key, 1), x), jax.random.key_data(key)


def returns_the_split_holding_the_release_key(w, key, x):
    keys = jax.random.split(key, 3)
    return dp(w, keys[1], x), keys


def cancels_the_noise(w, key, x):
    # The release minus the very draw its noise is: the exact clipped mean.
    sub = jax.random.fold_in(key, 0)
    out = fcir.dp_sum(updates(w, x), 1.0, 1.0, sub)
    return out - dp_noise.standard_normal(jax.random.fold_in(sub, 0), (3,), jnp.float32)


def redraws_the_noise_key_for_dropout(w, key, x):
    sub = jax.random.fold_in(key, 0)
    mask = jax.random.bernoulli(sub, 0.5, (3,))  # random_bits of the release's key
    return dp(w, sub, x) * mask


@pytest.mark.parametrize(
    "fn",
    [
        returns_the_key_argument,
        returns_the_release_key,
        returns_a_key_derived_from_the_release_key,
        returns_a_carry_the_releases_derive,
        returns_the_key_a_scan_folds_in,
        returns_a_key_through_a_cond,
        returns_the_key_data,
        returns_the_split_holding_the_release_key,
        cancels_the_noise,
        redraws_the_noise_key_for_dropout,
    ],
)
def test_a_program_whose_release_key_reaches_a_result_or_another_op_is_rejected(fn):
    # Before: all accepted. A returned key the caller feeds back draws the same noise
    # next round; a key (or its draws) among the results lets a reader recompute and
    # subtract the noise (cancels_the_noise returned the exact clipped sum).
    with pytest.raises(fcir.PrivacyError, match="privacy/C7"):
        fcir.capture(private(fn), W, KEY, X)
    m = fcir.capture(private(fn, False), W, KEY, X)  # not private: epsilon refuses it
    with pytest.raises(fcir.PrivacyError, match="privacy/C7"):
        fcir.privacy.epsilon(m, rounds=1, delta=1e-5)


def returns_the_key_it_split_off(w, key, x):
    key, sub = jax.random.split(key)
    return dp(w, sub, x), key


def returns_the_carry_after_splitting_each_step(w, key, x):
    def step(c, _):
        w, k = c
        k, sub = jax.random.split(k)
        return (dp(w, sub, x), k), None

    return jax.lax.scan(step, (w, key), None, length=3)[0]


def returns_a_sibling_and_draws_dropout_from_another(w, key, x):
    mask = jax.random.bernoulli(jax.random.fold_in(key, 2), 0.5, (3,))
    return dp(w, jax.random.fold_in(key, 0), x) * mask, jax.random.fold_in(key, 1)


@pytest.mark.parametrize(
    "fn",
    [
        returns_the_key_it_split_off,
        returns_the_carry_after_splitting_each_step,
        returns_a_sibling_and_draws_dropout_from_another,
    ],
)
def test_a_program_returning_or_drawing_from_a_key_apart_from_every_release_key_passes(fn):
    m = fcir.capture(private(fn), W, KEY, X)
    assert fcir.privacy.epsilon(m, rounds=1, delta=1e-5) > 0


def test_per_client_keys_of_a_ddp_release_drawn_again_at_the_clients_are_rejected():
    # The clients' keys of a ddp_mean also drawn from inside a map: the same noise bits.
    def ddp_round(w, keys, x):
        upd = fcir.map_fn(
            lambda w, k, x: x - w + jax.random.normal(k, (3,)), (fcir.broadcast(w), keys, x)
        )
        return w + fcir.ddp_mean(upd, 1.0, 1.1, keys, bits=16)

    keys = jax.random.split(KEY, N)
    with pytest.raises(fcir.PrivacyError, match="privacy/C7"):
        fcir.capture(private(ddp_round), W, keys, X)
