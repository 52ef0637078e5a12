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
import contextlib
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
from fcir.checkpoint import (
    checksums,
    commit,
    keypaths,
    layout,
    orbax,
    parallel,
    snapshot,
    storage,
    writer,
)
from fcir.checkpoint.coordination import Coordinator
from fcir.checkpoint.progress_bar import Progress

from fcir._proto import checkpoint_pb2 as pb
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
    format: str = "fcir",  # noqa: A002 - the public name api.md fixes
    _after_commit: Callable[[], None] | None = None,
    _item_folders: bool = False,
) -> SaveHandle:
    """Saves a dict of named items (pytrees of jax arrays, numpy arrays, scalars, or JSON).

    Every process of a jax.distributed job must call it with the same path and tree.
    Waits for any earlier save to finish first. With `blocking=False` it returns as soon
    as the shards are on the host; the returned handle's `wait()` blocks until the
    checkpoint is committed and raises if it failed. `progress` shows a progress bar
    (None: on a terminal, for blocking saves).

    `format="orbax"` writes what Orbax's StandardCheckpointer restores (each item in a
    subfolder when there are several; local paths, s3:// and gs://), with fcir's layout
    and checksums beside it, so `restore` reads and verifies it as any fcir checkpoint.
    (`CheckpointManager` puts even a single item in its subfolder, as Orbax's does.)
    """
    global _in_flight
    if format not in ("fcir", "orbax"):
        raise CheckpointError(f"format must be 'fcir' or 'orbax', got {format!r}")
    with _lock:
        # The caller waits for what is here: checks that raise at the call, and the
        # host copy (snapshot.take; an asynchronous save also waits for every copy to
        # arrive). Everything else runs in phase2 (see snapshot.py).
        started = time.perf_counter()
        _wait_for_previous()
        final = storage.locate(path)
        if _exists(final) and not overwrite:
            raise CheckpointError(f"{final} already exists; pass overwrite=True to replace it")
        coord = Coordinator()
        seq = next(_sequence)
        snap = snapshot.take(tree, coord.process_index, copy_host_values=not blocking)
        if not blocking:
            _await_host_copies(snap, final)
        empties = orbax.empty_nodes(tree) if format == "orbax" else {}
        handle = SaveHandle(final)
        _in_flight = handle
        if progress is None and not blocking:
            progress = False  # a bar drawn from the background would garble training logs

        def phase2() -> None:
            bar = None
            try:
                bar = Progress(f"saving {final.name}", snap.nbytes, progress)
                _write_and_commit(
                    final,
                    snap,
                    coord,
                    seq,
                    overwrite,
                    bar,
                    _after_commit,
                    format,
                    empties,
                    _item_folders,
                )
            except BaseException as e:  # noqa: BLE001 - surfaced by handle.wait()
                handle._finish(e)
            else:
                handle._finish(None)
            finally:
                if bar is not None:
                    bar.close()

        if blocking:
            phase2()
            handle.blocking_seconds = time.perf_counter() - started
            handle.wait()
            return handle
        _in_background(phase2, seq)
        handle.blocking_seconds = time.perf_counter() - started
        return handle


def _await_host_copies(snap: snapshot.Snapshot, final: storage.Location) -> None:
    """Phase 1 of an asynchronous save ends once every shard is on the host: the caller
    may then donate or delete its arrays. Its writes start only then (a blocking save's
    overlap the copies), so that they take no memory bandwidth from the copies while
    the caller, a training loop, waits for them."""
    try:
        snap.wait_host()
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointError(f"saving {final} failed copying to host: {e}") from e


#: Whether threading's shutdown hook waits for the asynchronous save in flight.
_exit_hook = False


def _in_background(job: Callable[[], None], seq: int) -> None:
    """Runs phase 2 on a pooled thread: handing it over costs the caller a queue put,
    where starting a thread per save made it wait until the new thread had run (up to
    the 5 ms switch interval, as the new thread then held the GIL) on cold pages."""
    global _exit_hook
    if not _exit_hook:
        register = getattr(threading, "_register_atexit", None)
        if register is None:  # a Python without the hook: a non-daemon thread per save
            threading.Thread(target=job, name=f"fcir-ckpt-save-{seq}", daemon=False).start()
            return
        # At exit, before non-daemon threads are joined (concurrent.futures does the
        # same): the interpreter waits for the save in flight as it would for a
        # non-daemon thread, and the atexit report below then sees its outcome.
        register(_finish_in_flight)
        _exit_hook = True
    if not parallel.submit(job):  # called at exit, when no thread can start
        job()


