"""``fed.broadcast``: a value sent to every member of the placement below."""

from __future__ import annotations

from fcir import primitives as P
from fcir.types import PlacedType

from .base import FedOp, arity


class Broadcast(FedOp):
    """Sends a value to every member of the placement below: ``T@p -> T@child!``."""

    name = "fed.broadcast"
    primitive = P.broadcast_p
    kind = "broadcast"
    attributes = {"to": str}
    constraints = {
        "C1": "takes one operand and gives one result",
        "C2": "operand must be placed at the parent of the target placement",
        "C3": "attribute 'to' must name the placement directly below the current one",
        "C4": "result type must be T@to! where T is the operand's member type",
    }
    placement_constraints = frozenset({"C2", "C3"})

    @classmethod
    def verify(cls, op, ctx):
        arity(cls, op, 1, 1)
        to = op.attrs.get("to")
        if not isinstance(to, str) or to != ctx.child:
            cls.fail("C3", f"to={to!r}, placement below '{ctx.here}' is {ctx.child!r}")
        x = op.operands[0].type
        if not ctx.is_local(x):
            cls.fail("C2", f"operand type {x} is not local to '{ctx.here}'")
        expected = PlacedType(ctx.member_of_local(x), to, True)
        if op.results[0].type != expected:
            cls.fail("C4", f"result {op.results[0].type}, expected {expected}")

    @classmethod
    def bind(cls, op, args, cardinality):
        to = op.attrs["to"]
        return cls.primitive.bind(*args, placement=to, n=cardinality(to))
