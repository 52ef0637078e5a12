"""How far the float32 discrete Gaussian sampler of ``fcir.ddp`` is from the exact law,
and what that adds to δ.

The accountant (``fcir.privacy.epsilon``) bounds the privacy of the *exact* distributed
discrete Gaussian mechanism. The clients sample in float32 (``fcir.ddp.
discrete_gaussian_batch``): uniforms on the grid ``m * 2**-23``, ``-log1p(-u)``
exponentials, ``floor(t * e)`` geometrics and an ``exp`` acceptance test, all rounded
to float32. So each noise coordinate follows a law ``P'`` a little off the discrete
Gaussian ``P``. This module computes that law exactly and its total variation
``TV(P', P)``:

* the geometric ``G = floor(t * fl(-log1p(-u)))``: the float32 values of all ``2**23``
  grid points, counted (``P'(G = k)``);
* the proposal ``Y = G1 - G2``: the correlation of that law with itself (FFT, float64);
* the acceptance: ``P'(accept | y) = ceil(a(y) * 2**23) / 2**23``, ``a(y)`` the float32
  ``exp(-(|y| - s**2/t)**2 / (2 s**2))`` the sampler computes;
* ``MAX_PASSES`` passes, the coordinates still rejected set to 0;

then ``TV = 1/2 sum_y |P'(y) - P(y)|`` against the exact pmf (float64, with its tails).
The float32 operations are evaluated with JAX on the default backend, the way the
sampler evaluates them there: the figure is exact for that backend's ``log1p`` and
``exp`` (other backends round those a few ulps differently; that difference is not
bounded here). Measured on CPU: about 6e-8 to 9e-8 per coordinate for ``s`` from 0.5
to 300, i.e. about ``2**-24``, the resolution of float32.

**What it adds to δ.** One client's noise vector is ``D`` independent coordinates, a
release sums ``n`` clients' vectors, a round has ``count`` releases per op: the run's
output is within ``eta = rounds * sum(count * n * D * TV)`` in total variation of the
exact mechanism's (TV is subadditive over independent parts, and the decoding only
post-processes). If the exact mechanism is ``(ε, δ)``-DP, the float32 one is ``(ε, δ +
(1 + e**ε) eta)``-DP (``delta_with_sampler``). That term is large: with ``D = 1024``,
``n = 50`` and 40 rounds ``eta`` is about 0.2, so at ε of a few the float32 guarantee
is vacuous, while the exact mechanism's stands. fcir states both (``fcir.privacy.
round_cost``, ``Budget.delta_with_sampler``); closing the gap takes a sampler exact in
integer arithmetic (Canonne, Kamath, Steinke 2020, Algorithm 1-3 with rationals).
"""

from __future__ import annotations

import functools
import math

import numpy as np

__all__ = ["delta_with_sampler", "release_tv", "sampler_tv"]

_GRID = 1 << 23  # jax.random.uniform's float32 values: m * 2**-23, m in [0, 2**23)


@functools.lru_cache(maxsize=1)
def _exponentials() -> np.ndarray:
    """``fl(-log1p(-u))`` for every float32 uniform ``u``, as jax.random.exponential."""
    import jax
    import jax.numpy as jnp

    u = jnp.arange(_GRID, dtype=jnp.uint32).astype(jnp.float32) * jnp.float32(2.0**-23)
    return np.asarray(jax.jit(lambda u: -jnp.log1p(-u))(u))


def _correlate(a: np.ndarray) -> np.ndarray:
    """``c[K - 1 + y] = sum_g a[g + y] a[g]`` for ``y`` in ``(-K, K)``, by FFT."""
    K = len(a)
    N = 1 << (2 * K - 1).bit_length()
    f = np.fft.rfft(a, N)
    c = np.fft.irfft(f * np.conj(f), N)
    out = np.concatenate([c[N - (K - 1) :], c[:K]]) if K > 1 else c[:1]
    return np.maximum(out, 0.0)


@functools.lru_cache(maxsize=256)
def sampler_tv(stddev: float) -> float:
    """``TV(P', P)`` of one coordinate of ``fcir.ddp.discrete_gaussian`` at ``stddev``
    (see the module docstring); 0 for ``stddev == 0`` (no noise is drawn)."""
    import jax
    import jax.numpy as jnp

    from fcir.ddp import MAX_PASSES

    if stddev == 0:
        return 0.0
    s = float(stddev)
    t = float(math.floor(s) + 1)
    s2 = s * s
    e = _exponentials()
    g = np.asarray(jax.jit(lambda e: jnp.floor(jnp.float32(t) * e))(e)).astype(np.int64)
    pg = np.bincount(g).astype(np.float64) / _GRID
    K = len(pg)
    py = _correlate(pg)
    ys = np.arange(-(K - 1), K)

    def accept(y):
        return jnp.exp(-jnp.square(jnp.abs(y) - s2 / t) / (2.0 * s2))

    a = np.asarray(jax.jit(accept)(jnp.asarray(ys, jnp.float32))).astype(np.float64)
    f = py * np.minimum(np.ceil(a * _GRID) / _GRID, 1.0)
    z = f.sum()
    miss = (1.0 - z) ** MAX_PASSES
    law = f * (1.0 - miss) / z
    law[K - 1] += miss
    # The exact law, over a range holding all of its mass that float64 sees.
    R = max(K - 1, int(math.ceil(40.0 * s)) + 2)
    yy = np.arange(-R, R + 1)
    exact = np.exp(-(yy.astype(np.float64) ** 2) / (2.0 * s2))
    exact /= exact.sum()
    full = np.zeros_like(exact)
    full[ys + R] = law
    return 0.5 * float(np.abs(full - exact).sum())


def release_tv(p) -> float:
    """The total variation between one ``ddp_*`` release's float32 noise and the exact
    one: ``n * D`` coordinates of ``sampler_tv(local_stddev)`` (``p``: a
    ``fcir.ddp.DdpParams``)."""
    return p.n * p.padded_dim * sampler_tv(p.local_stddev)


def delta_with_sampler(epsilon: float, delta: float, tv: float) -> float:
    """δ of the float32 mechanism whose output is within ``tv`` of an exact ``(epsilon,
    delta)``-DP one: ``delta + (1 + e**epsilon) tv`` (at most 1, a vacuous guarantee)."""
    if tv == 0:
        return delta
    return min(1.0, delta + (1.0 + math.exp(min(epsilon, 700.0))) * tv)
