"""``fed.dp_sum``: the Gaussian mechanism over the members' clipped pytrees."""

from __future__ import annotations

import numpy as np

from fcir import primitives as P
from fcir.types import TensorType

from .base import FedOp


class DpSum(FedOp):
    """Differentially private sum of a pytree: each member's leaves are clipped to global
    L2 norm ``clip_norm``, summed, and Gaussian noise of std ``noise_multiplier *
    clip_norm`` is added where the result lives:
    ``({T1}@child, ..., {Tk}@child, K) -> (T1, ..., Tk)``, ``K`` a PRNG key local to
    the current placement. Leaf ``i``'s noise is drawn with ``fold_in(key, i)``."""

    name = "fed.dp_sum"
    primitive = P.dp_sum_p
    kind = "dp"
    multiple_results = True
    attributes = {"clip_norm": float, "noise_multiplier": float}
    constraints = {
        "C1": "takes k >= 1 value operands followed by one key operand, and gives k results",
        "C2": "value operands must be placed at the placement directly below the current one",
        "C3": "the last operand must be a PRNG key (key<...>[] or u32[2]) local to the "
        "current placement",
        "C4": "value operands must be floating-point tensors",
        "C5": "attribute 'clip_norm' must be a finite float > 0 and 'noise_multiplier' a "
        "finite float >= 0",
        "C6": "result i must be operand i's member type, local to the current placement",
    }
    placement_constraints = frozenset({"C2", "C3"})

    @staticmethod
    def is_key(dtype: str, shape) -> bool:
        return (dtype.startswith("key<") and tuple(shape) == ()) or (
            dtype == "u32" and tuple(shape) == (2,)
        )

    @staticmethod
    def is_float(dtype: str) -> bool:
        return dtype.startswith("f") or dtype == "bf16"

    @classmethod
    def verify(cls, op, ctx):
        k = len(op.operands) - 1
        if k < 1 or len(op.results) != k or op.regions:
            cls.fail(
                "C1",
                f"has {len(op.operands)} operands, {len(op.results)} results, "
                f"{len(op.regions)} regions",
            )
        key = op.operands[-1].type
        member = ctx.member_of_local(key) if ctx.is_local(key) else None
        if not isinstance(member, TensorType) or not cls.is_key(member.dtype, member.shape):
            cls.fail("C3", f"key operand has type {key}")
        for name in ("clip_norm", "noise_multiplier"):
            a = op.attrs.get(name)
            low_ok = (a > 0) if name == "clip_norm" else (a >= 0)
            if not isinstance(a, float) or not np.isfinite(a) or not low_ok:
                cls.fail("C5", f"{name}={a!r}")
        for i, (v, r) in enumerate(zip(op.operands[:-1], op.results)):
            t = cls.placed_operand(ctx, v, "C2")
            if not isinstance(t.member, TensorType) or not cls.is_float(t.member.dtype):
                cls.fail("C4", f"operand {i} has member type {t.member}")
            if r.type != ctx.local(t.member):
                cls.fail("C6", f"result {i} is {r.type}, expected {ctx.local(t.member)}")
