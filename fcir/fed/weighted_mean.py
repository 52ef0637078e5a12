"""``fed.weighted_mean``: ``sum(w*x)/sum(w)`` over the members."""

from __future__ import annotations

from fcir import primitives as P
from fcir.types import TensorType

from .base import FedOp, arity, mean_dtype


class WeightedMean(FedOp):
    """``sum(w*x)/sum(w)`` over members: ``({T}@child, {W}@child) -> T``."""

    name = "fed.weighted_mean"
    primitive = P.weighted_mean_p
    kind = "reduction"
    constraints = {
        "C1": "takes two operands (values, weights) and gives one result",
        "C2": "values and weights must be placed at the placement directly below the current one",
        "C3": "the weight shape must be a prefix of the value shape (a scalar per member, or "
        "one weight per element)",
        "C4": "weights must be numeric",
        "C5": "result must be the value member type (f32 for integer members), local to the "
        "current placement",
    }
    placement_constraints = frozenset({"C2"})

    @classmethod
    def problem(cls, x_shape, w_shape, w_dtype: str) -> tuple[str, str] | None:
        """The violated constraint for member shapes and the weight dtype (by name), as
        (code, detail), else None; asked while tracing and by the checker."""
        if tuple(x_shape[: len(w_shape)]) != tuple(w_shape):
            return "C3", f"weight shape {tuple(w_shape)}, value shape {tuple(x_shape)}"
        if w_dtype == "bool" or w_dtype.startswith("key<"):
            return "C4", f"weight dtype {w_dtype}"
        return None

    @classmethod
    def verify(cls, op, ctx):
        arity(cls, op, 2, 1)
        x = cls.placed_operand(ctx, op.operands[0], "C2")
        w = cls.placed_operand(ctx, op.operands[1], "C2")
        if not isinstance(x.member, TensorType) or not isinstance(w.member, TensorType):
            cls.fail("C3", "nested placed members are not supported")
        found = cls.problem(x.member.shape, w.member.shape, w.member.dtype)
        if found is not None:
            cls.fail(*found)
        expected = ctx.local(TensorType(mean_dtype(x.member.dtype), x.member.shape))
        if op.results[0].type != expected:
            cls.fail("C5", f"result {op.results[0].type}, expected {expected}")
