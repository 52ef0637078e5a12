"""``fed.map``: a region run by each member of a placement."""

from __future__ import annotations

from fcir import primitives as P
from fcir.types import PlacedType

from .base import FedOp


class Map(FedOp):
    """Applies its region to each member: ``({T...}@p) -> {U...}@p``."""

    name = "fed.map"
    primitive = P.map_p
    kind = "map"
    multiple_results = True
    constraints = {
        "C1": "has exactly one region, at least one operand, one region parameter per operand "
        "and one result per yielded value",
        "C2": "every operand must be placed at the placement directly below the current one",
        "C3": "region parameter i must have the member type of operand i",
        "C4": "result i must be {U}@p where U is the type of the i-th yielded value",
    }
    placement_constraints = frozenset({"C2"})

    @classmethod
    def verify(cls, op, ctx):
        if len(op.regions) != 1 or not op.operands:
            cls.fail("C1", f"{len(op.regions)} regions, {len(op.operands)} operands")
        (region,) = op.regions
        if len(region.params) != len(op.operands) or len(region.results) != len(op.results):
            cls.fail(
                "C1",
                f"{len(op.operands)} operands for {len(region.params)} parameters, "
                f"{len(op.results)} results for {len(region.results)} yielded values",
            )
        p = None
        for i, (v, param) in enumerate(zip(op.operands, region.params)):
            t = cls.placed_operand(ctx, v, "C2")
            p = t.placement
            if param.type != t.member:
                cls.fail("C3", f"parameter {i} has type {param.type}, operand member {t.member}")
        for i, (r, y) in enumerate(zip(op.results, region.results)):
            if r.type != PlacedType(y.type, p, False):
                cls.fail("C4", f"result {i} has type {r.type}, region yields {y.type}")
