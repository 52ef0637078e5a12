"""Reads the parts of stored shards that a set of destination blocks needs, verified.

Reads go straight into the destination buffers when the needed part of a stored
shard is one contiguous byte range that lands contiguously in a destination (the same
sharding, or any resharding along the leading dimension) and is the whole shard or at
least a checksum chunk long (a shorter one would read its whole chunk again for the
checksum, once for every destination that shares the chunk). A split along another
dimension cuts a stored shard into runs (e.g. half rows) that land in several
destinations: such a shard, like one cut into short contiguous runs, is read a block
of whole rows at a time, and each block, once verified, is copied into every
destination that needs part of it with one numpy copy per destination and checksum
chunk, so the per-run work is numpy's, never a Python loop's. From local files the block is a read-only mapping of the data file
(whose pages are the page cache's: no byte is copied twice); from object stores it is
read into a scratch buffer.

Checksums cover fixed-size chunks of each stored shard; a partial read also reads the
rest of the chunks it touches, so every byte handed back has been verified.
"""

from __future__ import annotations

import errno
import itertools
import math
import mmap
import os
import pathlib
import sys
import threading
from collections.abc import Callable, Iterable
from typing import Self

import numpy as np
from fcir.checkpoint import checksums, shardings
from fcir.checkpoint.layout import dtype_from_name
from fcir.checkpoint.progress_bar import Progress
from fcir.checkpoint.shardings import Box
from fcir.checkpoint.storage import ObjectStore

from fcir._proto import checkpoint_pb2 as pb
from fcir.errors import CheckpointError

#: Largest single read straight into a destination.
PIECE_BYTES = 16 * checksums.CHUNK_BYTES
#: Bytes of a stored shard read into scratch at a time when only parts of its rows are
#: needed, from object stores: small enough to stay in cache while the slab is
#: checksummed and copied out.
SLAB_BYTES = 2 * checksums.CHUNK_BYTES
#: Bytes of a stored shard mapped at a time when only parts of its rows are needed,
#: from local files. Mapped pages count as resident memory while they are mapped, so
#: a restore's peak is its arrays plus THREADS such blocks. Measured (2
#: cores, load 2-10, warm page cache; 4 f32 leaves saved as 8 row blocks, restored
#: onto another sharding; process CPU time relative to the same restore onto the saved
#: sharding, medians of 11-15 side by side): 8 KiB half rows 1.05-1.10 and 2 KiB
#: columns 1.15-1.23 from mappings, against 1.27-1.32 and 1.26-1.45 by the scratch
#: slab (a pread, then a copy) they replaced; 16-64 KiB half rows 1.02-1.13, against
#: 1.12-1.32 by a preadv straight into the destinations' runs (a buffer and a CRC call
#: per run), which they replaced too. Blocks of 1 MiB cost 1.39, of 4 MiB 1.12-1.18.
MAP_BYTES = 8 * checksums.CHUNK_BYTES

#: On CPU, a target block at least this large that is one contiguous run of one stored
#: shard is not read but mapped: the restored array's memory is a copy-on-write mapping
#: of the data file (see plan_mapped). Below it, a copy costs little and leaves no
#: mapping of the whole file alive for a small array.
MAP_ARRAY_BYTES = 1 << 20

Task = Callable[[], None]


#: Destination buffers at least this large start at a multiple of it: numpy asks the
#: kernel for huge pages on large buffers, and only the 2 MiB-aligned parts get them.
#: At a 64-byte boundary a quarter of each 8 MiB block faulted in 4 KiB at a time
#: (16,400 faults per 256 MiB restored); aligned, it takes 32 faults, and touching
#: 256 MiB of fresh blocks cost 23 ms of CPU time instead of 80 (670 against 181 ms on
#: this VM's first touch of memory).
HUGE_PAGE_BYTES = 2 << 20


