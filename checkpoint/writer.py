"""Writes one process's shards into its data file, concurrently, and makes them durable.

One file per process: shards are packed at aligned offsets and written by a few threads
in pieces of PIECE_BYTES. Where the file system takes direct I/O (`O_DIRECT`: ext4,
xfs, btrfs; not tmpfs), the whole checksum chunks of large shards (and of Orbax-format
chunk files of 1 MiB or more, which write_files writes) bypass the page cache:
each chunk is copied into a reused, aligned per-thread buffer, checksummed there while
it is in cache, and DIRECT_BYTES at a time are written from that buffer straight to the
device (bytes at a page-aligned address are checksummed and written where they are).
A shard whose device-to-host copy is still in flight is awaited by the first writer
thread that needs it, while the others write what has arrived. Everything else (small
shards, the last part of a shard short of a chunk, every byte where direct I/O is
refused) is written through the page cache one checksum chunk per `pwrite`, each chunk
checksummed just before (larger calls are erratically slow: see WRITE_BYTES), and a
flusher thread asks the kernel to start writing those ranges back
(`sync_file_range`). Either way the final fsync makes the file durable. A file per
array would cost an fsync and a directory entry per array, which dominates for trees
of many small leaves.

Why direct I/O: a page-cache write must first get fresh pages for the file, and on this
project's VMs (Linux 6.18 guests) that is what a save's time was: 256 MiB written into a
new file took 1.67 s of `pwrite`s plus 0.15 s of fsync, the same bytes over the cached
pages of an existing file 0.11 s plus 0.09 s, and with `O_DIRECT` from an aligned
buffer 0.16 s in all (and `dd oflag=direct` 0.26-0.29 s against 1.6-2.0 s buffered,
3 runs each, load 10). Direct writes also leave the page cache to the training job
instead of filling it with a checkpoint nobody reads back soon.
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
from typing import Protocol

import numpy as np
from fcir.checkpoint import checksums, parallel
from fcir.checkpoint.progress_bar import Progress
from fcir.checkpoint.reader import aligned_empty
from fcir.checkpoint.storage import ObjectStore

from fcir.errors import CheckpointError

#: Unit of work of one write (a multiple of the checksum chunk).
PIECE_BYTES = 16 * checksums.CHUNK_BYTES
#: Large shards start on page boundaries; small ones are packed on cache lines.
_PAGE, _LINE, _LARGE = 4096, 64, 1 << 20

#: Bytes per direct write (a multiple of the checksum chunk): each writer thread keeps
#: one aligned buffer of this size for as long as the process lives, reused by every
#: save (fresh pages for it on every save would cost what direct I/O saves).
DIRECT_BYTES = 4 * checksums.CHUNK_BYTES
#: File offsets, lengths and buffer addresses of direct writes are multiples of this
#: (the page size, which covers every device's logical block size).
_DIRECT_ALIGN = 4096


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


_thread_bounce = threading.local()


def _bounce() -> np.ndarray:
    """This thread's aligned buffer for direct writes (DIRECT_BYTES; the reader's
    aligned_empty puts a buffer this large on a 2 MiB boundary, a multiple of
    _DIRECT_ALIGN)."""
    buf = getattr(_thread_bounce, "buf", None)
    if buf is None:
        buf = _thread_bounce.buf = aligned_empty((DIRECT_BYTES,), np.dtype(np.uint8))
    return buf


def _open_direct(path: pathlib.Path) -> int | None:
    """A second descriptor of the new file at `path` for direct writes, or None where
    the platform or the file system has no direct I/O (then every write is buffered)."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return None
    try:
        return os.open(path, os.O_WRONLY | os.O_CLOEXEC | flag)
    except OSError:  # EINVAL: e.g. tmpfs
        return None


