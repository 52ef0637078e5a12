"""`save`: phase 1 copies shards to host; phase 2 writes, fsyncs and commits them.

Commit protocol (every process runs it; process 0 commits):

1. Process 0 removes leftovers of crashed saves next to the target, creates the
   temporary directory and tells the others its name.
2. Every process writes its own data file (and, if it is not process 0, a part layout
   with its shard records), fsyncs, and reports "ok" or its error.
3. Process 0 waits for all reports, merges the shard records into one layout, writes
   and fsyncs it, renames the directory into place and fsyncs the parent, then tells
   the others the outcome. Every process's handle finishes only after the commit.

Processes talk through jax's distributed key-value store (see coordination.py); with
one process nothing is exchanged.
"""

from __future__ import annotations

import atexit
import itertools
import os
import pathlib
import shutil
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax

from fcir._proto import checkpoint_pb2 as pb
from fcir.checkpoint import checksums, commit, keypaths, layout, snapshot, writer
from fcir.checkpoint.coordination import Coordinator
from fcir.checkpoint.progress import Progress
from fcir.errors import CheckpointError

_lock = threading.Lock()
_in_flight: SaveHandle | None = None
_sequence = itertools.count()


class SaveHandle:
    """A save in progress. `wait()` blocks until it is committed and re-raises its error."""

    def __init__(self, path: pathlib.Path) -> None:
        self.path = path
        #: Seconds the caller was blocked for phase 1 (the device-to-host copy).
        self.blocking_seconds = 0.0
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._observed = False

    def done(self) -> bool:
        """Whether the save has finished, committed or failed."""
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> None:
        """Blocks until the checkpoint is committed; raises CheckpointError if it failed.

        Raises TimeoutError when `timeout` seconds pass first.
        """
        if not self._done.wait(timeout):
            raise TimeoutError(f"saving {self.path} is still in progress")
        self._observed = True
        if self._error is not None:
            if isinstance(self._error, CheckpointError) or not isinstance(self._error, Exception):
                raise self._error  # KeyboardInterrupt and the like stay what they are
            raise CheckpointError(f"saving {self.path} failed: {self._error}") from self._error

    def _finish(self, error: BaseException | None) -> None:
        self._error = error
        self._done.set()

    def __repr__(self) -> str:
        state = "running" if not self.done() else ("failed" if self._error else "committed")
        return f"SaveHandle({str(self.path)!r}, {state})"


def _wait_for_previous() -> None:
    prev = _in_flight
    if prev is None:
        return
    prev._done.wait()
    if prev._error is not None and not prev._observed:
        prev._observed = True
        raise CheckpointError(
            f"the previous asynchronous save to {prev.path} failed, and nothing new was "
            f"saved: {prev._error}"
        ) from prev._error


@atexit.register
def _report_lost_error() -> None:
    # Runs after non-daemon threads (the background save) have finished.
    prev = _in_flight
    if prev is not None and prev._error is not None and not prev._observed:
        print(
            f"fcir.checkpoint: asynchronous save to {prev.path} failed: {prev._error}",
            file=sys.stderr,
        )


def save(
    path: str | os.PathLike[str],
    tree: Mapping[str, Any],
    *,
    blocking: bool = True,
    overwrite: bool = False,
    progress: bool | None = None,
    _after_commit: Callable[[], None] | None = None,
) -> SaveHandle:
    """Saves a dict of named items (pytrees of jax arrays, numpy arrays, scalars, or JSON).

    Every process of a jax.distributed job must call it with the same path and tree.
    Waits for any earlier save to finish first. With `blocking=False` it returns as soon
    as the shards are on the host; the returned handle's `wait()` blocks until the
    checkpoint is committed and raises if it failed. `progress` shows a progress bar
    (None: on a terminal, for blocking saves).
    """
    global _in_flight
    with _lock:
        started = time.perf_counter()
        _wait_for_previous()
        final = pathlib.Path(os.path.abspath(path))
        if os.path.lexists(final) and not overwrite:
            raise CheckpointError(f"{final} already exists; pass overwrite=True to replace it")
        coord = Coordinator()
        seq = next(_sequence)
        snap = snapshot.take(tree, coord.process_index, copy_host_values=not blocking)
        handle = SaveHandle(final)
        _in_flight = handle
        if progress is None and not blocking:
            progress = False  # a bar drawn from the background would garble training logs
        bar = Progress(f"saving {final.name}", snap.nbytes, progress)

        def phase2() -> None:
            try:
                _write_and_commit(final, snap, coord, seq, overwrite, bar, _after_commit)
            except BaseException as e:  # noqa: BLE001 - surfaced by handle.wait()
                handle._finish(e)
            else:
                handle._finish(None)
            finally:
                bar.close()

        if blocking:
            phase2()
            handle.blocking_seconds = time.perf_counter() - started
            handle.wait()
            return handle
        thread = threading.Thread(target=phase2, name=f"fcir-ckpt-save-{seq}", daemon=False)
        thread.start()
        handle.blocking_seconds = time.perf_counter() - started
        return handle


def _error_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}" if not isinstance(e, CheckpointError) else str(e)


