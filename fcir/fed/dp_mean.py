"""``fed.dp_mean``: ``fed.dp_sum`` divided by the cardinality."""

from __future__ import annotations

from .dp_sum import DpSum, define_dp_op

__all__ = ["DpMean", "dp_mean_p"]


class DpMean(DpSum):
    """``fed.dp_sum`` divided by the cardinality of the placement summed over (the noise
    too): ``({T1}@child, ..., {Tk}@child, K) -> (T1, ..., Tk)``."""

    name = "fed.dp_mean"


dp_mean_p = define_dp_op(DpMean, mean=True)
