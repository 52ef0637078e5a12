"""Clipping a member's pytree to an L2 norm: the clip of every DP aggregate.

``clip_member`` is the one rule of the central DP ops (``fed.dp_sum``, ``fed.dp_mean``)
and, through ``clip_scale`` and ``pairwise_sum``, of the distributed ones
(``fcir.mechanisms.ddgauss``): every backend clips with it, so they agree bit for bit,
and the clipped member's exact norm is at most ``clip_norm``, the sensitivity the
accountant uses.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

__all__ = ["clip_margin", "clip_member", "clip_scale", "pairwise_sum"]


def _norm_dtype(dtypes) -> np.dtype:
    """Accumulation dtype of the squared norm: at least f32 (bf16/f16 leaves would
    overflow or lose the small leaves' contribution), f64 if a leaf is f64."""
    return np.dtype(jnp.result_type(*dtypes, jnp.float32))


def clip_member(leaves, clip_norm: float) -> list:
    """One member's leaves scaled by ``min(1, c / norm)``, ``norm`` their global L2
    norm; an all-zero member stays zero (scale 1). A member whose squared norm is not
    finite (a NaN or infinite entry, or a norm that overflows) contributes zero: scaling
    would leave NaN exactly where its bad entries are, a noise-free release of them.

    ``c`` is ``clip_norm`` less the float error of computing the norm and scaling
    (:func:`clip_margin`), so that the clipped member's exact norm is at most
    ``clip_norm``: the sensitivity the accountant uses. The squared norm is summed in
    :func:`pairwise_sum`'s fixed order, whose error that margin bounds (``jnp.sum``'s
    order is XLA's choice).

    The ``where`` on the squared norm keeps the gradient finite at zero: sqrt's
    derivative at 0 is infinite, and the untaken branch must not see it.
    """
    acc = _norm_dtype([leaf.dtype for leaf in leaves])
    terms = [pairwise_sum(jnp.square(leaf.astype(acc)).reshape(-1)) for leaf in leaves]
    sq = pairwise_sum(jnp.stack(terms))
    levels = _levels(max(int(np.prod(leaf.shape)) for leaf in leaves)) + _levels(len(leaves))
    finite, scale = clip_scale(sq, clip_norm * (1 - clip_margin(levels, acc)))
    out = []
    for leaf in leaves:
        # Scale in the accumulation dtype, round once to the leaf's; for a leaf narrower
        # than it (bf16, f16) shrink a clipping scale by that rounding's unit roundoff u,
        # so that rounding to nearest cannot lift the norm above clip_norm (bf16 went up
        # to 0.34% above it: a sensitivity above the one accounted).
        u = _unit_roundoff(leaf.dtype, acc)
        s = scale if u == 0 else jnp.where(scale < 1, scale * (1 - u), scale)
        clipped = (leaf.astype(acc) * s).astype(leaf.dtype)
        out.append(jnp.where(finite, clipped, jnp.zeros_like(leaf)))
    return out


def _levels(n: int) -> int:
    """The adds on any one path of :func:`pairwise_sum` over ``n`` terms."""
    return max(int(n) - 1, 0).bit_length()


def clip_margin(levels: int, acc) -> float:
    """The relative amount :func:`clip_member` takes off ``clip_norm``: a bound on the
    float error, in ``acc``, of a squared norm summed with ``levels`` roundings on each
    path (each term's square one more), its square root, the division of the clip by
    it and the scaling of each entry. First order, in units of ``acc``'s unit roundoff:
    ``(levels + 1) / 2`` for the norm, ``1`` each for the sqrt, for rounding the reduced
    clip to ``acc``, for the division and for the product; ``1`` more covers the
    higher-order terms for any ``levels`` below ``2**20``."""
    u = float(jnp.finfo(acc).eps) / 2
    return ((levels + 1) / 2 + 5) * u


def pairwise_sum(x):
    """``sum(x)`` along the last axis in explicit halving passes (an odd last term is
    carried to the next pass): a fixed order of float adds, ``ceil(log2 n)`` on each
    path, whatever the batch or the program around it, where ``jnp.sum`` leaves the
    order to XLA (which picks it by shape and fusion: on jax 0.12 a batch of 3 rows and
    one of 8 sum differently)."""
    if x.shape[-1] == 0:
        return jnp.zeros(x.shape[:-1], x.dtype)
    while x.shape[-1] > 1:
        n = x.shape[-1]
        half = n // 2
        y = x[..., :half] + x[..., half : 2 * half]
        x = y if n % 2 == 0 else jnp.concatenate([y, x[..., 2 * half :]], axis=-1)
    return x[..., 0]


def clip_scale(sq, clip_norm: float):
    """``(finite, scale)`` for squared norms ``sq``: ``scale = min(1, clip_norm / norm)``,
    1 for a zero norm, and ``finite`` False where ``sq`` is NaN or infinite (such a
    member contributes zero). The rule of :func:`clip_member`, shared with
    ``fcir.mechanisms.ddgauss``'s clip, which sums its squares in a fixed order."""
    finite = jnp.isfinite(sq)
    positive = (sq > 0) & finite
    norm = jnp.sqrt(jnp.where(positive, sq, jnp.ones_like(sq)))
    scale = jnp.where(positive, jnp.minimum(jnp.ones_like(sq), clip_norm / norm), jnp.ones_like(sq))
    return finite, scale


def _unit_roundoff(dtype, acc) -> float:
    """Unit roundoff of rounding from ``acc`` to ``dtype``; 0 when ``dtype`` is ``acc``."""
    if np.dtype(dtype) == np.dtype(acc):
        return 0.0
    return float(jnp.finfo(dtype).eps) / 2
