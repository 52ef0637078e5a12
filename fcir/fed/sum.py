"""``fed.sum``: the sum over the members."""

from __future__ import annotations

from fcir import primitives as P
from fcir.types import TensorType, dtype_from_name, dtype_name

from .base import Reduction


class Sum(Reduction):
    """Sum over members: ``{T}@child -> T``; bool members are counted in i32."""

    name = "fed.sum"
    primitive = P.sum_p
    constraints = {
        **Reduction.constraints,
        "C3": "result must be the operand's member type (i32 for bool members), local to the "
        "current placement",
    }

    @classmethod
    def result_member(cls, member):
        return TensorType(
            dtype_name(P.sum_result_dtype(dtype_from_name(member.dtype))), member.shape
        )
