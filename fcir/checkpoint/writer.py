"""Writes one process's shards into its data file, concurrently, and makes them durable.

One file per process: shards are packed at aligned offsets and written by a few threads
in pieces of PIECE_BYTES; each 1 MiB checksum chunk of a piece is checksummed just
before its own `pwrite` (larger calls are erratically slow: see WRITE_BYTES). As pieces
land in the page cache a flusher thread asks the kernel to start writing them back
(`sync_file_range`), so the disk works while the CPUs still copy and checksum, and the
final fsync has little left to do; the writers never wait on the disk's queue
themselves. A file per array would cost an fsync and a directory entry per
array, which dominates for trees of many small leaves; bench/checkpoint.py shows one
file per process writing at about the disk's own speed.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import os
import pathlib
import queue
import sys
import threading
from collections.abc import Callable, Sequence

import numpy as np

from fcir.checkpoint import checksums, parallel
from fcir.checkpoint.progress import Progress
from fcir.checkpoint.storage import ObjectStore
from fcir.errors import CheckpointError

#: Unit of work of one write (a multiple of the checksum chunk).
PIECE_BYTES = 16 * checksums.CHUNK_BYTES
#: Large shards start on page boundaries; small ones are packed on cache lines.
_PAGE, _LINE, _LARGE = 4096, 64, 1 << 20


@dataclasses.dataclass
class Written:
    offset: int
    length: int
    crcs: list[int]
    file: int = 0  # index into the files the writer returned


def plan_offsets(lengths: Sequence[int]) -> tuple[list[int], int]:
    """Offsets of blocks of the given lengths packed into one file, and its size."""
    offsets, end = [], 0
    for n in lengths:
        align = _PAGE if n >= _LARGE else _LINE
        end = -(-end // align) * align
        offsets.append(end)
        end += n
    return offsets, end


def _writeback_starter() -> Callable[[int, int, int], object] | None:
    """`sync_file_range(fd, off, n, SYNC_FILE_RANGE_WRITE)` where Linux has it, else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return lambda fd, off, n: fn(fd, off, n, 2)


_start_writeback = _writeback_starter()


class _Flusher:
    """A (pooled) thread that starts writeback of file ranges as writers finish them (a
    hint only: errors surface from the final fsync)."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._ranges: queue.SimpleQueue[tuple[int, int] | None] = queue.SimpleQueue()
        self._thread = None
        if _start_writeback is not None:
            self._thread = parallel.start(self._run)  # None at exit: no hints then

    def written(self, offset: int, length: int) -> None:
        if self._thread is not None:
            self._ranges.put((offset, length))

    def close(self) -> None:
        if self._thread is not None:
            self._ranges.put(None)
            self._thread.join()

    def _run(self) -> None:
        while (item := self._ranges.get()) is not None:
            _start_writeback(self._fd, *item)


def _os_error(action: str, path: pathlib.Path, e: OSError) -> CheckpointError:
    reason = e.strerror or str(e)
    return CheckpointError(f"{action} {path}: {reason} (errno {e.errno})")


#: The most one pwrite call writes. Measured on this project's VMs (Linux 6.18, ext4,
#: load 5-10): 256 MiB written in 1 MiB calls took 0.25-0.43 s in every run, in 4 MiB
#: or 16 MiB calls 0.3-2.9 s, erratically (one call larger than a huge page gets the
#: page cache's large folios, whose allocation stalls there); 256 KiB calls were no
#: faster than 1 MiB ones. One checksum chunk per call also keeps the chunk in cache
#: between its CRC and its copy into the page cache.
WRITE_BYTES = checksums.CHUNK_BYTES


def _checksum_and_write(fd: int, data: memoryview, pos: int) -> list[int]:
    """pwrites `data` at `pos` one checksum chunk at a time, each chunk checksummed just
    before it is written; returns the chunks' CRCs."""
    crcs = []
    for a in range(0, max(len(data), 1), WRITE_BYTES):
        chunk = data[a : a + WRITE_BYTES]
        crcs.append(checksums.crc32(chunk))
        at = pos + a
        while chunk:
            n = os.pwrite(fd, chunk, at)
            if n <= 0:
                raise OSError(errno.EIO, "short write")
            chunk, at = chunk[n:], at + n
    return crcs


