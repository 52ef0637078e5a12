"""The distributed DP fed ops ``fed.ddp_sum`` / ``fed.ddp_mean``: their numbered
constraints and type rule (the numerics are ``fcir.ddp``'s, the primitives
``fcir.primitives.ddp_sum_p`` / ``ddp_mean_p``).

``({T1}@child, ..., {Tk}@child, {K}@child) -> (T1, ..., Tk)``: the placed leaves of one
pytree, then one PRNG key per member (``K`` is ``key<...>[]`` or ``u32[2]``), results
local to the current placement. Attributes: ``clip_norm``, ``noise_multiplier`` (as
``fed.dp_*``) and ``bits``, the width of the secure sum.
"""

from __future__ import annotations

import numpy as np

from fcir import ddp
from fcir import primitives as P
from fcir.ops import FedOp
from fcir.types import PlacedType, TensorType

__all__ = ["DDP_OPS", "DdpMean", "DdpSum"]


def _is_key_type(t) -> bool:
    return isinstance(t, TensorType) and (
        (t.dtype.startswith("key<") and tuple(t.shape) == ())
        or (t.dtype == "u32" and tuple(t.shape) == (2,))
    )


class DdpSum(FedOp):
    """Distributed discrete Gaussian sum (``fcir.ddp``): each member clips, rotates,
    quantizes and noises its pytree into integers modulo ``2**bits`` with its own key;
    the secure sum of those is decoded where the result lives."""

    name = "fed.ddp_sum"
    primitive = P.ddp_sum_p
    constraints = {
        "C1": "takes k >= 1 value operands followed by one keys operand, and gives k results",
        "C2": "value operands must be placed at the placement directly below the current one",
        "C3": "the last operand must hold one PRNG key (key<...>[] or u32[2]) per member, "
        "placed like the values and not all-equal (every member needs its own key)",
        "C4": "value operands must be floating-point tensors",
        "C5": "attribute 'clip_norm' must be a finite float > 0 and 'noise_multiplier' a "
        "finite float >= 0",
        "C6": "result i must be operand i's member type, local to the current placement",
        "C7": f"attribute 'bits' must be an int in [{ddp.MIN_BITS}, {ddp.MAX_BITS}]",
    }
    placement_constraints = frozenset({"C2", "C3"})

    @classmethod
    def verify(cls, op, ctx):
        k = len(op.operands) - 1
        if k < 1 or len(op.results) != k or op.regions:
            cls.fail(
                "C1",
                f"has {len(op.operands)} operands, {len(op.results)} results, "
                f"{len(op.regions)} regions",
            )
        keys = op.operands[-1].type
        if not isinstance(keys, PlacedType) or not _is_key_type(keys.member):
            cls.fail("C3", f"keys operand has type {keys}")
        if keys.all_equal:
            cls.fail(
                "C3",
                f"keys operand has all-equal type {keys}: one key broadcast to "
                "every member; pass per-member keys (jax.random.split) as client data",
            )
        cls.placed_operand(ctx, op.operands[-1], "C3")
        for name in ("clip_norm", "noise_multiplier"):
            a = op.attrs.get(name)
            low_ok = isinstance(a, float) and ((a > 0) if name == "clip_norm" else (a >= 0))
            if not low_ok or not np.isfinite(a):
                cls.fail("C5", f"{name}={a!r}")
        bits = op.attrs.get("bits")
        if (
            isinstance(bits, bool)
            or not isinstance(bits, int)
            or not (ddp.MIN_BITS <= bits <= ddp.MAX_BITS)
        ):
            cls.fail("C7", f"bits={bits!r}")
        for i, (v, r) in enumerate(zip(op.operands[:-1], op.results)):
            t = cls.placed_operand(ctx, v, "C2")
            if not isinstance(t.member, TensorType) or not (
                t.member.dtype.startswith("f") or t.member.dtype == "bf16"
            ):
                cls.fail("C4", f"operand {i} has member type {t.member}")
            if r.type != ctx.local(t.member):
                cls.fail("C6", f"result {i} is {r.type}, expected {ctx.local(t.member)}")


class DdpMean(DdpSum):
    """``fed.ddp_sum`` divided by the cardinality of the placement summed over."""

    name = "fed.ddp_mean"
    primitive = P.ddp_mean_p


DDP_OPS = frozenset({"fed.ddp_sum", "fed.ddp_mean"})
