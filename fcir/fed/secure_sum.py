"""``fed.secure_sum``: the sum modulo ``2**bitwidth`` by secure aggregation.

Derivative: integer-only (modular arithmetic): the tangent is always a symbolic zero
(``float0``); it is never linear, so it has no transpose.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from fcir.errors import PlacementError
from fcir.ir.types import TensorType, dtype_name
from fcir.opkit import autodiff as AD
from fcir.opkit import placement as api
from fcir.opkit import primitives as P

from .base import Reduction, public

__all__ = ["SecureSum", "secure_sum", "secure_sum_p"]


def _impl(x, *, n, bitwidth):
    total = jnp.sum(x, axis=0, dtype=x.dtype)
    if bitwidth < np.dtype(x.dtype).itemsize * 8:
        total = jnp.bitwise_and(total, jnp.asarray((1 << bitwidth) - 1, x.dtype))
    return total


def _check(member, *, n, bitwidth):
    found = SecureSum.problem(dtype_name(member.dtype), n, {"bitwidth": bitwidth})
    if found is not None:
        raise SecureSum.error(*found)


secure_sum_p = P.define_reduction("fed_secure_sum", _impl, _check, weak_type=True)
AD.def_jvp_zero(secure_sum_p)


class SecureSum(Reduction):
    """Sum modulo ``2**bitwidth`` by secure aggregation: ``{iN[...]}@child -> iN[...]``."""

    name = "fed.secure_sum"
    primitive = secure_sum_p
    attributes = {"bitwidth": int}
    constraints = {
        **Reduction.constraints,
        "C4": "operand must be an integer tensor",
        "C5": "attribute 'bitwidth' must be an int in [1, bits of the operand dtype]",
    }

    @classmethod
    def problem(cls, dtype: str, n: int | None, attrs: dict) -> tuple[str, str] | None:
        if dtype[0] not in "iu":
            return "C4", f"operand member dtype {dtype}"
        bits = int(dtype[1:]) if dtype[1:].isdigit() else 0
        bw = attrs.get("bitwidth")
        if isinstance(bw, bool) or not isinstance(bw, int) or not 1 <= bw <= bits:
            return "C5", f"bitwidth={bw!r} for {dtype}"
        return None

    @classmethod
    def extra(cls, op, t, ctx):
        member = t.member
        if not isinstance(member, TensorType):
            cls.fail("C4", f"operand member type {member}")
        found = cls.problem(member.dtype, None, op.attrs)
        if found is not None:
            cls.fail(*found)


@public
def secure_sum(x, *, bitwidth: int):
    """Sum of placed integers modulo ``2**bitwidth``: ``{iN[...]}@child -> iN[...]@p``."""
    if isinstance(bitwidth, bool) or not isinstance(bitwidth, (int, np.integer)):
        raise PlacementError(f"fcir.secure_sum: bitwidth must be an int, got {bitwidth!r}")
    return api._reduce(secure_sum_p, "fcir.secure_sum", x, bitwidth=int(bitwidth))