def _write_and_commit(
    final: pathlib.Path,
    snap: snapshot.Snapshot,
    coord: Coordinator,
    seq: int,
    overwrite: bool,
    bar: Progress,
    after_commit: Callable[[], None] | None,
) -> None:
    me, count = coord.process_index, coord.process_count
    key = f"fcir/checkpoint/{seq}"
    if me == 0:
        try:
            final.parent.mkdir(parents=True, exist_ok=True)
            commit.remove_leftovers(final.parent)
            temp = commit.temp_dir(final)
        except BaseException as e:
            if count > 1:
                coord.publish(f"{key}/temp", "error:" + _error_text(e))
            if isinstance(e, OSError):
                raise CheckpointError(f"cannot start saving {final}: {e}") from e
            raise
        if count > 1:
            coord.publish(f"{key}/temp", temp.name)
    else:
        name = coord.fetch(f"{key}/temp")
        if name.startswith("error:"):
            raise CheckpointError(f"process 0 could not start saving {final}: {name[6:]}")
        temp = final.parent / name

    error: BaseException | None = None
    try:
        part = _write_part(temp, snap, me, count, bar)
        if me != 0:
            layout.write_file(temp / layout.part_file_name(me), layout.encode(part))
    except BaseException as e:  # noqa: BLE001 - reported to process 0, then re-raised
        error = e

    if me != 0:
        coord.publish(
            f"{key}/written/{me}", "ok" if error is None else "error:" + _error_text(error)
        )
        outcome = coord.fetch(f"{key}/commit")
        if error is not None:
            raise error
        if outcome != "ok":
            raise CheckpointError(f"saving {final} failed on process 0: {outcome[6:]}")
        return

    try:
        failures = [] if error is None else [(0, _error_text(error))]
        for q in range(1, count):
            status = coord.fetch(f"{key}/written/{q}")
            if status != "ok":
                failures.append((q, status[6:]))
        if error is not None:
            raise error
        if failures:
            raise CheckpointError(
                f"saving {final} failed: "
                + "; ".join(f"process {q}: {message}" for q, message in failures)
            )
        merged = _merge(part, [_read_part(temp, q) for q in range(1, count)])
        layout.validate(merged, str(final))
        merged.commit_time_unix = time.time()
        layout.write_file(temp / layout.LAYOUT_FILE, layout.encode(merged))
        for q in range(1, count):
            os.unlink(temp / layout.part_file_name(q))
        commit.publish(temp, final, overwrite)
        if after_commit is not None:  # before the others hear "ok", so they see its effect
            after_commit()
    except BaseException as e:
        if count > 1:
            coord.publish(f"{key}/commit", "error:" + _error_text(e))
        shutil.rmtree(temp, ignore_errors=True)
        if isinstance(e, OSError):
            raise CheckpointError(f"committing {final} failed: {e}") from e
        raise
    if count > 1:
        coord.publish(f"{key}/commit", "ok")


def _write_part(
    temp: pathlib.Path, snap: snapshot.Snapshot, me: int, count: int, bar: Progress
) -> pb.CheckpointLayout:
    """Writes this process's data file; returns a layout holding only its shards."""
    blocks = [s.data for it in snap.items for a in it.arrays for s in a.shards]
    file_name = layout.data_file_name(me)
    written, size = writer.write_data_file(temp / file_name, blocks, bar)
    part = pb.CheckpointLayout(
        layout_version=layout.LAYOUT_VERSION,
        writer=f"fcir.checkpoint (jax {jax.__version__})",
        num_processes=count,
        checksum_algorithm=pb.CHECKSUM_ALGORITHM_CRC32,
        checksum_chunk_bytes=checksums.CHUNK_BYTES,
    )
    part.files.add(name=file_name, size_bytes=size, process_index=me)
    places = iter(written)
    for item in snap.items:
        record_item = part.items.add(name=item.name)
        if item.json is not None:
            record_item.json = item.json
            continue
        record_item.arrays.SetInParent()
        for a in item.arrays:
            record = record_item.arrays.arrays.add(
                path=keypaths.to_proto(a.path),
                shape=a.shape,
                dtype=layout.dtype_name(a.dtype),
                kind=a.kind,
            )
            record.sharding.CopyFrom(a.sharding)
            for shard in a.shards:
                place = next(places)
                record.shards.add(
                    index=[pb.IndexRange(start=lo, stop=hi) for lo, hi in zip(*shard.box)],
                    file=0,
                    offset=place.offset,
                    length=place.length,
                    chunk_checksums=place.crcs,
                    process_index=me,
                )
    return part


def _read_part(temp: pathlib.Path, q: int) -> pb.CheckpointLayout:
    path = temp / layout.part_file_name(q)
    return layout.decode(path.read_bytes(), str(path))


def _merge(own: pb.CheckpointLayout, parts: list[pb.CheckpointLayout]) -> pb.CheckpointLayout:
    """Process 0's layout with every other process's data file and shard records added."""
    merged = pb.CheckpointLayout()
    merged.CopyFrom(own)
    records = {
        (item.name, keypaths.match_key(keypaths.from_proto(r.path))): r
        for item in merged.items
        for r in item.arrays.arrays
    }
    for q, part in enumerate(parts, start=1):
        file_index = len(merged.files)
        merged.files.add().CopyFrom(part.files[0])
        for item in part.items:
            for r in item.arrays.arrays:
                key = keypaths.match_key(keypaths.from_proto(r.path))
                mine = records.get((item.name, key))
                if mine is None or tuple(mine.shape) != tuple(r.shape) or mine.dtype != r.dtype:
                    raise CheckpointError(
                        f"process {q} saved array {keypaths.display(item.name, key)!r} "
                        "differently from process 0; every process must save the same tree"
                    )
                for shard in r.shards:
                    added = mine.shards.add()
                    added.CopyFrom(shard)
                    added.file = file_index
    for r in records.values():
        ordered = sorted(r.shards, key=lambda s: tuple(x.start for x in s.index))
        copies = [pb.ShardRecord() for _ in ordered]
        for c, s in zip(copies, ordered):
            c.CopyFrom(s)
        del r.shards[:]
        r.shards.extend(copies)
    return merged