def _finish_in_flight() -> None:
    prev = _in_flight
    if prev is not None:
        prev._done.wait()


def _exists(final: storage.Location) -> bool:
    if isinstance(final, storage.ObjectStore):  # an fcir or an Orbax checkpoint
        return final.exists(layout.LAYOUT_FILE) or final.exists(orbax.COMMIT_SUCCESS)
    return os.path.lexists(final)


def _error_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}" if not isinstance(e, CheckpointError) else str(e)


class _LocalTarget:
    """A save into a local directory: a temporary sibling renamed into place."""

    def __init__(self, final: pathlib.Path, overwrite: bool) -> None:
        self.final, self.overwrite = final, overwrite
        self.temp: pathlib.Path | None = None
        #: The data file's fsync, which runs on while the part layout or the layout is
        #: written; waited for before "ok" is reported and before the rename commits.
        self.durable = writer.Durable(1)

    def wait_durable(self) -> None:
        self.durable.wait()

    def start(self) -> str:
        try:
            self.final.parent.mkdir(parents=True, exist_ok=True)
            commit.remove_leftovers(self.final.parent)
            self.temp = commit.temp_dir(self.final)
        except OSError as e:
            raise CheckpointError(f"cannot start saving {self.final}: {e}") from e
        return self.temp.name

    def attach(self, token: str) -> None:
        self.temp = self.final.parent / token

    def write_data(self, snap: snapshot.Snapshot, me: int, bar: Progress) -> tuple[list[Any], list]:
        file_name = layout.data_file_name(me)
        written, size = writer.write_data_file(
            self.temp / file_name, snap.shards(), bar, durable=self.durable
        )
        return [(file_name, size)], written

    def write_part(self, me: int, data: bytes) -> None:
        layout.write_file(self.temp / layout.part_file_name(me), data)

    def read_part(self, q: int) -> bytes:
        return (self.temp / layout.part_file_name(q)).read_bytes()

    def commit(self, data: bytes, count: int) -> None:
        self.before_layout(data)
        layout.write_file(self.temp / layout.LAYOUT_FILE, data)
        self.wait_durable()  # every data byte is on disk before the rename commits
        for q in range(1, count):
            os.unlink(self.temp / layout.part_file_name(q))
        commit.publish(self.temp, self.final, self.overwrite)
        commit.release(self.temp)

    def abort(self) -> None:
        with contextlib.suppress(CheckpointError):
            self.wait_durable()  # the fsync's error, if any, is not the one to tell
        if self.temp is not None:
            shutil.rmtree(self.temp, ignore_errors=True)
            commit.release(self.temp)

    def before_layout(self, data: bytes) -> None:
        pass


class _OrbaxTarget(_LocalTarget):
    """A local save in Orbax's format: one uncompressed zarr v2 chunk file per shard
    (which fcir's layout names as its data files), Orbax's metadata written by process
    0 before the layout; committed by the same rename."""

    def __init__(
        self,
        final: pathlib.Path,
        overwrite: bool,
        empties: Mapping[str, Any] | None,
        item_folders: bool,
    ) -> None:
        super().__init__(final, overwrite)
        self.empties = empties  # None leaves and empty subtrees, for Orbax's tree metadata
        self.item_folders = item_folders  # even a single item in its subfolder

    def write_data(self, snap: snapshot.Snapshot, me: int, bar: Progress) -> tuple[list[Any], list]:
        names, blocks = _orbax_chunks(snap, self.item_folders)
        written = writer.write_files(self.temp, names, blocks, bar)
        return [(n, b.nbytes) for n, b in zip(names, blocks)], written

    def before_layout(self, data: bytes) -> None:
        for name, content in orbax.metadata_files(
            layout.decode(data, str(self.final)), self.empties, self.item_folders
        ).items():
            path = self.temp / name
            path.parent.mkdir(parents=True, exist_ok=True)
            layout.write_file(path, content)
        dirs = {self.temp / f.name for f in layout.decode(data, str(self.final)).files}
        for d in {p.parent for p in dirs} | {p.parent.parent for p in dirs}:
            if d != self.temp and d.is_dir():
                commit.fsync_dir(d)


def _orbax_chunks(snap: snapshot.Snapshot, item_folders: bool) -> tuple[list[str], list[Any]]:
    """The zarr chunk file of each shard this process writes, and the shard's bytes."""
    several = item_folders or len(snap.items) > 1
    blocks = snap.blocks()  # made contiguous first
    names = []
    snap.describe()
    for it in snap.items:
        prefix = orbax.item_prefix(it.name, several)
        for a in it.arrays:
            for s in a.shards:
                names.append(orbax.chunk_file(prefix, a.path, s.box))
    return names, blocks


