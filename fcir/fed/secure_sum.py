"""``fed.secure_sum``: the sum modulo ``2**bitwidth`` by secure aggregation."""

from __future__ import annotations

from fcir import primitives as P
from fcir.types import TensorType

from .base import Reduction


class SecureSum(Reduction):
    """Sum modulo ``2**bitwidth`` by secure aggregation: ``{iN[...]}@child -> iN[...]``."""

    name = "fed.secure_sum"
    primitive = P.secure_sum_p
    attributes = {"bitwidth": int}
    constraints = {
        **Reduction.constraints,
        "C4": "operand must be an integer tensor",
        "C5": "attribute 'bitwidth' must be an int in [1, bits of the operand dtype]",
    }

    @classmethod
    def problem(cls, dtype: str, bitwidth) -> tuple[str, str] | None:
        """The violated constraint for a member dtype (by name) and a bitwidth, as
        (code, detail); None when both are fine. The primitive's abstract evaluation
        and the checker both ask this."""
        if dtype[0] not in "iu":
            return "C4", f"operand member dtype {dtype}"
        bits = int(dtype[1:]) if dtype[1:].isdigit() else 0
        bw = bitwidth
        if isinstance(bw, bool) or not isinstance(bw, int) or not 1 <= bw <= bits:
            return "C5", f"bitwidth={bw!r} for {dtype}"
        return None

    @classmethod
    def extra(cls, op, t, ctx):
        member = t.member
        if not isinstance(member, TensorType):
            cls.fail("C4", f"operand member type {member}")
        found = cls.problem(member.dtype, op.attrs.get("bitwidth"))
        if found is not None:
            cls.fail(*found)
