"""Reads the parts of stored shards that a set of destination blocks needs, verified.

Reads go straight into the destination buffers when the needed part of a stored
shard is one contiguous byte range that lands contiguously in a destination (the same
sharding, or any resharding along the leading dimension). A split along another
dimension cuts a stored shard into runs (e.g. half rows) that land in several
destinations: from local files each checksum chunk is then read with one `preadv`
whose buffers are the runs' places in their destinations (a *scatter* read), so no
byte is copied twice. Runs shorter than SCATTER_MIN_RUN_BYTES (where a Python-level
buffer per run costs more than a copy), overlapping destinations and object stores
take the slab path: the needed rows are read once, a slab at a time, into a scratch
buffer and copied into every destination that needs them.

Checksums cover fixed-size chunks of each stored shard; a partial read also reads the
rest of the chunks it touches, so every byte handed back has been verified.
"""

from __future__ import annotations

import itertools
import os
import pathlib
import threading
from collections.abc import Callable
from typing import Self

import numpy as np

from fcir._proto import checkpoint_pb2 as pb
from fcir.checkpoint import checksums, shardings
from fcir.checkpoint.layout import dtype_from_name
from fcir.checkpoint.progress import Progress
from fcir.checkpoint.shardings import Box
from fcir.checkpoint.storage import ObjectStore
from fcir.errors import CheckpointError

#: Largest single read straight into a destination.
PIECE_BYTES = 16 * checksums.CHUNK_BYTES
#: Rows read into scratch at a time: small enough to stay in cache while the slab is
#: checksummed and copied out.
SLAB_BYTES = 2 * checksums.CHUNK_BYTES
#: Shortest contiguous run that a scatter read puts straight into its destination.
#: A run costs about 1 us of Python (its memoryview and CRC call, under the GIL); the
#: slab path's copy costs about as much per 16 KiB. Measured for issue 22 (2 cores,
#: load 10-14, from the page cache into prefaulted destinations; f32 saved as 8 row
#: blocks, restored onto a (4, 2) mesh, i.e. half rows; medians of 6-7, s): 128 KiB
#: runs (512 MiB) 0.24-0.31 by scatter reads, 0.31-0.41 by the slab path, 0.22-0.27
#: onto the saved sharding; 16 KiB runs (1 GiB) 0.55-1.05, 0.72-1.21 and 0.53-0.92;
#: 8 KiB runs (256-512 MiB) 0.18-0.59, 0.16-0.57 and 0.12-0.38 (no gain: slab).
SCATTER_MIN_RUN_BYTES = 16 << 10
#: Most buffers one preadv takes (Linux's IOV_MAX).
_IOV_MAX = 1024

Task = Callable[[], None]


def aligned_empty(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """An uninitialized C-contiguous array at a 64-byte aligned address.

    On CPU, jax.device_put adopts such a buffer without copying it.
    """
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + 64, np.uint8)
    start = (-raw.ctypes.data) % 64
    return raw[start : start + nbytes].view(dtype).reshape(shape)


class DataFiles:
    """The open data files of one checkpoint, opened on first use and checked for size."""

    def __init__(self, directory: pathlib.Path, layout: pb.CheckpointLayout) -> None:
        self.directory = directory
        self.layout = layout
        self._fds: dict[int, int] = {}
        self._lock = threading.Lock()

    def fd(self, index: int, array: str) -> int:
        with self._lock:
            if index in self._fds:
                return self._fds[index]
            entry = self.layout.files[index]
            path = self.directory / entry.name
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except OSError as e:
                raise CheckpointError(
                    f"array {array!r}: cannot open data file {path}: {e.strerror or e}"
                ) from e
            size = os.fstat(fd).st_size
            if size < entry.size_bytes:
                os.close(fd)
                raise CheckpointError(
                    f"array {array!r}: data file {path} is truncated "
                    f"({size} of {entry.size_bytes} bytes)"
                )
            self._fds[index] = fd
            return fd

    def name(self, index: int) -> str:
        return str(self.directory / self.layout.files[index].name)

    #: Whether a read should fetch whole checksum chunks in one request (object stores).
    whole_chunks = False

    def pread(self, index: int, dest: memoryview, offset: int, array: str) -> None:
        """Fills `dest` from byte `offset` of data file `index`."""
        _pread_into(
            self.fd(index, array),
            dest,
            offset,
            lambda: f"array {array!r}: data file {self.name(index)}",
        )

    def preadv(self, index: int, dests: list[memoryview], offset: int, array: str) -> None:
        """Fills the buffers `dests`, one after another, from byte `offset` of file `index`."""
        fd = self.fd(index, array)
        views = list(dests)
        i = 0
        while i < len(views):
            n = os.preadv(fd, views[i : i + _IOV_MAX], offset)
            if n <= 0:
                raise CheckpointError(
                    f"array {array!r}: data file {self.name(index)} is truncated "
                    f"(nothing at byte {offset})"
                )
            offset += n
            while n and n >= len(views[i]):
                n -= len(views[i])
                i += 1
            if n:
                views[i] = views[i][n:]

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _pread_into(fd: int, dest: memoryview, offset: int, what: Callable[[], str]) -> None:
    while dest:
        n = os.preadv(fd, [dest], offset)
        if n <= 0:
            raise CheckpointError(f"{what()} is truncated (nothing at byte {offset})")
        dest, offset = dest[n:], offset + n


