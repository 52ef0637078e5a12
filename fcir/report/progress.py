"""Training progress: what one round communicates, and a per-round progress line.

``communication_bytes(module)`` (from ``fcir.report.traffic``, re-exported here) reads the
bytes a round moves from the IR alone.

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

import os
import sys
import time
from collections.abc import Iterator
from typing import IO, Self

import numpy as np

from fcir.ir import Module
from fcir.report.traffic import (
    REDUCTIONS,
    Transfer,
    communication_bytes,
    format_bytes,
    total_bytes,
    transfers,
)

__all__ = [
    "REDUCTIONS",
    "RoundProgress",
    "Transfer",
    "communication_bytes",
    "format_bytes",
    "total_bytes",
    "transfers",
]

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
