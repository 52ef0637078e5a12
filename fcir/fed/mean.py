"""``fed.mean``: the mean over the members."""

from __future__ import annotations

from fcir import primitives as P
from fcir.types import TensorType

from .base import Reduction, mean_dtype


class Mean(Reduction):
    """Mean over members: ``{T}@child -> T``; integer and bool members give f32."""

    name = "fed.mean"
    primitive = P.mean_p
    constraints = {
        **Reduction.constraints,
        "C3": "result must be the operand's member type (f32 for integer and bool members), "
        "local to the current placement",
    }

    @classmethod
    def result_member(cls, member):
        return TensorType(mean_dtype(member.dtype), member.shape)
