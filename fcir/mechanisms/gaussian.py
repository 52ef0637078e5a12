"""The standard normal draws of the central DP ops (``fed.dp_sum``, ``fed.dp_mean``).

``jax.random.normal`` computes ``sqrt(2) erfinv(u)`` from a uniform ``u`` on a grid of
``2**-23`` (float32): its draws never pass about ``[-5.42, 5.22]`` standard deviations.
Past that edge only the neighbour whose sum is ``clip_norm`` higher can land, a δ the
accountant does not count (about 1.2e-5 per release at noise multiplier 1).

This sampler inverts the normal CDF at a uniform with the resolution of a float near 0:
a sign bit, and ``W`` uniform on ``(0, 1/2)`` as a float whose binade is geometric (the
leading zeros of a random bit stream: ``W`` in ``[2**-(e+2), 2**-(e+1))`` with
probability ``2**-(e+1)``) and whose significand is uniform, then ``|Z| = -ndtri(W)``.
Every binade of ``W`` down to ``2**-126`` (float32's smallest normal; ``e`` is capped at
``CAP`` and the mass below lumped into the last binade) holds ``2**p`` equally likely
values (``p``: 23 significand bits in float32, 52 in float64), so the tail of ``|Z|`` is
drawn to the float's relative resolution out to ``MAX_SIGMA`` (12.95), beyond which the
Gaussian has mass ``2 * 2**-126`` (2.4e-38).

The bit stream's first part comes with the significand (two ``uint32`` words per draw
in float32, three in float64: 40 and 43 leading bits); only if some draw's first part is
all zero (probability ``2**-40`` per draw) are three more words drawn for every draw,
under a ``lax.cond``: the same values either way, one word more than
``jax.random.normal`` in the common case. Everything is integer bit work and one
``ndtri``, compiled as one ``jax.jit`` computation, so the reference interpreter (eager)
and the XLA backend (inlined) run the same float ops.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["CAP", "MAX_SIGMA", "dp_noise", "from_words", "standard_normal", "words"]

CAP = 124  # the largest binade index e: W >= 2**-(CAP + 2) = 2**-126
MAX_SIGMA = 12.949953  # -ndtri(2**-126): the largest |Z| the sampler can draw
_TAIL_WORDS = 3


def _layout(dtype):
    """(significand bits, words carrying significand + sign + first exponent bits)."""
    return (52, 3) if np.dtype(dtype) == np.float64 else (23, 2)


def words(key, shape, dtype) -> tuple:
    """The random words of ``standard_normal(key, shape, dtype)``: the main words
    ``uint32[m, *shape]`` and a function giving the tail words ``uint32[3, *shape]``."""
    _, m = _layout(dtype)
    k_main, k_tail = jax.random.split(key)
    main = jax.random.bits(k_main, (m, *shape), jnp.uint32)
    return main, lambda: jax.random.bits(k_tail, (_TAIL_WORDS, *shape), jnp.uint32)


def _pieces(main, dtype):
    """(significand as uint, sign bit, exponent-stream pieces [(word, bits)])."""
    p, _ = _layout(dtype)
    if p == 23:
        w0, w1 = main[0], main[1]
        return w0 & 0x7FFFFF, (w0 >> 23) & 1, [(w0 >> 24, 8), (w1, 32)]
    w0, w1, w2 = main[0], main[1], main[2]
    sig = (w1.astype(jnp.uint64) & 0xFFFFF) << 32 | w0.astype(jnp.uint64)
    return sig, (w1 >> 20) & 1, [(w1 >> 21, 11), (w2, 32)]


def _leading_zeros(pieces, rest):
    """Leading zeros of the bit stream ``pieces`` (most significant first), then
    ``rest`` (what the stream after them counts) where they are all zero."""
    acc = rest
    for w, b in reversed(pieces):
        lz = jax.lax.clz(w).astype(jnp.int32) - (32 - b)
        acc = jnp.where(w != 0, lz, b + acc)
    return acc


def from_words(main, tail, dtype):
    """The standard normal draws the words give (``tail``: the tail words, or None
    when no draw's main exponent bits are all zero). Deterministic in the words."""
    p, _ = _layout(dtype)
    sig, neg, pieces = _pieces(main, dtype)
    if tail is None:
        rest = jnp.full(main.shape[1:], CAP, jnp.int32)
    else:
        rest = _leading_zeros([(t, 32) for t in tail], jnp.full(main.shape[1:], CAP, jnp.int32))
    e = jnp.minimum(_leading_zeros(pieces, rest), CAP)
    if p == 23:
        bits = ((125 - e).astype(jnp.uint32) << 23) | sig
        w = jax.lax.bitcast_convert_type(bits, jnp.float32)
    else:
        bits = ((1021 - e).astype(jnp.uint64) << 52) | sig
        w = jax.lax.bitcast_convert_type(bits, jnp.float64)
    z = -jax.scipy.special.ndtri(w)
    return jnp.where(neg == 1, -z, z)


@partial(jax.jit, static_argnums=(1, 2))
def standard_normal(key, shape, dtype=jnp.float32):
    """``N(0, 1)`` draws of ``shape`` in ``dtype`` (float32 or float64) from ``key``,
    with tails to ``MAX_SIGMA`` (module docstring)."""
    main, tail = words(key, shape, dtype)
    pieces = _pieces(main, dtype)[2]
    zero = jnp.ones(main.shape[1:], bool)
    for w, _ in pieces:
        zero = zero & (w == 0)
    return jax.lax.cond(
        jnp.any(zero),
        lambda: from_words(main, tail(), dtype),
        lambda: from_words(main, None, dtype),
    )


def dp_noise(key, i: int, shape, dtype, clip_norm: float, noise_multiplier: float):
    """The noise added to leaf ``i``: ``noise_multiplier * clip_norm * N(0, 1)`` drawn
    with ``fold_in(key, i)``, so every leaf gets independent noise from one key, by
    ``fcir.mechanisms.gaussian.standard_normal`` (tails to 12.95 standard deviations, where
    ``jax.random.normal`` in float32 stops at 5.4).

    A leaf narrower than float32 (bf16, f16) draws in float32 and rounds once: drawn in
    bf16, a normal has 128 values, none beyond 2.9 standard deviations (f16: 3.5), a
    truncated Gaussian whose edge gives away a shift of ``clip_norm`` (at noise
    multiplier 1, with probability 3% per release, against the accountant's δ)."""
    draw = jnp.float32 if jnp.finfo(dtype).bits < 32 else dtype
    normal = standard_normal(jax.random.fold_in(key, i), tuple(shape), np.dtype(draw))
    return (noise_multiplier * clip_norm * normal).astype(dtype)