def aligned_empty(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """An uninitialized C-contiguous array at a 64-byte aligned address (2 MiB aligned
    from HUGE_PAGE_BYTES up).

    On CPU, jax.device_put adopts such a buffer without copying it.
    """
    nbytes = math.prod(shape) * dtype.itemsize
    align = HUGE_PAGE_BYTES if nbytes >= HUGE_PAGE_BYTES else 64
    raw = np.empty(nbytes + align, np.uint8)
    start = (-raw.ctypes.data) % align
    return raw[start : start + nbytes].view(dtype).reshape(shape)


class DataFiles:
    """The open data files of one checkpoint, opened on first use and checked for size."""

    def __init__(self, directory: pathlib.Path, layout: pb.CheckpointLayout) -> None:
        self.directory = directory
        self.layout = layout
        self._fds: dict[int, int] = {}
        self._maps: dict[int, mmap.mmap] = {}
        self._private: dict[int, mmap.mmap | None] = {}
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

    def mapping(self, index: int, array: str) -> mmap.mmap:
        """A read-only mapping of all of data file `index`, made on first use: one per
        restore, since each mmap and munmap takes the process's memory-map lock, which
        the page faults of every other reading thread wait for."""
        fd = self.fd(index, array)
        with self._lock:
            if index not in self._maps:
                try:
                    self._maps[index] = mmap.mmap(fd, 0, mmap.MAP_SHARED, mmap.PROT_READ)
                except (OSError, ValueError) as e:
                    raise CheckpointError(
                        f"array {array!r}: cannot map data file {self.name(index)}: {e}"
                    ) from e
            return self._maps[index]

    def private_mapping(self, index: int, array: str) -> mmap.mmap | None:
        """A copy-on-write mapping (MAP_PRIVATE) of all of data file `index`, made on
        first use, whose pages restored arrays on CPU keep as their memory: until
        written, they are the page cache's own. Never closed here: it is unmapped when
        the last array made from it goes. None where the file system cannot map the
        file (then its blocks are read)."""
        fd = self.fd(index, array)
        with self._lock:
            if index not in self._private:
                try:
                    self._private[index] = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)
                except (OSError, ValueError):
                    self._private[index] = None
            return self._private[index]

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

    def close(self) -> None:
        with self._lock:
            for m in self._maps.values():
                try:
                    m.close()
                except BufferError:  # a raised error's traceback still holds a view of
                    pass  # it: it unmaps when that goes
            self._maps.clear()
            self._private.clear()  # the arrays made from them keep them
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
                raise _corrupt(where(), shard, c, chunk_bytes)
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
            raise _corrupt(where(), shard, c, chunk_bytes)