def _checksum_and_write_direct(fd: int, data: memoryview, pos: int) -> list[int]:
    """Writes `data` (whole checksum chunks) at `pos` (aligned) with direct I/O, and
    returns the chunks' CRCs. Data at an aligned address (e.g. an array fcir restored)
    is checksummed and written where it is: one pass over memory instead of a copy.
    Other data goes through this thread's buffer: each chunk is copied in, checksummed
    while it is in cache, and the buffer written when full."""
    src = np.frombuffer(data, np.uint8)
    in_place = src.ctypes.data % _DIRECT_ALIGN == 0
    bounce = src if in_place else _bounce()
    crcs = []
    chunk = checksums.CHUNK_BYTES
    for a in range(0, len(src), DIRECT_BYTES):
        n = min(DIRECT_BYTES, len(src) - a)
        for c in range(0, n, chunk):
            if in_place:
                crcs.append(checksums.crc32(src[a + c : a + c + chunk]))
                continue
            dst = bounce[c : c + chunk]
            np.copyto(dst, src[a + c : a + c + chunk])  # numpy copies without the GIL
            crcs.append(checksums.crc32(dst))
        view = memoryview(src[a : a + n] if in_place else bounce[:n])
        at = pos + a
        while view:
            written = os.pwrite(fd, view, at)
            if written <= 0 or written % _DIRECT_ALIGN:
                raise OSError(errno.EIO, "short direct write")
            view, at = view[written:], at + written
    return crcs


class _Direct:
    """Direct writes into one new file, where its file system takes them: a second
    descriptor opened with O_DIRECT, dropped (for the rest of the file) at the first
    write it refuses with EINVAL. Without one, every write goes through the page cache."""

    def __init__(self, path: pathlib.Path, wanted: bool = True) -> None:
        self._fd = _open_direct(path) if wanted else None  # not worth an fd when nothing is large
        self._use = self._fd

    def write(self, fd: int, data: memoryview, pos: int) -> tuple[list[int], int]:
        """Writes `data` at file offset `pos`: its whole checksum chunks directly when
        `pos` is aligned, the rest through `fd` (the page cache). Returns the chunks'
        CRCs and how many leading bytes went directly."""
        use = self._use
        k = len(data) // checksums.CHUNK_BYTES * checksums.CHUNK_BYTES
        crcs: list[int] = []
        if use is not None and k and pos % _DIRECT_ALIGN == 0:
            try:
                crcs = _checksum_and_write_direct(use, data[:k], pos)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                self._use, crcs = None, []  # refused after all: the page cache from here
        k = len(crcs) * checksums.CHUNK_BYTES
        if k < len(data) or not data:  # an empty block still has its one checksum
            crcs += _checksum_and_write(fd, data[k:], pos + k)
        return crcs, k

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = self._use = None


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


class HostBlock(Protocol):
    """A block whose bytes may still be on their way to the host (snapshot.ShardData)."""

    nbytes: int

    def host(self) -> np.ndarray:
        """The bytes (C-contiguous), once they are on the host."""
        ...


def _bytes_of(block: np.ndarray | HostBlock) -> memoryview:
    data = block if isinstance(block, np.ndarray) else block.host()
    return memoryview(data.reshape(-1).view(np.uint8))


def write_data_file(
    path: pathlib.Path,
    blocks: Sequence[np.ndarray | HostBlock],
    progress: Progress | None = None,
    threads: int | None = None,
    durable: Durable | None = None,
) -> tuple[list[Written], int]:
    """Writes every block (C-contiguous) into a new file at `path` and fsyncs it.

    Blocks are written in order, each piece as soon as its block's bytes are on the
    host: a HostBlock's device-to-host copy is awaited by the first writer thread that
    needs it, while the others write what has arrived. Returns where each block went
    with its chunk checksums, and the file's size. With `durable`, it returns once the
    bytes are written and their checksums known, and the fsync runs on in `durable`
    (the caller must `durable.wait()` before anything relies on the file being on disk).
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
        direct = _Direct(path, any(n >= _LARGE for n in lengths))

        def piece(i: int, start: int) -> Callable[[], None]:
            def run() -> None:
                data = _bytes_of(blocks[i])[start : start + PIECE_BYTES]
                pos = offsets[i] + start
                first = start // checksums.CHUNK_BYTES
                got, k = direct.write(fd, data, pos)
                if k < len(data):
                    flusher.written(pos + k, len(data) - k)
                crcs[i][first : first + len(got)] = got
                if progress is not None:
                    progress.advance(len(data))

            return run

        tasks = [piece(i, s) for i, n in enumerate(lengths) for s in range(0, n, PIECE_BYTES)]
        try:
            parallel.run_tasks(tasks, threads)
        finally:
            flusher.close()
            direct.close()
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
            direct = _Direct(path, len(view) >= _LARGE)
            try:
                crcs, done = direct.write(fd, view, 0)
                if _start_writeback is not None and done < len(view):
                    _start_writeback(fd, done, 0)  # the disk starts on it; the fsync waits
            except BaseException as e:
                os.close(fd)
                if isinstance(e, OSError):
                    raise _os_error("writing", path, e) from e
                raise
            finally:
                direct.close()
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
