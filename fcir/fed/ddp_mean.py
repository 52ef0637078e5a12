"""``fed.ddp_mean``: ``fed.ddp_sum`` divided by the cardinality (``fcir.fed.ddp_sum``
holds the shared type rule, primitive and derivative)."""

from __future__ import annotations

from .base import public
from .ddp_sum import DdpSum, ddp_release, define_ddp

__all__ = ["DdpMean", "ddp_mean", "ddp_mean_p"]


class DdpMean(DdpSum):
    """``fed.ddp_sum`` divided by the cardinality of the placement summed over (noise
    included): ``({T1}@child, ..., {Tk}@child, {K}@child) -> (T1, ..., Tk)``."""

    name = "fed.ddp_mean"


ddp_mean_p = define_ddp(DdpMean, mean=True)


@public
def ddp_mean(x, clip_norm, noise_multiplier, keys, bits=20, *, min_clients=None):
    """``fcir.ddp_sum`` divided by the cardinality of the placement (noise included);
    ``min_clients`` as ``fcir.ddp_sum``'s."""
    return ddp_release(
        ddp_mean_p, "fcir.ddp_mean", x, clip_norm, noise_multiplier, keys, bits, min_clients
    )
