"""Training progress: what one round communicates, and a per-round progress line.

``communication_bytes(module)`` reads the bytes a round moves from the IR alone: each
``fed.broadcast`` sends its result's member type to every member of its target
placement, and each reduction receives its operands' member types from every member
of the placement it reduces over. Members are counted in all, so a broadcast to the
clients of each of 4 silos counts ``4 x clients`` receivers. A federated op inside a
``jax.scan`` counts ``length`` times; inside a ``while`` loop once (its trip count is
not static) and inside a ``cond`` once per branch, the same rules as the XLA cost
report (``fcir compile --emit cost``).

``RoundProgress`` drives a training loop::

    progress = RoundProgress(rounds, module=module)
    for r in progress:
        state, loss = step(state)
        progress.log(loss=loss)

On a terminal it redraws one line in place (round, metrics, seconds, bytes); when
output goes to a file or a pipe it prints one plain line per round instead, never a
carriage return. Either way a summary line closes the loop.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import time
from collections.abc import Iterator
from typing import IO, Self

import numpy as np

from fcir.ir import Module, Op, Region
from fcir.types import PlacedType, Type, runtime_type

__all__ = [
    "REDUCTIONS",
    "RoundProgress",
    "Transfer",
    "communication_bytes",
    "format_bytes",
    "total_bytes",
    "transfers",
]

REDUCTIONS = frozenset(
    ["fed.sum", "fed.mean", "fed.min", "fed.max", "fed.weighted_mean", "fed.secure_sum"]
)


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
    yield from _transfers(module, module.main.body, 1, 1)


def _transfers(module: Module, region: Region, members: int, repeats: int):
    """``members``: how many members run ``region``; ``repeats``: how often each does."""
    for op in region.ops:
        if op.name == "fed.broadcast":
            to = op.attrs["to"]
            size = nbytes(module, _member(op.results[0].type))
            yield Transfer(op, "broadcast", to, (size,), members * module.cardinality(to), repeats)
        elif op.name in REDUCTIONS:
            p = op.operands[0].type.placement
            sizes = tuple(nbytes(module, _member(o.type)) for o in op.operands)
            yield Transfer(op, "aggregate", p, sizes, members * module.cardinality(p), repeats)
        elif op.name == "fed.map":
            n = module.cardinality(op.operands[0].type.placement)
            yield from _transfers(module, op.regions[0], members * n, repeats)
        elif op.regions:
            inner = repeats * int(op.attrs.get("length", 1)) if op.name == "jax.scan" else repeats
            for sub in op.regions:
                yield from _transfers(module, sub, members, inner)


def communication_bytes(module: Module) -> dict[str, dict[str, int]]:
    """Bytes per round, per placement: ``{"clients": {"broadcast": b, "aggregate": a}}``.

    ``broadcast``: bytes the members of the placement receive, all members together;
    ``aggregate``: bytes they send into reductions. Every declared placement has an
    entry, outermost first.
    """
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


# --- the progress line -------------------------------------------------------------------


class RoundProgress:
    """Iterates over round numbers ``0..rounds-1`` and reports each finished round.

    ``module`` (or ``bytes_per_round``) gives the traffic column; ``log(**metrics)``
    records numbers for the current round (``loss=...``; arrays are converted with
    ``float``, which waits for the device). ``live`` defaults to whether ``stream``
    is a terminal. ``history`` holds one dict per finished round.
    """

    def __init__(
        self,
        rounds: int,
        *,
        module: Module | None = None,
        bytes_per_round: int | None = None,
        stream: IO[str] | None = None,
        live: bool | None = None,
        name: str = "round",
    ):
        self.rounds = int(rounds)
        if bytes_per_round is None and module is not None:
            traffic = communication_bytes(module)
            self.down = sum(v["broadcast"] for v in traffic.values())
            self.up = sum(v["aggregate"] for v in traffic.values())
        else:
            self.down, self.up = None, None
        self.bytes_per_round = (
            bytes_per_round
            if bytes_per_round is not None
            else (self.down + self.up if self.down is not None else None)
        )
        self.stream = stream if stream is not None else sys.stdout
        self.live = _is_terminal(self.stream) if live is None else live
        self.name = name
        self.history: list[dict] = []
        self._metrics: dict[str, float] = {}
        self._start: float | None = None
        self._t0: float | None = None
        self._closed = False

    def __iter__(self) -> Iterator[int]:
        self._t0 = time.perf_counter()
        try:
            for r in range(self.rounds):
                self._metrics = {}
                self._start = time.perf_counter()
                yield r
                self._finish(r)
        finally:
            self.close()

    def log(self, **metrics) -> None:
        """Records metrics of the current round (printed when the round ends)."""
        for k, v in metrics.items():
            self._metrics[k] = float(np.asarray(v))

    def _finish(self, r: int) -> None:
        seconds = time.perf_counter() - self._start
        entry = {"round": r + 1, "seconds": seconds, **self._metrics}
        if self.bytes_per_round is not None:
            entry["bytes"] = self.bytes_per_round
        self.history.append(entry)
        line = self.format_round(entry)
        if self.live:
            self.stream.write("\r" + line + "\x1b[K")
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def format_round(self, entry: dict) -> str:
        width = len(str(self.rounds))
        parts = [f"{self.name} {entry['round']:>{width}}/{self.rounds}"]
        parts += [
            f"{k} {_number(v)}" for k, v in entry.items() if k not in ("round", "seconds", "bytes")
        ]
        parts.append(f"{entry['seconds']:.2f} s")
        if self.down is not None:
            parts.append(f"sent {format_bytes(self.down)} down, {format_bytes(self.up)} up")
        elif self.bytes_per_round is not None:
            parts.append(f"sent {format_bytes(self.bytes_per_round)}")
        return " | ".join(parts)

    def summary(self) -> str:
        """One line: rounds, time, first and last value of each metric, bytes in all."""
        done = len(self.history)
        total = sum(h["seconds"] for h in self.history)
        parts = [f"{done} {self.name}{'' if done == 1 else 's'} in {total:.1f} s"]
        if done > 1:
            parts[0] += f" (first {self.history[0]['seconds']:.1f} s, with compilation)"
        if done:
            first, last = self.history[0], self.history[-1]
            for k in first:
                if k not in ("round", "seconds", "bytes") and k in last:
                    parts.append(f"{k} {_number(first[k])} -> {_number(last[k])}")
        if self.bytes_per_round is not None:
            parts.append(f"{format_bytes(self.bytes_per_round * done)} communicated")
        return " | ".join(parts)

    def close(self) -> None:
        """Ends the live line and prints the summary (once; ``for`` loops call it)."""
        if self._closed:
            return
        self._closed = True
        if self.live and self.history:
            self.stream.write("\n")
        self.stream.write(self.summary() + "\n")
        self.stream.flush()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _number(x: float) -> str:
    if float(x).is_integer() and abs(x) < 1e15:
        return str(int(x))
    return f"{x:.4f}"


def _is_terminal(stream) -> bool:
    try:
        return bool(stream.isatty()) and os.environ.get("TERM") != "dumb"
    except (AttributeError, ValueError):
        return False
