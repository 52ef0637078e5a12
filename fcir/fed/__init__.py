"""The federated ops, one module each, and the registry every list of them comes from.

Importing this package defines every fed op (``fcir.fed.base.FedOp`` subclasses
register themselves). ``ops()`` is name -> class; ``of_kind("reduction", "dp")`` the
names of the ops of some kinds; ``by_primitive()`` JAX primitive name -> class.
docs/adding_an_op.md says what a new op's module holds and which backend tables take
an entry for it.
"""

from __future__ import annotations

from .base import (
    KINDS,
    Context,
    FedOp,
    Reduction,
    Unsupported,
    Violation,
    by_primitive,
    of_kind,
    ops,
)
from .broadcast import Broadcast
from .ddp_mean import DdpMean
from .ddp_sum import DdpSum
from .dp_mean import DpMean
from .dp_sum import DpSum
from .map import Map
from .max import Max
from .mean import Mean
from .median import Median, reduce_median
from .min import Min
from .secure_sum import SecureSum
from .sum import Sum
from .trimmed_mean import TrimmedMean, reduce_trimmed_mean
from .weighted_mean import WeightedMean

__all__ = [
    "KINDS",
    "Broadcast",
    "Context",
    "DdpMean",
    "DdpSum",
    "DpMean",
    "DpSum",
    "FedOp",
    "Map",
    "Max",
    "Mean",
    "Median",
    "Min",
    "Reduction",
    "SecureSum",
    "Sum",
    "TrimmedMean",
    "Unsupported",
    "Violation",
    "WeightedMean",
    "by_primitive",
    "of_kind",
    "ops",
    "reduce_median",
    "reduce_trimmed_mean",
]