class _ObjectTarget:
    """A save into an object store, where nothing can be renamed: every object of the
    save carries its nonce, and writing `layout.pb` (one PUT) commits it. Objects no
    committed layout refers to (an old checkpoint's, a crashed save's) are deleted after
    the commit."""

    def __init__(self, final: storage.ObjectStore, overwrite: bool) -> None:
        self.final, self.overwrite = final, overwrite
        self.nonce = ""

    def start(self) -> str:
        self.nonce = commit.nonce()
        return self.nonce

    def attach(self, token: str) -> None:
        self.nonce = token

    def wait_durable(self) -> None:
        pass  # an object is durable once its PUT returns

    def write_data(self, snap: snapshot.Snapshot, me: int, bar: Progress) -> tuple[list[Any], list]:
        stem = f"data-{self.nonce}-p{me:05d}"
        return writer.write_objects(self.final, stem, snap.blocks(), bar)

    def _part(self, q: int) -> str:
        return f"layout.part-{self.nonce}-p{q:05d}.pb"

    def write_part(self, me: int, data: bytes) -> None:
        self.final.write(self._part(me), data)

    def read_part(self, q: int) -> bytes:
        data = self.final.read(self._part(q))
        if data is None:
            raise CheckpointError(f"{self.final}: process {q}'s shard records are missing")
        return data

    def commit(self, data: bytes, count: int) -> None:
        if not self.overwrite and self.final.exists(layout.LAYOUT_FILE):
            raise CheckpointError(f"{self.final} already exists; pass overwrite=True to replace it")
        self.final.write(layout.LAYOUT_FILE, data)  # the commit
        keep = {f.name for f in layout.decode(data, str(self.final)).files}
        self._delete(lambda name: name not in keep)

    def abort(self) -> None:
        if self.nonce:
            self._delete(lambda name: self.nonce in name)

    def _delete(self, unwanted: Callable[[str], bool]) -> None:
        """Deletes this checkpoint's own data and part objects that `unwanted` picks."""
        stale = [
            k
            for k in self.final.list()
            if "/" not in k
            and (k.startswith("data-") and k.endswith(".bin") or k.startswith("layout.part-"))
            and unwanted(k)
        ]
        if stale:
            self.final.delete(stale)


class _OrbaxObjectTarget(_ObjectTarget):
    """A save in Orbax's format into an object store. Zarr fixes the chunk objects'
    names (`<param>/<i.j>`), so they cannot carry a nonce as fcir's data objects do:

    1. Overwriting an fcir-written checkpoint first deletes its `layout.pb` and
       `commit_success.txt` (it is then no checkpoint), then the objects its layout
       names and its Orbax metadata. Objects a crashed save left are overwritten.
    2. Every process PUTs its own chunk objects, several at once.
    3. Process 0 PUTs `layout.pb` (fcir's commit: fcir reads the checkpoint from here
       on), then Orbax's metadata, then `commit_success.txt` (Orbax's commit marker on
       object stores, written last as Orbax writes it).
    """

    def __init__(
        self,
        final: storage.ObjectStore,
        overwrite: bool,
        empties: Mapping[str, Any] | None,
        item_folders: bool,
    ) -> None:
        super().__init__(final, overwrite)
        self.empties = empties  # None leaves and empty subtrees, for Orbax's tree metadata
        self.item_folders = item_folders  # even a single item in its subfolder

    def start(self) -> str:
        nonce = super().start()
        old = self.final.read(layout.LAYOUT_FILE)
        if old is None:
            if self.final.exists(orbax.COMMIT_SUCCESS):
                raise CheckpointError(
                    f"{self.final} holds an Orbax checkpoint that fcir did not write; "
                    "delete it first (fcir overwrites only what its own layout names)"
                )
            return nonce
        old_layout = layout.decode(old, str(self.final))
        self.final.delete([layout.LAYOUT_FILE, orbax.COMMIT_SUCCESS])  # uncommitted now
        stale = {f.name for f in old_layout.files}
        if any(item.WhichOneof("value") == "arrays" for item in old_layout.items):
            stale |= set(orbax.metadata_files(old_layout))
        self.final.delete(sorted(stale))
        return nonce

    def write_data(self, snap: snapshot.Snapshot, me: int, bar: Progress) -> tuple[list[Any], list]:
        names, blocks = _orbax_chunks(snap, self.item_folders)
        written = writer.write_chunk_objects(self.final, names, blocks, bar)
        return [(n, b.nbytes) for n, b in zip(names, blocks)], written

    def commit(self, data: bytes, count: int) -> None:
        if self.final.exists(layout.LAYOUT_FILE) or self.final.exists(orbax.COMMIT_SUCCESS):
            raise CheckpointError(f"{self.final} already exists; pass overwrite=True to replace it")
        meta = orbax.metadata_files(
            layout.decode(data, str(self.final)), self.empties, self.item_folders
        )
        self.final.write(layout.LAYOUT_FILE, data)  # fcir's commit
        self._delete(lambda name: self.nonce in name)  # the part layouts
        self.final.write_many(sorted(meta.items()))
        self.final.write(orbax.COMMIT_SUCCESS, orbax.commit_success_text(self.final.url))


