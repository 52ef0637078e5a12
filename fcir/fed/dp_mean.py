"""``fed.dp_mean``: ``fed.dp_sum`` divided by the cardinality."""

from __future__ import annotations

from .base import public
from .dp_sum import DpSum, define_dp_op, dp_release

__all__ = ["DpMean", "dp_mean", "dp_mean_p"]


class DpMean(DpSum):
    """``fed.dp_sum`` divided by the cardinality of the placement summed over (the noise
    too): ``({T1}@child, ..., {Tk}@child, K) -> (T1, ..., Tk)``."""

    name = "fed.dp_mean"


dp_mean_p = define_dp_op(DpMean, mean=True)


@public
def dp_mean(x, clip_norm, noise_multiplier, key):
    """``fcir.dp_sum`` divided by the cardinality of the placement (noise included)."""
    return dp_release(dp_mean_p, "fcir.dp_mean", x, clip_norm, noise_multiplier, key)