class ObjectDataFiles:
    """The data objects of a checkpoint in an object store, read by ranged GETs."""

    whole_chunks = True

    def __init__(self, store: ObjectStore, layout: pb.CheckpointLayout) -> None:
        self.directory = store
        self.layout = layout

    def name(self, index: int) -> str:
        return f"{self.directory.url}/{self.layout.files[index].name}"

    def pread(self, index: int, dest: memoryview, offset: int, array: str) -> None:
        entry = self.layout.files[index]
        try:
            got = self.directory.read(entry.name, offset, offset + len(dest))
        except CheckpointError as e:
            raise CheckpointError(f"array {array!r}: data file {self.name(index)}: {e}") from e
        if got is None:
            raise CheckpointError(f"array {array!r}: cannot open data file {self.name(index)}")
        if len(got) < len(dest):
            raise CheckpointError(
                f"array {array!r}: data file {self.name(index)} is truncated "
                f"(nothing at byte {offset + len(got)})"
            )
        dest[:] = got

    def close(self) -> None:
        pass

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def open_files(
    directory: pathlib.Path | ObjectStore, layout: pb.CheckpointLayout
) -> DataFiles | ObjectDataFiles:
    if isinstance(directory, ObjectStore):
        return ObjectDataFiles(directory, layout)
    return DataFiles(directory, layout)


def read_range(
    files: DataFiles | ObjectDataFiles,
    shard: pb.ShardRecord,
    chunk_bytes: int,
    start: int,
    stop: int,
    dest: memoryview,
    array: str,
) -> None:
    """Reads bytes [start, stop) of a stored shard into `dest` and verifies them.

    One checksum chunk at a time: each is checksummed right after it is read, while it
    is still in the CPU cache, instead of in a second pass over memory. The parts of the
    first and last chunk outside the range are read too, into a small buffer, to check
    those chunks whole. From object stores, where a request costs far more than a
    pass over memory, the whole chunk-aligned range comes in one ranged read.
    """
    base = shard.offset

    def where() -> str:
        return f"array {array!r}: data file {files.name(shard.file)}"

    first, last = start // chunk_bytes, max(start, stop - 1) // chunk_bytes
    if files.whole_chunks:
        lo, hi = first * chunk_bytes, min((last + 1) * chunk_bytes, shard.length)
        # Straight into `dest` when the range is whole chunks, else via a buffer.
        buf = dest if (lo, hi) == (start, stop) else memoryview(bytearray(hi - lo))
        files.pread(shard.file, buf, base + lo, array)
        for c in range(first, last + 1):
            a, b = c * chunk_bytes - lo, min((c + 1) * chunk_bytes, shard.length) - lo
            if checksums.crc32(buf[a:b]) != shard.chunk_checksums[c]:
                raise CheckpointError(
                    f"{where()}: checksum mismatch in bytes {base + lo + a}..{base + lo + b} "
                    "(the checkpoint is corrupt)"
                )
        if buf is not dest:
            dest[:] = buf[start - lo : stop - lo]
        return
    for c in range(first, last + 1):
        lo, hi = c * chunk_bytes, min((c + 1) * chunk_bytes, shard.length)
        a, b = max(lo, start), min(hi, stop)
        crc = 0
        if lo < a:
            part = memoryview(bytearray(a - lo))  # the first chunk's bytes before start
            files.pread(shard.file, part, base + lo, array)
            crc = checksums.crc32(part)
        if a < b:
            part = dest[a - start : b - start]
            files.pread(shard.file, part, base + a, array)
            crc = checksums.crc32(part, crc)
        if b < hi:
            part = memoryview(bytearray(hi - b))  # the last chunk's bytes after stop
            files.pread(shard.file, part, base + b, array)
            crc = checksums.crc32(part, crc)
        if crc != shard.chunk_checksums[c]:
            raise CheckpointError(
                f"{where()}: checksum mismatch in bytes {base + lo}..{base + hi} "
                "(the checkpoint is corrupt)"
            )