def _write_and_commit(
    final: storage.Location,
    snap: snapshot.Snapshot,
    coord: Coordinator,
    seq: int,
    overwrite: bool,
    bar: Progress,
    after_commit: Callable[[], None] | None,
    fmt: str = "fcir",
    empties: Mapping[str, Any] | None = None,
    item_folders: bool = False,
) -> None:
    me, count = coord.process_index, coord.process_count
    key = f"checkpoint/{seq}"
    target: _LocalTarget | _ObjectTarget
    if isinstance(final, storage.ObjectStore):
        if fmt == "orbax":
            target = _OrbaxObjectTarget(final, overwrite, empties, item_folders)
        else:
            target = _ObjectTarget(final, overwrite)
    elif fmt == "orbax":
        target = _OrbaxTarget(final, overwrite, empties, item_folders)
    else:
        target = _LocalTarget(final, overwrite)
    if me == 0:
        try:
            token = target.start()
        except BaseException as e:
            if count > 1:
                coord.publish(f"{key}/temp", "error:" + _error_text(e))
            raise
        if count > 1:
            coord.publish(f"{key}/temp", token)
    else:
        token = coord.fetch(f"{key}/temp")
        if token.startswith("error:"):
            raise CheckpointError(f"process 0 could not start saving {final}: {token[6:]}")
        target.attach(token)

    error: BaseException | None = None
    try:
        part = _write_part(target, snap, me, count, bar)
        if me != 0:
            target.write_part(me, layout.encode(part))  # while the data file is fsynced
            target.wait_durable()
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
        parts = [
            layout.decode(target.read_part(q), f"{final} (process {q})") for q in range(1, count)
        ]
        merged = _merge(part, parts)
        layout.validate(merged, str(final))
        merged.commit_time_unix = time.time()
        target.commit(layout.encode(merged), count)
        if after_commit is not None:  # before the others hear "ok", so they see its effect
            after_commit()
    except BaseException as e:
        if count > 1:
            coord.publish(f"{key}/commit", "error:" + _error_text(e))
        target.abort()
        if isinstance(e, OSError):
            raise CheckpointError(f"committing {final} failed: {e}") from e
        raise
    if count > 1:
        coord.publish(f"{key}/commit", "ok")


def _write_part(
    target: _LocalTarget | _ObjectTarget,
    snap: snapshot.Snapshot,
    me: int,
    count: int,
    bar: Progress,
) -> pb.CheckpointLayout:
    """Writes this process's data; returns a layout holding only its files and shards.

    The shards' records are made after the data is written: the writes need only the
    bytes, so they start as soon as phase 2 does."""
    files, written = target.write_data(snap, me, bar)
    snap.describe()
    part = pb.CheckpointLayout(
        layout_version=layout.LAYOUT_VERSION,
        writer=f"fcir.checkpoint (jax {jax.__version__})",
        num_processes=count,
        checksum_algorithm=pb.CHECKSUM_ALGORITHM_CRC32,
        checksum_chunk_bytes=checksums.CHUNK_BYTES,
    )
    for name, size in files:
        part.files.add(name=name, size_bytes=size, process_index=me)
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
                prng_key_impl=a.prng_key_impl,
            )
            record.sharding.CopyFrom(a.sharding)
            for shard in a.shards:
                place = next(places)
                record.shards.add(
                    index=[pb.IndexRange(start=lo, stop=hi) for lo, hi in zip(*shard.box)],
                    file=place.file,
                    offset=place.offset,
                    length=place.length,
                    chunk_checksums=place.crcs,
                    process_index=me,
                )
    return part


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
        for f in part.files:
            merged.files.add().CopyFrom(f)
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
                    added.file = file_index + shard.file
    for r in records.values():
        ordered = sorted(r.shards, key=lambda s: tuple(x.start for x in s.index))
        copies = [pb.ShardRecord() for _ in ordered]
        for c, s in zip(copies, ordered):
            c.CopyFrom(s)
        del r.shards[:]
        r.shards.extend(copies)
    return merged