def _corrupt(where: str, shard: pb.ShardRecord, c: int, chunk_bytes: int) -> CheckpointError:
    """The error for checksum chunk `c` of a stored shard whose bytes do not match."""
    lo, hi = c * chunk_bytes, min((c + 1) * chunk_bytes, shard.length)
    return CheckpointError(
        f"{where}: checksum mismatch in bytes {shard.offset + lo}..{shard.offset + hi} "
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
        for d, (dbox, buf) in enumerate(dests):
            inter = shardings.intersect(sbox, dbox)
            if inter is None:
                continue
            covered[d] += shardings.volume(inter)
            in_shard = shardings.shift(inter, sbox[0])
            view = buf[shardings.to_slices(shardings.shift(inter, dbox[0]))]
            if (
                _is_contiguous(sshape, in_shard)
                and view.flags.c_contiguous
                and (view.nbytes >= chunk or view.nbytes == shard.length)
            ):
                start = _linear(sshape, in_shard[0]) * itemsize
                tasks += _direct_tasks(files, shard, chunk, start, view, array, progress)
            else:  # with the other runs of its rows: one read of the chunks they share
                scattered.append((in_shard, view))
        if scattered:
            tasks += _block_tasks(files, shard, chunk, sshape, itemsize, scattered, array, progress)
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


def plan_mapped(
    files: DataFiles | ObjectDataFiles,
    record: pb.ArrayRecord,
    array: str,
    box: Box,
    progress: Progress | None = None,
) -> tuple[np.ndarray, list[Task]] | None:
    """For a target block on CPU that is one contiguous run of one stored shard of a
    local file (MAP_ARRAY_BYTES or more, at a 64-byte aligned file offset): the block
    as an array over a copy-on-write mapping of the data file, and the tasks that
    populate and verify its pages. None where the block must be read instead.

    jax adopts such an array without a copy, so the restored array's memory is the page
    cache's pages: no fresh memory is faulted in and no byte is copied. Fresh memory
    was most of a process's first restore on this project's VMs: 0.4-0.6 s of system
    time per 256 MiB the first time a process touched it (1.7-2.3 s in all, loaded),
    against 0.16-0.33 s for later restores that reused the pages freed before. Pages
    that jax or the caller write (a donated buffer) are copied then, privately; the
    file never changes.
    """
    if not isinstance(files, DataFiles):
        return None
    dtype = dtype_from_name(record.dtype)
    nbytes = shardings.volume(box) * dtype.itemsize
    if nbytes < MAP_ARRAY_BYTES:
        return None
    for shard in record.shards:
        sbox = (tuple(r.start for r in shard.index), tuple(r.stop for r in shard.index))
        inter = shardings.intersect(sbox, box)
        if inter is None:
            continue
        sshape = shardings.box_shape(sbox)
        in_shard = shardings.shift(box, sbox[0])
        if inter != box or not _is_contiguous(sshape, in_shard):
            return None  # parts of several stored shards, or runs of one
        start = _linear(sshape, in_shard[0]) * dtype.itemsize
        if (shard.offset + start) % 64:
            return None
        m = files.private_mapping(shard.file, array)
        if m is None:
            return None
        if shard.offset + shard.length > len(m):
            raise CheckpointError(
                f"array {array!r}: data file {files.name(shard.file)} is truncated: it has "
                f"{len(m)} bytes, the layout says at least {shard.offset + shard.length}"
            )
        view = np.frombuffer(m, dtype, nbytes // dtype.itemsize, shard.offset + start)
        return view.reshape(shardings.box_shape(box)), _verify_tasks(
            files,
            m,
            shard,
            files.layout.checksum_chunk_bytes,
            start,
            start + nbytes,
            array,
            progress,
        )
    return None


def _verify_tasks(
    files: DataFiles,
    m: mmap.mmap,
    shard: pb.ShardRecord,
    chunk: int,
    start: int,
    stop: int,
    array: str,
    progress: Progress | None,
) -> list[Task]:
    """Tasks that populate and verify bytes [start, stop) of a stored shard in the
    private mapping `m`, PIECE_BYTES at a time (so that threads share the work)."""
    cuts = [start, *range((start // PIECE_BYTES + 1) * PIECE_BYTES, stop, PIECE_BYTES), stop]

    def task(a: int, b: int) -> Task:
        def run() -> None:
            _in_mapping(files, m, False, shard, chunk, a, b, array, lambda _, verify: verify(b))
            if progress is not None:
                progress.advance(b - a)

        return run

    return [task(a, b) for a, b in itertools.pairwise(cuts) if b > a]


def _block_tasks(
    files: DataFiles | ObjectDataFiles,
    shard: pb.ShardRecord,
    chunk: int,
    sshape: tuple[int, ...],
    itemsize: int,
    scattered: list[tuple[Box, np.ndarray]],
    array: str,
    progress: Progress | None,
) -> list[Task]:
    """Tasks that each take a block of whole rows of a stored shard (along some dimension
    k, below fixed indices of the dimensions before it), verified, and copy into every
    destination its part of those rows with one numpy copy per destination and checksum
    chunk: the per-run work is numpy's, not Python's.

    From local files the block is a read-only mapping of the data file's page cache
    (MAP_BYTES at most), so no byte is copied twice; from object stores it is read
    into scratch (SLAB_BYTES at most) by read_range. Rows are taken along the first
    dimension whose rows fit in that budget, so the budget holds for any shape.
    """
    local = isinstance(files, DataFiles)
    budget = MAP_BYTES if local else SLAB_BYTES
    dtype = scattered[0][1].dtype
    ndim = len(sshape)
    strides = [itemsize * math.prod(sshape[j + 1 :]) for j in range(ndim)]
    tasks: list[Task] = []

    def task(k: int, base: int, r0: int, r1: int, parts: list[_Part]) -> Task:
        row = strides[k]
        shape = (r1 - r0, *sshape[k + 1 :])
        start, stop = base + r0 * row, base + r1 * row
        step = max(1, chunk // row)  # rows copied out while their chunk is in the cache
        # Each part's rows along k, its index in the later dimensions (made once here,
        # not per chunk: with 8 destinations a chunk, the Python per copy was ~2 us of
        # the ~16 us a 1 MiB chunk's copies took), and its view.
        cuts = [(lo[0], hi[0], tuple(map(slice, lo[1:], hi[1:])), view) for lo, hi, view in parts]
        nbytes = sum(
            (min(hi, r1) - max(lo, r0)) * (view.nbytes // max(1, hi - lo))
            for lo, hi, _, view in cuts
        )

        def fill(block: np.ndarray, verify: Callable[[int], None]) -> None:
            rows = block.view(dtype).reshape(shape)
            for a in range(r0, r1, step):
                b = a + step if a + step < r1 else r1
                verify(base + b * row)
                for lo, hi, rest, view in cuts:
                    x = lo if lo > a else a
                    y = hi if hi < b else b
                    if x < y:
                        view[x - lo : y - lo] = rows[(slice(x - r0, y - r0), *rest)]
            if progress is not None:
                progress.advance(nbytes)

        def run() -> None:
            if local:
                _with_mapping(files, shard, chunk, start, stop, array, fill)
            else:
                block = _scratch(stop - start)
                read_range(files, shard, chunk, start, stop, memoryview(block), array)
                fill(block, lambda _: None)

        return run

    def plan(k: int, base: int, parts: list[_Part]) -> None:
        """Plans rows of dimension k at byte `base` of the shard; each part is a
        destination's box over dimensions k.. and its view, indexed down to them."""
        for lo, hi in _merged((p[0][0], p[1][0]) for p in parts):
            if strides[k] > budget and k + 1 < ndim:  # rows too long: one at a time
                for i in range(lo, hi):
                    sub = [(a[1:], b[1:], v[i - a[0]]) for a, b, v in parts if a[0] <= i < b[0]]
                    plan(k + 1, base + i * strides[k], sub)
                continue
            per = max(1, budget // strides[k])
            for r in range(lo, hi, per):
                r1 = min(r + per, hi)
                tasks.append(
                    task(k, base, r, r1, [p for p in parts if p[0][0] < r1 and r < p[1][0]])
                )

    plan(0, 0, [(lo, hi, view) for (lo, hi), view in scattered])
    return tasks


_Part = tuple[tuple[int, ...], tuple[int, ...], np.ndarray]


def _merged(ranges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """The union of half-open ranges, as sorted disjoint ranges."""
    out: list[list[int]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1]:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return [(lo, hi) for lo, hi in out]


#: madvise(2) advice that reads a range's pages into a mapping in one call (Linux 5.14+),
#: instead of a page fault per 64 KiB when they are first used.
_POPULATE = 22 if sys.platform == "linux" else None  # MADV_POPULATE_READ


def _advise(m: mmap.mmap, advice: int | None, start: int, length: int) -> OSError | None:
    """madvise(2); the error, when the kernel could not do what it was asked for a
    reason other than not knowing the advice (an older kernel: pages then fault in when
    they are used)."""
    if advice is not None and hasattr(m, "madvise"):
        try:
            m.madvise(advice, start, length)
        except OSError as e:
            return None if e.errno == errno.EINVAL else e
    return None


def _with_mapping(
    files: DataFiles,
    shard: pb.ShardRecord,
    chunk: int,
    start: int,
    stop: int,
    array: str,
    fill: Callable[[np.ndarray, Callable[[int], None]], None],
) -> None:
    """Calls fill(block, verify) on bytes [start, stop) of a stored shard in the
    mapping of its data file; verify(end) checks every checksum chunk up to byte `end`
    (whole: the chunks' bytes outside the range are mapped too) before fill uses them.
    The block's pages are then dropped from the mapping (MADV_DONTNEED; they stay in
    the page cache), so mapped pages never add up to more than the blocks in flight."""
    m = files.mapping(shard.file, array)
    _in_mapping(files, m, True, shard, chunk, start, stop, array, fill)


def _in_mapping(
    files: DataFiles,
    m: mmap.mmap,
    drop: bool,
    shard: pb.ShardRecord,
    chunk: int,
    start: int,
    stop: int,
    array: str,
    fill: Callable[[np.ndarray, Callable[[int], None]], None],
) -> None:
    """_with_mapping's work in mapping `m`; the pages are dropped afterwards if `drop`."""
    lo = start // chunk * chunk
    hi = min(-(-stop // chunk) * chunk, shard.length)
    at, end = shard.offset + lo, shard.offset + hi
    if end > len(m):
        raise CheckpointError(
            f"array {array!r}: data file {files.name(shard.file)} is truncated: it has "
            f"{len(m)} bytes, the layout says at least {end}"
        )
    page = at - at % mmap.PAGESIZE
    # Populating reports an I/O error, or a file cut short since it was mapped, as an
    # error here; touching such pages later would kill the process with SIGBUS.
    failed = _advise(m, _POPULATE, page, end - page)
    if failed is not None:
        raise CheckpointError(
            f"array {array!r}: cannot read data file {files.name(shard.file)} bytes "
            f"{at}..{end}: {failed}"
        )
    try:
        _fill_mapped(m, at, lo, start, stop, shard, chunk, files.name(shard.file), array, fill)
    finally:
        if drop:
            _advise(m, mmap.MADV_DONTNEED, page, end - page)


def _fill_mapped(
    m: mmap.mmap,
    at: int,
    lo: int,
    start: int,
    stop: int,
    shard: pb.ShardRecord,
    chunk: int,
    name: str,
    array: str,
    fill: Callable[[np.ndarray, Callable[[int], None]], None],
) -> None:
    data = memoryview(m)[at:]
    checked = lo // chunk  # the next chunk to verify

    def verify(end: int) -> None:
        nonlocal checked
        while checked * chunk < end:
            a, b = checked * chunk, min((checked + 1) * chunk, shard.length)
            if checksums.crc32(data[a - lo : b - lo]) != shard.chunk_checksums[checked]:
                raise _corrupt(f"array {array!r}: data file {name}", shard, checked, chunk)
            checked += 1

    try:
        fill(np.frombuffer(data, np.uint8, stop - start, start - lo), verify)
    finally:
        try:
            data.release()
        except BufferError:  # as in DataFiles.close
            pass
