"""What one round communicates, read from the IR alone.

Each ``fed.broadcast`` sends its result's member type to every member of its target
placement, and each reduction receives its operands' member types from every member
of the placement it reduces over. Members are counted in all, so a broadcast to the
clients of each of 4 silos counts ``4 x clients`` receivers. A federated op inside a
``jax.scan`` counts ``length`` times; inside a ``while`` loop once (its trip count is
not static) and inside a ``cond`` once per branch. The progress line
(``fcir.report.progress``), the pictures (``fcir.report.dot``) and the XLA cost report all count
with this module.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator

import numpy as np

from fcir import fed as F
from fcir.ir import Module, Op, Region, expect_module
from fcir.ir.control_flow import scan_length
from fcir.ir.types import PlacedType, Type, runtime_type
from fcir.mechanisms.ddgauss import op_params

__all__ = [
    "REDUCTIONS",
    "Transfer",
    "communication_bytes",
    "format_bytes",
    "nbytes",
    "total_bytes",
    "transfers",
]


@dataclasses.dataclass(frozen=True, eq=False)
class Transfer:
    """The traffic of one federated op in one round.

    ``kind`` is ``"broadcast"`` (the members of ``placement`` each receive) or
    ``"aggregate"`` (they each send). ``operand_bytes[i]`` is what one member receives
    or sends for operand ``i`` each time the op runs; ``members`` counts the members
    in all (4 silos of 3 clients: 12) and ``repeats`` how often the op runs per round
    (the lengths of enclosing scans).
    """

    op: Op
    kind: str
    placement: str
    operand_bytes: tuple[int, ...]
    members: int
    repeats: int = 1

    @property
    def bytes_per_member(self) -> int:
        return sum(self.operand_bytes)

    @property
    def bytes(self) -> int:
        """Bytes per round."""
        return self.bytes_per_member * self.members * self.repeats


def nbytes(module: Module, t: Type) -> int:
    """Bytes of a value of IR type ``t`` at run time (placed types include their axes)."""
    rt = runtime_type(t, module.cardinality)
    return math.prod(rt.shape) * np.dtype(rt.np_dtype).itemsize


def _member(t: Type) -> Type:
    return t.member if isinstance(t, PlacedType) else t


def transfers(module: Module) -> Iterator[Transfer]:
    """Every federated op that communicates, in program order, with its bytes."""
    expect_module(module, "fcir.report.traffic")
    yield from _transfers(module, module.main.body, 1, 1)


def _transfers(module: Module, region: Region, members: int, repeats: int):
    """``members``: how many members run ``region``; ``repeats``: how often each does."""
    for op in region.ops:
        rule = RULES.get(F.op_class(op))
        if rule is not None:
            yield from rule(module, op, members, repeats)
        elif op.regions:
            inner = repeats * scan_length(op) if op.name == "jax.scan" else repeats
            for sub in op.regions:
                yield from _transfers(module, sub, members, inner)


# How each fed op communicates, by what it does (tests/fed/test_op_coverage.py reads RULES):
# a rule yields the op's Transfers, given how many members run it and how often.


def _broadcast(module: Module, op: Op, members: int, repeats: int):
    """Each member of the target placement receives the result's member type."""
    to = op.attrs["to"]
    size = nbytes(module, _member(op.results[0].type))
    yield Transfer(op, "broadcast", to, (size,), members * module.cardinality(to), repeats)


def _map(module: Module, op: Op, members: int, repeats: int):
    """Each member runs the region: its fed ops communicate once per member."""
    n = module.cardinality(op.operands[0].type.placement)
    yield from _transfers(module, op.regions[0], members * n, repeats)


def _aggregate(module: Module, op: Op, members: int, repeats: int):
    """Each member sends its placed operands (a DP aggregate's last operand, the
    server's key, is not sent)."""
    p = op.operands[0].type.placement
    sizes = tuple(
        nbytes(module, _member(o.type))
        for o in op.operands
        if isinstance(o.type, PlacedType) and o.type.placement == p
    )
    yield Transfer(op, "aggregate", p, sizes, members * module.cardinality(p), repeats)


def _dp_aggregate(module: Module, op: Op, members: int, repeats: int):
    """As a reduction's; in exact mode (``gamma``, ``fcir.mechanisms.lattice``) each
    member sends its grid points as int32, 4 bytes an element whatever the leaf dtype."""
    if "gamma" not in op.attrs:
        yield from _aggregate(module, op, members, repeats)
        return
    p = op.operands[0].type.placement
    sizes = tuple(4 * int(np.prod(o.type.member.shape, dtype=np.int64)) for o in op.operands[:-1])
    yield Transfer(op, "aggregate", p, sizes, members * module.cardinality(p), repeats)


def _ddp_aggregate(module: Module, op: Op, members: int, repeats: int):
    """Each member sends one uint32 residue per rotated coordinate (``fcir.ddp``)."""

    p = op.operands[0].type.placement
    sizes = (4 * op_params(module, op).padded_dim,)
    yield Transfer(op, "aggregate", p, sizes, members * module.cardinality(p), repeats)


def _local(module: Module, op: Op, members: int, repeats: int):
    """Nothing sent: each member computes the value itself (its position)."""
    yield from ()


_BY_KIND = {
    "broadcast": _broadcast,
    "map": _map,
    "reduction": _aggregate,
    "dp": _dp_aggregate,
    "ddp": _ddp_aggregate,
    "index": _local,
}
RULES = F.resolve(_BY_KIND)
# The ops whose members send their values (the reports count them as aggregates).
REDUCTIONS = frozenset(
    cls.name for cls, rule in RULES.items() if rule in (_aggregate, _dp_aggregate, _ddp_aggregate)
)


def call_unit(module: Module) -> str:
    """What one call of ``main`` is, for reports that count per call: ``"round"`` for
    straight-line rounds, else ``"call of @name (jax.scan x5 of rounds)"`` when the
    server runs federated ops in loops (a call is then many rounds)."""
    loops = []
    for op in module.main.body.ops:
        if op.regions and op.name.startswith("jax.") and _federated(op):
            name = op.name
            if name == "jax.scan" and "length" in op.attrs:
                name += f" x{op.attrs['length']}"
            loops.append(name)
    loops = [n for n in loops if n.startswith(("jax.scan", "jax.while"))]
    if not loops:
        return "round"
    return f"call of @{module.name} ({', '.join(loops)} of rounds)"


def _federated(op: Op) -> bool:
    return any(
        o.name.startswith("fed.") or (o.regions and _federated(o))
        for r in op.regions
        for o in r.ops
    )


def communication_bytes(module: Module) -> dict[str, dict[str, int]]:
    """Bytes per round, per placement: ``{"clients": {"broadcast": b, "aggregate": a}}``.

    ``broadcast``: bytes the members of the placement receive, all members together;
    ``aggregate``: bytes they send into reductions. Every declared placement has an
    entry, outermost first.
    """
    expect_module(module, "fcir.report.traffic.communication_bytes")
    out = {p: {"broadcast": 0, "aggregate": 0} for p, _ in module.placements}
    for t in transfers(module):
        out[t.placement][t.kind] += t.bytes
    return out


def total_bytes(module: Module) -> int:
    """All bytes one round communicates, every placement and direction together."""
    return sum(t.bytes for t in transfers(module))


def format_bytes(n: float) -> str:
    """``1536`` -> ``"1.5 KiB"``."""
    if n < 1024:
        return f"{int(n)} B"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    raise AssertionError("unreachable")
