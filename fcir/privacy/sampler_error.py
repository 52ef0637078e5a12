"""How far the discrete Gaussian noise of ``fcir.mechanisms.ddgauss`` is from the exact law, and what
that adds to δ.

The accountant (``fcir.privacy.epsilon``) bounds the privacy of the *exact* distributed
discrete Gaussian mechanism. The clients draw the noise with ``fcir.mechanisms.ddgauss.
discrete_gaussian_batch``: integer arithmetic only, the inverse CDF of ``|Y|`` tabulated
on the host as ``floor(2**96 P(|Y| <= k))`` and searched with a uniform 96-bit integer.
Its law differs from the discrete Gaussian only by those floors and by the mass past the
table's end: ``fcir.mechanisms.ddgauss.sampler_tv(s)`` bounds the total variation per coordinate,
about ``12 s * 2**-95`` (1e-24 at ``s = 5000``). The same on every backend: no float
enters a decision.

(The name is historical: fcir sampled in float32 before, whose law was ``2**-24`` off
per coordinate, enough to make the δ of a realistic run vacuous.)

**What it adds to δ.** One client's noise vector is ``D`` independent coordinates, a
release sums ``n`` clients' vectors, a round has ``count`` releases per op: the run's
output is within ``eta = rounds * sum(count * n * D * TV)`` in total variation of the
exact mechanism's (TV is subadditive over independent parts, and the decoding only
post-processes). If the exact mechanism is ``(ε, δ)``-DP, the one as run is ``(ε, δ +
(1 + e**ε) eta)``-DP (``delta_with_sampler``): for the digits example (``D = 1024``,
``n = 50``, 40 rounds, ε = 8.08) the added term is 1.1e-15 at 16 bits, 1.8e-14 at 20.
"""

from __future__ import annotations

import math

from fcir.mechanisms.ddgauss import sampler_tv as tv

__all__ = ["delta_with_sampler", "release_tv", "sampler_tv"]


def sampler_tv(stddev: float) -> float:
    """An upper bound on ``TV(P', P)`` for one coordinate of ``fcir.mechanisms.ddgauss.
    discrete_gaussian`` at ``stddev`` (``fcir.mechanisms.ddgauss.sampler_tv``); 0 for ``stddev == 0``
    (no noise is drawn)."""
    return tv(stddev)


def release_tv(p) -> float:
    """The total variation between one ``ddp_*`` release's noise and the exact one:
    ``n * D`` coordinates of ``sampler_tv(local_stddev)`` (``p``: a
    ``fcir.mechanisms.ddgauss.DdpParams``)."""
    return p.n * p.padded_dim * sampler_tv(p.local_stddev)


def delta_with_sampler(epsilon: float, delta: float, tv: float) -> float:
    """δ of the mechanism as run, whose output is within ``tv`` of an exact ``(epsilon,
    delta)``-DP one: ``delta + (1 + e**epsilon) tv`` (at most 1, a vacuous guarantee)."""
    if tv == 0:
        return delta
    return min(1.0, delta + (1.0 + math.exp(min(epsilon, 700.0))) * tv)
