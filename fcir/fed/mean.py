"""``fed.mean``: the mean over the members.

Derivative: linear for inexact dtypes. Transpose: ``broadcast(ct / n)`` (the division
is done once, on the server value, exactly what ``jnp.mean``'s VJP does). ``mean`` of
ints/bools is float32 but its input has no tangent: the output tangent is a symbolic
zero and no cotangent flows back (integer inputs are not differentiable).
"""

from __future__ import annotations

import jax.numpy as jnp

from fcir.ir.types import TensorType, dtype_from_name, dtype_name
from fcir.opkit import autodiff as AD
from fcir.opkit import placement as api
from fcir.opkit import primitives as P

from .base import Reduction, public
from .broadcast import broadcast_like

__all__ = ["Mean", "mean_dtype", "mean_p", "reduce_mean"]


def mean_dtype(dtype: str) -> str:
    return dtype_name(P.mean_result_dtype(dtype_from_name(dtype)))


def _impl(x, *, n):
    dt = P.mean_result_dtype(x.dtype)
    return jnp.mean(x.astype(dt) if x.dtype != dt else x, axis=0)


def _transpose(ct, x, *, placement, n):
    assert AD.is_undefined_primal(x)
    if AD.is_symbolic_zero(ct):
        return [AD.zero_cotangent(x)]
    # Scale once on the server, then broadcast: jnp.mean's VJP computes ct / n too.
    return [broadcast_like(ct / n, x.aval.to_ct_aval(), placement, n)]


mean_p = P.define_reduction("fed_mean", _impl, result_dtype=P.mean_result_dtype, weak_type=True)
AD.def_jvp(mean_p, AD.linear_jvp(mean_p))
AD.def_transpose(mean_p, _transpose)


class Mean(Reduction):
    """Mean over members: ``{T}@child -> T``; integer and bool members give f32."""

    name = "fed.mean"
    primitive = mean_p
    constraints = {
        **Reduction.constraints,
        "C3": "result must be the operand's member type (f32 for integer and bool members), "
        "local to the current placement",
    }

    @classmethod
    def result_member(cls, member):
        return TensorType(mean_dtype(member.dtype), member.shape)


@public
def reduce_mean(x):
    """Unweighted mean: ``{T}@child -> T@p``; ints and bools give float32."""
    return api._reduce(mean_p, "fcir.reduce_mean", x)
