"""``fed.sum``: the sum over the members.

Derivative: linear. JVP: the sum of the tangents. Transpose: ``fed.broadcast``.
"""

from __future__ import annotations

import jax.numpy as jnp

from fcir.ir.types import TensorType, dtype_from_name, dtype_name
from fcir.opkit import autodiff as AD
from fcir.opkit import placement as api
from fcir.opkit import primitives as P

from .base import Reduction, public
from .broadcast import broadcast_like, broadcast_p

__all__ = ["Sum", "reduce_sum", "sum_p"]


def _transpose(ct, x, *, placement, n):
    assert AD.is_undefined_primal(x)
    if AD.is_symbolic_zero(ct):
        return [AD.zero_cotangent(x)]
    return [broadcast_like(ct, x.aval.to_ct_aval(), placement, n)]


def _impl(x, *, n):
    # Accumulate f16/bf16 in f32 as jnp.sum does (an explicit dtype would stop that).
    dt = P.sum_result_dtype(x.dtype)
    return jnp.sum(x, axis=0, dtype=P.accumulation_dtype(dt)).astype(dt)


sum_p = P.define_reduction(
    "fed_sum",
    _impl,
    result_dtype=P.sum_result_dtype,
    weak_type=True,
)
AD.def_jvp(sum_p, AD.linear_jvp(sum_p))
AD.def_transpose(sum_p, _transpose)


class Sum(Reduction):
    """Sum over members: ``{T}@child -> T``; bool members are counted in i32."""

    name = "fed.sum"
    primitive = sum_p
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


def _broadcast_transpose(ct, x, *, placement, n):
    """``fed.broadcast``'s transpose (``fcir.fed.broadcast``): the sum of the members'
    cotangents, registered here, where both primitives are defined."""
    assert AD.is_undefined_primal(x)
    if AD.is_symbolic_zero(ct):
        return [AD.zero_cotangent(x)]
    return [sum_p.bind(ct, placement=placement, n=n)]


AD.def_transpose(broadcast_p, _broadcast_transpose)
@public
def reduce_sum(x):
    """Sums a placed pytree to the enclosing placement: ``{T}@child -> T@p``."""
    return api._reduce(sum_p, "fcir.reduce_sum", x)
