"""A byte-count progress bar for long saves and restores, drawn only on a terminal."""

from __future__ import annotations

import sys
import threading
import time
from typing import TextIO

#: Nothing is drawn for operations that finish sooner than this.
DELAY_S = 1.0
_REDRAW_S = 0.1
_WIDTH = 30


class Progress:
    """Counts bytes done out of `total` and draws `label [####....] 42% 420/1000 MiB`.

    `enabled=None` draws only when `stream` is a terminal, so logs and pipes stay clean.
    Thread-safe: I/O threads call `advance` concurrently.
    """

    def __init__(
        self,
        label: str,
        total: int,
        enabled: bool | None = None,
        stream: TextIO | None = None,
    ) -> None:
        self.stream = stream if stream is not None else sys.stderr
        if enabled is None:
            enabled = bool(getattr(self.stream, "isatty", lambda: False)())
        self.enabled = enabled
        self.label = label
        self.total = total
        self.done = 0
        self._lock = threading.Lock()
        self._start = time.monotonic()
        self._last_draw = 0.0
        self._drawn = False

    def advance(self, nbytes: int) -> None:
        if not self.enabled:
            return
        with self._lock:
            self.done += nbytes
            now = time.monotonic()
            if now - self._start >= DELAY_S and now - self._last_draw >= _REDRAW_S:
                self._draw(now)

    def close(self) -> None:
        """Draws the final state (if anything was drawn) and ends the line."""
        if not self.enabled:
            return
        with self._lock:
            if self._drawn:
                self._draw(time.monotonic())
                self.stream.write("\n")
                self.stream.flush()

    def _draw(self, now: float) -> None:
        frac = min(1.0, self.done / max(self.total, 1))
        filled = int(frac * _WIDTH)
        rate = self.done / max(now - self._start, 1e-9) / 2**20
        self.stream.write(
            f"\r{self.label} [{'#' * filled}{'.' * (_WIDTH - filled)}] {frac:4.0%} "
            f"{self.done / 2**20:.0f}/{self.total / 2**20:.0f} MiB {rate:.0f} MiB/s"
        )
        self.stream.flush()
        self._last_draw = now
        self._drawn = True