_thread_scratch = threading.local()


def _scratch(nbytes: int) -> np.ndarray:
    """A per-thread reusable buffer: fresh pages cost a page fault each, reused ones none."""
    buf = getattr(_thread_scratch, "buf", None)
    if buf is None or buf.nbytes < nbytes:
        buf = _thread_scratch.buf = np.empty(max(nbytes, SLAB_BYTES), np.uint8)
    return buf[:nbytes]


def _is_contiguous(shape: tuple[int, ...], box: Box) -> bool:
    """Whether `box` is one contiguous run of a C-order array of `shape`."""
    extents = shardings.box_shape(box)
    k = 0
    while k < len(shape) and extents[k] == 1:
        k += 1
    return all(box[0][j] == 0 and box[1][j] == shape[j] for j in range(k + 1, len(shape)))


def _linear(shape: tuple[int, ...], index: tuple[int, ...]) -> int:
    out = 0
    for size, i in zip(shape, index):
        out = out * size + i
    return out


def plan_array(
    files: DataFiles | ObjectDataFiles,
    record: pb.ArrayRecord,
    array: str,
    dests: list[tuple[Box, np.ndarray]],
    progress: Progress | None = None,
) -> list[Task]:
    """Tasks that fill each destination (global box, C-contiguous buffer of its shape)."""
    itemsize = dtype_from_name(record.dtype).itemsize
    chunk = files.layout.checksum_chunk_bytes
    tasks: list[Task] = []
    covered = [0] * len(dests)
    for shard in record.shards:
        sbox = (tuple(r.start for r in shard.index), tuple(r.stop for r in shard.index))
        sshape = shardings.box_shape(sbox)
        scattered: list[tuple[Box, np.ndarray]] = []  # (box in shard coords, dest view)
        bases: list[np.ndarray] = []  # the C-contiguous buffer of each scattered view
        for d, (dbox, buf) in enumerate(dests):
            inter = shardings.intersect(sbox, dbox)
            if inter is None:
                continue
            covered[d] += shardings.volume(inter)
            in_shard = shardings.shift(inter, sbox[0])
            view = buf[shardings.to_slices(shardings.shift(inter, dbox[0]))]
            if _is_contiguous(sshape, in_shard) and view.flags.c_contiguous:
                start = _linear(sshape, in_shard[0]) * itemsize
                tasks += _direct_tasks(files, shard, chunk, start, view, array, progress)
            else:
                scattered.append((in_shard, view))
                bases.append(buf)
        if scattered:
            runs = None
            if isinstance(files, DataFiles):
                runs = _scatter_runs(sshape, itemsize, scattered, bases)
            if runs is not None:
                tasks += _scatter_tasks(files, shard, chunk, runs, bases, array, progress)
            else:
                tasks += _slab_tasks(
                    files, shard, chunk, sshape, itemsize, scattered, array, progress
                )
    for (dbox, _), got in zip(dests, covered):
        if got != shardings.volume(dbox):
            raise CheckpointError(
                f"array {array!r}: the stored shards cover {got} of the "
                f"{shardings.volume(dbox)} elements of block {dbox} (overlapping or missing "
                "shards); the layout is inconsistent"
            )
    return tasks


