"""Releases the privacy check accepted, or noise the accountant over-trusted, found by
reading fcir as an adversary would: the float32 noise's cut tails, and keys of a DP
release that reach something other than the release (privacy/C7)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats
from fcir.interpreters import reference, xla

import fcir
from fcir.frontend import primitives as P
from fcir.mechanisms import gaussian as dp_noise

N = 4
W = jnp.asarray([0.5, -1.0, 2.0], jnp.float32)
KEY = jax.random.key(3)
X = jnp.asarray(np.random.default_rng(0).normal(size=(N, 3)), jnp.float32)


def private(fn, private=True):
    return fcir.program(placements={"clients": N}, private=private)(fn)


def updates(w, x):
    return fcir.map_fn(lambda w, x: x - w, (fcir.broadcast(w), x))


# --- the Gaussian's tails -------------------------------------------------------------------


def test_dp_noise_reaches_twelve_sigma_where_jax_random_normal_stopped_at_5_4(monkeypatch):
    # Before: jax.random.normal's float32 draws never passed [-5.42, 5.22] sigma, an
    # uncounted delta of 1.2e-5 per release at noise multiplier 1. All-zero random
    # words are the sampler's deepest tail: the uniform at 2**-126.
    monkeypatch.setattr(jax.random, "bits", lambda key, shape, dtype: jnp.zeros(shape, dtype))
    with jax.disable_jit():
        noise = np.asarray(P.dp_noise(KEY, 0, (5,), jnp.float32, 2.0, 0.5))
    assert np.all(np.abs(noise) >= 12.9)  # 0.5 * 2.0 * 12.95


@pytest.mark.parametrize("e", [0, 7, 8, 39, 40, 41, 80, 123, 124])
def test_each_binade_of_the_uniform_maps_to_the_gaussian_quantile_it_stands_for(e):
    # e leading zeros in the exponent stream (8 bits of word 0, word 1, then the tail
    # words): the uniform is 2**-(e+2) (zero significand), |Z| its upper quantile.
    stream = np.zeros(136, np.uint32)
    stream[e] = 1 if e < 124 else 0
    b0 = int("".join(map(str, stream[:8])), 2)
    words = [int("".join(map(str, stream[8 + 32 * j : 40 + 32 * j])), 2) for j in range(4)]
    main = jnp.asarray([[b0 << 24], [words[0]]], jnp.uint32)
    tail = jnp.asarray([[w] for w in words[1:]], jnp.uint32)
    got = float(dp_noise.from_words(main, tail, jnp.float32)[0])
    want = -scipy.stats.norm.ppf(2.0 ** -(e + 2))
    assert got == pytest.approx(want, rel=2e-6)
    if e == 124:
        assert got == pytest.approx(dp_noise.MAX_SIGMA, rel=1e-7)


def test_the_tail_words_change_no_draw_that_the_first_words_decide():
    # The sampler draws three more words only when some draw's first 40 exponent bits are
    # all zero (a lax.cond): every other draw must come out the same either way.
    main, tail = dp_noise.words(KEY, (10_000,), jnp.float32)
    a = np.asarray(dp_noise.from_words(main, tail(), jnp.float32))
    b = np.asarray(dp_noise.from_words(main, None, jnp.float32))
    assert np.array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_noise_is_standard_normal_and_the_same_bits_on_reference_and_xla(dtype):
    def release(key, x):
        return fcir.dp_sum(x, 1.0, 1.0, key)

    x = jnp.zeros((N, 50_000), dtype)  # all-zero members: the release is the noise
    m = fcir.capture(private(release), KEY, x)
    ref, comp = reference.run(m, KEY, x), xla.compile(m)(KEY, x)
    assert ref.dtype == comp.dtype == dtype
    ref, comp = np.asarray(ref, np.float32), np.asarray(comp, np.float32)
    assert np.array_equal(ref.view(np.uint32), comp.view(np.uint32))
    assert scipy.stats.kstest(ref, "norm").pvalue > 1e-3
    assert abs(ref.std() - 1.0) < 0.02


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


# --- the clipped sum overflows before the noise ---------------------------------------------


def test_a_float16_dp_sum_that_can_overflow_before_the_noise_is_refused():
    # Before: 4 float16 members of 17000 (clip 30000) summed to inf before the noise,
    # so the release was inf in every run, while 3 of them (51000) gave inf in 31% of
    # runs: the finite outputs told the cohorts apart, a delta near 0.7.
    def release(key, x):
        return fcir.dp_sum(x, 30000.0, 1.0, key)

    x = jnp.full((N, 1), 17000.0, jnp.float16)
    with pytest.raises(fcir.IRTypeError, match="fed.dp_sum/C7"):
        fcir.capture(private(release), KEY, x)
    fcir.capture(private(release), KEY, x.astype(jnp.float32))  # f32 has the range
    fcir.capture(private(lambda k, x: fcir.dp_sum(x, 10000.0, 1.0, k)), KEY, x)  # 40000


def test_a_dp_sum_without_noise_may_overflow_as_jnp_sum_does():
    """noise_multiplier 0 claims no privacy (the plain clipped sum, e.g. to debug a
    round with DP off), so its sum may overflow like jnp.sum's; one with noise may not."""

    @fcir.program(placements={"clients": N})
    def plain(x, key):
        return fcir.dp_sum(x, 1e6, 0.0, key)

    x = jnp.full((N, 1), 17000.0, jnp.float16)
    got = reference.run(fcir.capture(plain, x, KEY), x, KEY)
    assert np.isinf(np.asarray(got)).all() and np.isinf(np.asarray(jnp.sum(x, 0))).all()
    with pytest.raises(fcir.IRTypeError, match="fed.dp_sum/C7"):
        fcir.capture(
            fcir.program(placements={"clients": N})(lambda x, key: fcir.dp_sum(x, 1e6, 0.5, key)),
            x,
            KEY,
        )
