"""``fed.dp_mean``: ``fed.dp_sum`` divided by the cardinality."""

from __future__ import annotations

from fcir import primitives as P

from .dp_sum import DpSum


class DpMean(DpSum):
    """``fed.dp_sum`` divided by the cardinality of the placement summed over (the noise
    too): ``({T1}@child, ..., {Tk}@child, K) -> (T1, ..., Tk)``."""

    name = "fed.dp_mean"
    primitive = P.dp_mean_p
