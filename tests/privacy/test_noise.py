"""The Gaussian noise: float32 draws reach twelve sigma, each binade of the uniform maps
to its quantile, half-precision leaves get Gaussian tails, reference and xla draw the
same bits; and a noised clipped sum may not overflow before the noise."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats
from fcir.interpreters import reference, xla

import fcir
from fcir.mechanisms import gaussian as dp_noise

N = 4
KEY = jax.random.key(3)


def private(fn, private=True):
    return fcir.program(placements={"clients": N}, private=private)(fn)


# --- the Gaussian's tails -------------------------------------------------------------------


def test_dp_noise_reaches_twelve_sigma_where_jax_random_normal_stopped_at_5_4(monkeypatch):
    # Before: jax.random.normal's float32 draws never passed [-5.42, 5.22] sigma, an
    # uncounted delta of 1.2e-5 per release at noise multiplier 1. All-zero random
    # words are the sampler's deepest tail: the uniform at 2**-126.
    monkeypatch.setattr(jax.random, "bits", lambda key, shape, dtype: jnp.zeros(shape, dtype))
    with jax.disable_jit():
        noise = np.asarray(dp_noise.dp_noise(KEY, 0, (5,), jnp.float32, 2.0, 0.5))
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
    m = fcir.capture(private(release), KEY, x)
    for noise in (reference.run(m, KEY, x), xla.compile(m)(KEY, x)):
        assert noise.dtype == dtype
        noise = np.asarray(noise, np.float64)
        # 100k draws of N(0, 1): max |n| below 3.9 has probability under 1e-4.
        assert np.abs(noise).max() > 3.9
        assert len(np.unique(noise)) > 1000
        assert abs(noise.std() - 1.0) < 0.02


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
