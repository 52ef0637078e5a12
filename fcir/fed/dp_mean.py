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
def dp_mean(x, clip_norm, noise_multiplier, key, *, exact=False, gamma=None):
    """``fcir.dp_sum`` divided by the cardinality of the placement (noise included);
    ``exact=True``: ``fcir.dp_sum``'s exact mode, the noised integer sum divided by the
    cardinality to the nearest integer, released as that integer times ``gamma``."""
    return dp_release(dp_mean_p, "fcir.dp_mean", x, clip_norm, noise_multiplier, key, exact, gamma)
