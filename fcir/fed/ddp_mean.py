"""``fed.ddp_mean``: ``fed.ddp_sum`` divided by the cardinality (``fcir.fed.ddp_sum``
holds the shared type rule, primitive and derivative)."""

from __future__ import annotations

from .ddp_sum import DdpSum, define_ddp

__all__ = ["DdpMean", "ddp_mean_p"]


class DdpMean(DdpSum):
    """``fed.ddp_sum`` divided by the cardinality of the placement summed over (noise
    included): ``({T1}@child, ..., {Tk}@child, {K}@child) -> (T1, ..., Tk)``."""

    name = "fed.ddp_mean"


ddp_mean_p = define_ddp(DdpMean, mean=True)