class Durable:
    """fsyncs of written files, started as soon as each file is written, on a few
    pooled threads of their own (so the writers go on with later files meanwhile). `wait()`
    returns once every fsync has returned and re-raises the first failure. Takes
    ownership of the file descriptors and closes them."""

    def __init__(self, threads: int = parallel.THREADS) -> None:
        self._queue: queue.SimpleQueue[tuple[int, pathlib.Path] | None] = queue.SimpleQueue()
        self._max = threads
        self._workers: list[parallel.Job] = []
        self._errors: list[CheckpointError] = []
        self._lock = threading.Lock()

    def add(self, fd: int, path: pathlib.Path) -> None:
        with self._lock:
            self._queue.put((fd, path))
            if len(self._workers) < self._max:
                worker = parallel.start(self._run)
                if worker is not None:
                    self._workers.append(worker)
            if self._workers:
                return
        self._queue.put(None)
        self._run()  # no thread could start (at exit): fsync here

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            fd, path = item
            try:
                os.fsync(fd)
            except OSError as e:
                with self._lock:
                    self._errors.append(_os_error("writing", path, e))
            finally:
                os.close(fd)

    def wait(self) -> None:
        with self._lock:
            workers = list(self._workers)
            for _ in workers:
                self._queue.put(None)
            self._workers = []
        for w in workers:
            w.join()
        if self._errors:
            raise self._errors[0]


def write_data_file(
    path: pathlib.Path,
    blocks: Sequence[np.ndarray],
    progress: Progress | None = None,
    threads: int | None = None,
    durable: Durable | None = None,
) -> tuple[list[Written], int]:
    """Writes every block (C-contiguous) into a new file at `path` and fsyncs it.

    Returns where each block went with its chunk checksums, and the file's size. With
    `durable`, it returns once the bytes are written and their checksums known, and the
    fsync runs on in `durable` (the caller must `durable.wait()` before anything relies
    on the file being on disk).
    """
    lengths = [b.nbytes for b in blocks]
    offsets, size = plan_offsets(lengths)
    crcs = [[0] * checksums.chunk_count(n, checksums.CHUNK_BYTES) for n in lengths]
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    except OSError as e:
        raise _os_error("cannot create", path, e) from e
    try:
        flusher = _Flusher(fd)
        views = [memoryview(b.reshape(-1).view(np.uint8)) for b in blocks]

        def piece(i: int, start: int) -> Callable[[], None]:
            def run() -> None:
                data = views[i][start : start + PIECE_BYTES]
                first = start // checksums.CHUNK_BYTES
                for j, crc in enumerate(_checksum_and_write(fd, data, offsets[i] + start)):
                    crcs[i][first + j] = crc
                flusher.written(offsets[i] + start, min(PIECE_BYTES, lengths[i] - start))
                if progress is not None:
                    progress.advance(min(PIECE_BYTES, lengths[i] - start))

            return run

        tasks = [piece(i, s) for i, n in enumerate(lengths) for s in range(0, n, PIECE_BYTES)]
        try:
            parallel.run_tasks(tasks, threads)
        finally:
            flusher.close()
        if os.fstat(fd).st_size < size:  # trailing alignment of an empty last block
            os.ftruncate(fd, size)
        if durable is None:
            os.fsync(fd)
    except OSError as e:
        os.close(fd)
        raise _os_error("writing", path, e) from e
    except BaseException:
        os.close(fd)
        raise
    if durable is None:
        os.close(fd)
    else:
        durable.add(fd, path)
    return [Written(o, n, c) for o, n, c in zip(offsets, lengths, crcs)], size


#: Objects in object stores are written up to this size (a larger shard is one object
#: of its own), several at once.
OBJECT_BYTES = 64 << 20
#: Objects in flight per process; bounds the memory their bodies take.
OBJECT_THREADS = 4


