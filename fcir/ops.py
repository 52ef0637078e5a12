"""The federated ops (defined one module each in ``fcir.fed``) and names read from them.

``FED_OPS`` (name -> class) and ``DP_OPS`` are derived from the registry; importing
this module keeps ``from fcir import ops`` / ``from fcir.ops import FedOp`` working.
"""

from __future__ import annotations

import numpy as np

from fcir.fed import *  # noqa: F403  (the op classes, FedOp, Context, Violation, Unsupported)
from fcir.fed import FedOp, of_kind
from fcir.ir.types import dtype_from_name

FED_OPS: dict[str, type[FedOp]] = dict(FedOp.registry)

# The ops that release client data to the placement above only through the Gaussian
# mechanism: the privacy check lets their results through, the accountant counts them.
DP_OPS = of_kind("dp", "ddp")

# Collectives over a named axis: inside a fed.map over a placement they would be
# client-to-client communication.
COLLECTIVES = frozenset(
    "psum pmax pmin pmean ppermute pbroadcast all_gather all_to_all axis_index psum_scatter "
    "reduce_scatter psum_invariant pvary".split()
)


def dtype_bits(dtype: str) -> int:

    return np.dtype(dtype_from_name(dtype)).itemsize * 8
