"""A save overlaps its fsyncs with writing, and still commits only durable bytes.

os.fsync, os.pwrite, os.open and os.rename are wrapped to log, in order, when each
starts and returns (fsyncs made slow, so that overlap is visible); the commit is the
rename of the temporary directory to the checkpoint's name. Where the overlap is between
files written by one thread, a sleep cannot show it on a loaded machine (the writer may
finish every file before a fsync thread is scheduled), so there the wrappers hand off:
the first write to a second file waits until a fsync has started, and the first fsync
waits until another file is written; a save that does not overlap makes each wait time
out (HANDOFF_SECONDS) and fails the test.
"""

from __future__ import annotations

import os
import threading
import time

import jax
import numpy as np
import pytest
from fcir.checkpoint import layout, parallel
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from fcir import checkpoint

pytestmark = pytest.mark.slow  # docs/contributing.md: left out of the fast tier


#: How long a hand-off waits for the other side before the save goes on without it.
HANDOFF_SECONDS = 10.0


class Log:
    def __init__(self, monkeypatch, fsync_seconds: float, handoff: bool = False) -> None:
        self.events: list[tuple[str, str]] = []
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._handoff = {"first write waits": handoff, "first fsync waits": handoff}
        real_fsync, real_pwrite, real_open, real_rename = os.fsync, os.pwrite, os.open, os.rename

        def name(fd: int) -> str:
            try:
                return os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))
            except OSError:
                return "?"

        def fsync(fd):
            who = name(fd)
            start = self.add("fsync-start", who)
            if os.path.isfile(f"/proc/self/fd/{fd}"):
                if self._take("first fsync waits"):
                    self._wait(lambda: any(k == "pwrite" and w != who for k, w in self.events[start:]))
                time.sleep(fsync_seconds)
            real_fsync(fd)
            self.add("fsync-end", who)

        def pwrite(fd, data, offset):
            who = name(fd)
            written = self.files("pwrite")
            if written and who not in written and self._take("first write waits"):
                self._wait(lambda: any(k == "fsync-start" for k, _ in self.events))
            self.add("pwrite", who)
            return real_pwrite(fd, data, offset)

        def open_(path, flags, *args, **kwargs):
            if flags & os.O_CREAT:
                self.add("create", os.path.basename(os.fsdecode(path)))
            return real_open(path, flags, *args, **kwargs)

        def rename(a, b, *args, **kwargs):
            self.add("rename", os.path.basename(os.fsdecode(b)))
            return real_rename(a, b, *args, **kwargs)

        monkeypatch.setattr(os, "fsync", fsync)
        monkeypatch.setattr(os, "pwrite", pwrite)
        monkeypatch.setattr(os, "open", open_)
        monkeypatch.setattr(os, "rename", rename)

    def add(self, kind: str, who: str) -> int:
        """Logs an event; returns its index."""
        with self._changed:
            self.events.append((kind, who))
            self._changed.notify_all()
            return len(self.events) - 1

    def _take(self, handoff: str) -> bool:
        """True the first time a hand-off is asked for (when hand-offs are on)."""
        with self._lock:
            on, self._handoff[handoff] = self._handoff[handoff], False
            return on

    def _wait(self, done) -> None:
        with self._changed:
            self._changed.wait_for(done, timeout=HANDOFF_SECONDS)

    def index(self, kind: str, who: str) -> int:
        return self.events.index((kind, who))

    def files(self, kind: str) -> set[str]:
        with self._lock:
            return {w for k, w in self.events if k == kind}


def _tree(devices):
    mesh = jax.make_mesh((8,), ("x",), devices=devices)
    w = np.arange(64 * 8192, dtype=np.float32).reshape(64, 8192)
    return {"p": {"w": jax.device_put(w, NamedSharding(mesh, P("x"))), "b": np.ones(8)}}


@pytest.mark.parametrize("blocking", [True, False])
def test_the_layout_is_written_while_the_data_file_is_fsynced_and_the_rename_comes_last(
    tmp_path, monkeypatch, devices, blocking
):
    tree = _tree(devices)
    log = Log(monkeypatch, fsync_seconds=0.5)
    checkpoint.save(tmp_path / "c", tree, blocking=blocking).wait()
    monkeypatch.undo()
    data = layout.data_file_name(0)
    # Overlap: layout.pb is created before the data file's fsync has returned ...
    assert log.index("create", layout.LAYOUT_FILE) < log.index("fsync-end", data)
    # ... but the commit (the rename into place) waits for every fsync.
    commit = log.index("rename", "c")
    assert log.index("fsync-end", data) < commit
    assert log.index("fsync-end", layout.LAYOUT_FILE) < commit
    # After the rename only the parent directory is fsynced (making the rename durable).
    assert {w for k, w in log.events[commit:] if k == "fsync-start"} == {tmp_path.name}
    back = checkpoint.restore(tmp_path / "c", {"p": {"w": tree["p"]["w"].sharding}})
    assert np.array_equal(back["p"]["w"], tree["p"]["w"])


def test_orbax_chunk_files_are_fsynced_while_later_ones_are_written(tmp_path, monkeypatch, devices):
    tree = _tree(devices)
    monkeypatch.setattr(parallel, "THREADS", 1)  # one writer: overlap needs the fsync workers
    log = Log(monkeypatch, fsync_seconds=0.05, handoff=True)
    checkpoint.save(tmp_path / "c", tree, format="orbax")
    monkeypatch.undo()
    events = log.events
    chunks = {w for k, w in events if k == "pwrite"}
    assert len(chunks) >= 8
    # Some file is written while another one's fsync is in flight ...
    in_flight: set[str] = set()
    overlapped = False
    for kind, who in events:
        if kind == "fsync-start":
            in_flight.add(who)
        elif kind == "fsync-end":
            in_flight.discard(who)
        elif kind == "pwrite" and in_flight - {who}:
            overlapped = True
    assert overlapped
    # ... and every chunk file's fsync has returned before the rename commits.
    commit = log.index("rename", "c")
    for who in chunks:
        assert log.index("fsync-end", who) < commit
    back = checkpoint.restore(tmp_path / "c")
    assert np.array_equal(back["p"]["w"], tree["p"]["w"])