def write_objects(
    store: ObjectStore, stem: str, blocks: Sequence[np.ndarray], progress: Progress | None = None
) -> tuple[list[tuple[str, int]], list[Written]]:
    """Writes the blocks into objects `<stem>-<k>.bin` of `store`, several concurrently.

    Returns the objects' (name, size) and where each block went with its checksums.
    """
    groups: list[list[int]] = []
    size = 0
    for i, b in enumerate(blocks):
        if not groups or size + b.nbytes > OBJECT_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(i)
        size += b.nbytes
    written: list[Written | None] = [None] * len(blocks)
    files: list[tuple[str, int]] = []
    tasks = []
    for k, members in enumerate(groups):
        name = f"{stem}-{k:03d}.bin"
        offsets, total = plan_offsets([blocks[i].nbytes for i in members])
        files.append((name, total))

        def task(
            name: str = name,
            members: list[int] = members,
            offsets: list[int] = offsets,
            total: int = total,
            k: int = k,
        ) -> None:
            pieces: list[bytes | memoryview] = []
            end = 0
            for i, off in zip(members, offsets):
                view = memoryview(blocks[i].reshape(-1).view(np.uint8))
                if off > end:
                    pieces.append(bytes(off - end))
                pieces.append(view)
                end = off + len(view)
                crcs = checksums.chunk_crcs(view, checksums.CHUNK_BYTES)
                written[i] = Written(off, len(view), crcs, k)
            if total > end:
                pieces.append(bytes(total - end))
            store.write(name, b"".join(pieces))
            if progress is not None:
                progress.advance(sum(blocks[i].nbytes for i in members))

        tasks.append(task)
    parallel.run_tasks(tasks, OBJECT_THREADS)
    return files, written  # type: ignore[return-value]


def write_chunk_objects(
    store: ObjectStore,
    names: Sequence[str],
    blocks: Sequence[np.ndarray],
    progress: Progress | None = None,
) -> list[Written]:
    """PUTs each block as an object of its own at `names[k]`, OBJECT_THREADS at a time,
    each checksummed as it is sent; returns their checksums (block k is file k)."""
    written: list[Written | None] = [None] * len(blocks)

    def task(k: int) -> Callable[[], None]:
        def run() -> None:
            view = memoryview(blocks[k].reshape(-1).view(np.uint8))
            crcs = checksums.chunk_crcs(view, checksums.CHUNK_BYTES)
            store.write(names[k], view)
            written[k] = Written(0, len(view), crcs, k)
            if progress is not None:
                progress.advance(len(view))

        return run

    parallel.run_tasks([task(k) for k in range(len(blocks))], OBJECT_THREADS)
    return written  # type: ignore[return-value]


def write_files(
    directory: pathlib.Path,
    names: Sequence[str],
    blocks: Sequence[np.ndarray],
    progress: Progress | None = None,
) -> list[Written]:
    """Writes each block into a new file of its own at `directory/name` (creating
    subdirectories), several at a time, and fsyncs them: each file's fsync starts as
    soon as it is written, on a thread of its own, while the writers go on to the next
    files; returns once every fsync has returned, with their checksums (the block of
    `names[k]` is file k)."""
    for d in sorted({(directory / n).parent for n in names}):
        d.mkdir(parents=True, exist_ok=True)
    written: list[Written | None] = [None] * len(blocks)

    def task(k: int) -> Callable[[], None]:
        def run() -> None:
            path = directory / names[k]
            view = memoryview(blocks[k].reshape(-1).view(np.uint8))
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            except OSError as e:
                raise _os_error("cannot create", path, e) from e
            try:
                crcs = _checksum_and_write(fd, view, 0)
                if _start_writeback is not None:
                    _start_writeback(fd, 0, 0)  # the disk starts on it; the fsync waits
            except BaseException as e:
                os.close(fd)
                if isinstance(e, OSError):
                    raise _os_error("writing", path, e) from e
                raise
            durable.add(fd, path)  # fsynced while this thread writes the next file
            written[k] = Written(0, len(view), crcs, k)
            if progress is not None:
                progress.advance(len(view))

        return run

    durable = Durable()
    try:
        parallel.run_tasks([task(k) for k in range(len(blocks))])
    except BaseException:
        with contextlib.suppress(CheckpointError):
            durable.wait()  # the files are closed; the first error is the one to tell
        raise
    durable.wait()
    return written  # type: ignore[return-value]