def _direct_tasks(
    files: DataFiles | ObjectDataFiles,
    shard: pb.ShardRecord,
    chunk: int,
    start: int,
    view: np.ndarray,
    array: str,
    progress: Progress | None,
) -> list[Task]:
    dest = memoryview(view.reshape(-1).view(np.uint8))
    stop = start + len(dest)
    cuts = [start]
    cut = (start // PIECE_BYTES + 1) * PIECE_BYTES  # piece bounds on chunk bounds
    while cut < stop:
        cuts.append(cut)
        cut += PIECE_BYTES
    cuts.append(stop)

    def task(a: int, b: int) -> Task:
        def run() -> None:
            read_range(files, shard, chunk, a, b, dest[a - start : b - start], array)
            if progress is not None:
                progress.advance(b - a)

        return run

    return [task(a, b) for a, b in itertools.pairwise(cuts) if b > a]


def _slab_tasks(
    files: DataFiles | ObjectDataFiles,
    shard: pb.ShardRecord,
    chunk: int,
    sshape: tuple[int, ...],
    itemsize: int,
    scattered: list[tuple[Box, np.ndarray]],
    array: str,
    progress: Progress | None,
) -> list[Task]:
    row_bytes = int(np.prod(sshape[1:], dtype=np.int64)) * itemsize
    rows_per_slab = max(1, SLAB_BYTES // max(row_bytes, 1))
    intervals: list[list[int]] = []  # merged leading-dimension row ranges that are needed
    for lo, hi in sorted((b[0][0], b[1][0]) for b, _ in scattered):
        if intervals and lo <= intervals[-1][1]:
            intervals[-1][1] = max(intervals[-1][1], hi)
        else:
            intervals.append([lo, hi])
    dtype = scattered[0][1].dtype

    def task(r0: int, r1: int) -> Task:
        def run() -> None:
            scratch = _scratch((r1 - r0) * row_bytes)
            read_range(
                files, shard, chunk, r0 * row_bytes, r1 * row_bytes, memoryview(scratch), array
            )
            rows = scratch.view(dtype).reshape((r1 - r0, *sshape[1:]))
            for (lo, hi), view in scattered:
                a, b = max(lo[0], r0), min(hi[0], r1)
                if a < b:
                    src = rows[(slice(a - r0, b - r0), *map(slice, lo[1:], hi[1:]))]
                    view[a - lo[0] : b - lo[0]] = src
                    if progress is not None:
                        progress.advance(src.nbytes)

        return run

    return [
        task(r, min(r + rows_per_slab, hi))
        for lo, hi in intervals
        for r in range(lo, hi, rows_per_slab)
    ]


class _Runs:
    """Where a stored shard's needed bytes go: contiguous runs, in file order, each
    `length[i]` bytes from byte `src[i]` of the shard to byte `dst[i]` of `bases[buf[i]]`."""

    def __init__(self, src: np.ndarray, dst: np.ndarray, length: np.ndarray, buf: np.ndarray):
        order = np.argsort(src, kind="stable")
        self.src, self.dst = src[order], dst[order]
        self.length, self.buf = length[order], buf[order]
        self.end = self.src + self.length

    def overlap(self) -> bool:
        return bool(np.any(self.src[1:] < self.end[:-1]))


def _scatter_runs(
    sshape: tuple[int, ...],
    itemsize: int,
    scattered: list[tuple[Box, np.ndarray]],
    bases: list[np.ndarray],
) -> _Runs | None:
    """The runs of a scatter read of these destination views, or None where one is
    shorter than SCATTER_MIN_RUN_BYTES or two destinations need the same bytes."""
    ndim = len(sshape)
    shard_strides = [itemsize * int(np.prod(sshape[j + 1 :], dtype=np.int64)) for j in range(ndim)]
    srcs, dsts, lengths, bufs = [], [], [], []
    for b, ((lo, hi), view) in enumerate(scattered):
        ext = [h - a for a, h in zip(lo, hi)]
        # Merge trailing dimensions into one run while the destination view stays
        # contiguous over them and the shard holds them whole (dimension k itself may
        # be partial in the shard: the run is then a part of a row).
        k, run = ndim, itemsize
        while k > 0:
            j = k - 1
            if ext[j] != 1 and view.strides[j] != run:
                break
            k, run = j, run * ext[j]
            if ext[j] != sshape[j]:
                break
        if run < SCATTER_MIN_RUN_BYTES:
            return None
        start = sum(lo[j] * shard_strides[j] for j in range(k, ndim))
        view_at = view.__array_interface__["data"][0] - bases[b].__array_interface__["data"][0]
        if k == 0:
            src, dst = np.array([start], np.int64), np.array([view_at], np.int64)
        else:
            idx = np.indices(ext[:k], dtype=np.int64).reshape(k, -1)
            src = start + sum((lo[j] + idx[j]) * shard_strides[j] for j in range(k))
            dst = view_at + sum(idx[j] * view.strides[j] for j in range(k))
        srcs.append(src)
        dsts.append(dst)
        lengths.append(np.full(len(src), run, np.int64))
        bufs.append(np.full(len(src), b, np.int64))
    runs = _Runs(*(np.concatenate(x) for x in (srcs, dsts, lengths, bufs)))
    return None if runs.overlap() else runs


def _scatter_tasks(
    files: DataFiles,
    shard: pb.ShardRecord,
    chunk: int,
    runs: _Runs,
    bases: list[np.ndarray],
    array: str,
    progress: Progress | None,
) -> list[Task]:
    """Tasks that read each checksum chunk the runs touch with one preadv whose buffers
    are the runs' places in their destinations (the chunk's other bytes go to scratch,
    to be checksummed), then verify the chunk.

    Where each buffer goes is worked out with numpy for a whole task at once; per run,
    only a memoryview slice and a CRC call are left to Python.
    """
    flat = [memoryview(b.reshape(-1).view(np.uint8)) for b in bases]
    first = runs.src // chunk
    last = (runs.end - 1) // chunk
    needed = np.unique(np.concatenate([first, last, *_between(first, last)]))
    per_task = max(1, PIECE_BYTES // chunk)
    groups: list[list[int]] = []
    for c in needed.tolist():
        if groups and c == groups[-1][-1] + 1 and len(groups[-1]) < per_task:
            groups[-1].append(c)
        else:
            groups.append([c])
    gap = len(flat)  # the buffer index of a chunk's bytes no destination needs

    def pieces(c0: int, c1: int) -> tuple[list[int], list[int], list[int], list[int], list[int]]:
        """The buffers that chunks c0..c1-1 are read into: each piece's buffer index,
        start and stop in it; for each chunk the index of its first piece (and one past
        the last chunk's last), and the bytes it puts into destinations."""
        lo, hi = c0 * chunk, min(c1 * chunk, shard.length)
        i = int(np.searchsorted(runs.end, lo, side="right"))
        j = int(np.searchsorted(runs.src, hi, side="left"))
        bounds = np.arange(lo, hi, chunk, dtype=np.int64)
        cuts = np.unique(np.concatenate([bounds, runs.src[i:j], runs.end[i:j], [lo, hi]]))
        cuts = cuts[(cuts >= lo) & (cuts <= hi)]
        p, q = cuts[:-1], cuts[1:]
        r = np.searchsorted(runs.src[i:j], p, side="right") - 1 + i
        inside = (r >= i) & (p < runs.end[np.maximum(r, 0)])
        r = np.maximum(r, 0)
        at = np.where(inside, runs.dst[r] + p - runs.src[r], p % chunk)
        buf = np.where(inside, runs.buf[r], gap)
        heads = np.searchsorted(p, bounds)
        useful = np.add.reduceat(np.where(inside, q - p, 0), heads).tolist()
        return buf.tolist(), at.tolist(), (at + q - p).tolist(), [*heads.tolist(), len(p)], useful

    def task(c0: int, c1: int) -> Task:
        def run() -> None:
            bufs, starts, stops, heads, useful = pieces(c0, c1)
            scratch = memoryview(_scratch(chunk))
            views_of = [*flat, scratch]
            for c, h0, h1, got in zip(range(c0, c1), heads, heads[1:], useful):
                views = [
                    views_of[b][x:y] for b, x, y in zip(bufs[h0:h1], starts[h0:h1], stops[h0:h1])
                ]
                lo = c * chunk
                files.preadv(shard.file, views, shard.offset + lo, array)
                crc = 0
                for v in views:
                    crc = checksums.crc32(v, crc)
                if crc != shard.chunk_checksums[c]:
                    hi = min(lo + chunk, shard.length)
                    raise CheckpointError(
                        f"array {array!r}: data file {files.name(shard.file)}: checksum "
                        f"mismatch in bytes {shard.offset + lo}..{shard.offset + hi} (the "
                        "checkpoint is corrupt)"
                    )
                if progress is not None:
                    progress.advance(got)

        return run

    tasks = []
    for g in groups:  # runs of consecutive chunks, at most PIECE_BYTES each
        tasks.append(task(g[0], g[-1] + 1))
    return tasks


def _between(first: np.ndarray, last: np.ndarray) -> list[np.ndarray]:
    """The chunk indices strictly between each run's first and last chunk."""
    wide = np.nonzero(last - first > 1)[0]
    return [np.arange(first[i] + 1, last[i], dtype=np.int64) for i in wide.tolist()]
