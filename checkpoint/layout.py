"""The checkpoint's layout file: writing, reading, verifying and validating it."""

from __future__ import annotations

import os
import pathlib
import zlib

import jax.numpy as jnp
import numpy as np
from fcir.checkpoint import checksums, keypaths, shardings, storage
from google.protobuf.message import DecodeError

from fcir._proto import checkpoint_pb2 as pb
from fcir.errors import CheckpointError

LAYOUT_VERSION = 1
#: Present in a checkpoint directory exactly when the checkpoint is committed.
LAYOUT_FILE = "layout.pb"


def dtype_name(dtype: np.dtype) -> str:
    return np.dtype(dtype).name


def dtype_from_name(name: str) -> np.dtype:
    try:
        return np.dtype(jnp.dtype(name))
    except TypeError as e:
        raise CheckpointError(f"layout names an unknown dtype {name!r}") from e


def data_file_name(process_index: int) -> str:
    return f"data-p{process_index:05d}.bin"


def part_file_name(process_index: int) -> str:
    """The shard records one process hands to the committing process (removed at commit)."""
    return f"layout.part-p{process_index:05d}.pb"


def encode(layout: pb.CheckpointLayout) -> bytes:
    payload = layout.SerializeToString(deterministic=True)
    return pb.CheckpointLayoutFile(
        layout=payload, layout_crc32=zlib.crc32(payload)
    ).SerializeToString()


def decode(data: bytes, where: str) -> pb.CheckpointLayout:
    envelope = pb.CheckpointLayoutFile()
    try:
        envelope.ParseFromString(data)
    except DecodeError as e:
        raise CheckpointError(f"{where}: layout file is corrupt ({e})") from e
    if zlib.crc32(envelope.layout) != envelope.layout_crc32:
        raise CheckpointError(f"{where}: layout file is corrupt (checksum mismatch)")
    layout = pb.CheckpointLayout()
    try:
        layout.ParseFromString(envelope.layout)
    except DecodeError as e:
        raise CheckpointError(f"{where}: layout file is corrupt ({e})") from e
    if layout.layout_version > LAYOUT_VERSION:
        raise CheckpointError(
            f"{where}: layout version {layout.layout_version} is newer than this fcir "
            f"reads ({LAYOUT_VERSION}); upgrade fcir"
        )
    if layout.layout_version < 1:
        raise CheckpointError(f"{where}: layout has no valid layout_version")
    return layout


def write_file(path: pathlib.Path, data: bytes) -> None:
    """Creates `path` (it must not exist) holding `data`, and fsyncs it."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def read_layout(path: str | os.PathLike[str] | storage.ObjectStore) -> pb.CheckpointLayout:
    """The `fcir.v1.CheckpointLayout` of the committed checkpoint at `path`.

    `path` is a local directory or a URL (s3://, gs://, file://). Raises CheckpointError
    when it is not a committed checkpoint, or its layout is damaged, inconsistent or
    from a newer format version.
    """
    directory = storage.locate(path)
    if isinstance(directory, storage.ObjectStore):
        data = directory.read(LAYOUT_FILE)
        if data is None:
            raise CheckpointError(f"{directory} is not a committed checkpoint (no {LAYOUT_FILE})")
    else:
        data = _read_local(directory)
    layout = decode(data, str(directory))
    validate(layout, str(directory))
    return layout


def _read_local(directory: pathlib.Path) -> bytes:
    file = directory / LAYOUT_FILE
    try:
        return file.read_bytes()
    except FileNotFoundError:
        if not directory.exists():
            raise CheckpointError(f"no checkpoint at {directory}: it does not exist") from None
        raise CheckpointError(
            f"{directory} is not a committed checkpoint (no {LAYOUT_FILE})"
        ) from None
    except OSError as e:
        raise CheckpointError(f"cannot read {file}: {e.strerror or e}") from e


def validate(layout: pb.CheckpointLayout, where: str) -> None:
    """Checks the layout's internal consistency; raises CheckpointError naming the array."""
    if layout.checksum_algorithm != pb.CHECKSUM_ALGORITHM_CRC32:
        raise CheckpointError(f"{where}: unsupported checksum algorithm")
    if layout.checksum_chunk_bytes <= 0:
        raise CheckpointError(f"{where}: checksum_chunk_bytes must be positive")
    names = set()
    for f in layout.files:
        # A plain name, or a relative path of plain names (Orbax-format chunk files).
        parts = f.name.split("/")
        if "\\" in f.name or any(not p or p in (".", "..") for p in parts):
            raise CheckpointError(f"{where}: invalid data file name {f.name!r}")
    seen_items = set()
    for item in layout.items:
        if item.name in seen_items:
            raise CheckpointError(f"{where}: item {item.name!r} appears twice")
        seen_items.add(item.name)
        if item.WhichOneof("value") is None:
            raise CheckpointError(f"{where}: item {item.name!r} has neither arrays nor json")
        names.clear()
        for record in item.arrays.arrays:
            key = keypaths.match_key(keypaths.from_proto(record.path))
            name = keypaths.display(item.name, key)
            if key in names:
                raise CheckpointError(f"{where}: array {name!r} appears twice")
            names.add(key)
            validate_array(layout, record, f"{where}: array {name!r}")


def validate_array(layout: pb.CheckpointLayout, record: pb.ArrayRecord, where: str) -> None:
    shape = tuple(record.shape)
    if any(d < 0 for d in shape):
        raise CheckpointError(f"{where}: negative dimension in shape {shape}")
    itemsize = dtype_from_name(record.dtype).itemsize
    total = 0
    for shard in record.shards:
        if len(shard.index) != len(shape):
            raise CheckpointError(f"{where}: a shard's index has the wrong rank")
        box = (tuple(r.start for r in shard.index), tuple(r.stop for r in shard.index))
        if any(not 0 <= a <= b <= d for a, b, d in zip(*box, shape)):
            raise CheckpointError(f"{where}: a shard's index {box} lies outside shape {shape}")
        vol = shardings.volume(box)
        if shard.length != vol * itemsize:
            raise CheckpointError(f"{where}: a shard's byte length does not match its index")
        if shard.file >= len(layout.files):
            raise CheckpointError(f"{where}: a shard names a data file that is not listed")
        if shard.offset + shard.length > layout.files[shard.file].size_bytes:
            raise CheckpointError(f"{where}: a shard lies beyond the end of its data file")
        if len(shard.chunk_checksums) != checksums.chunk_count(
            shard.length, layout.checksum_chunk_bytes
        ):
            raise CheckpointError(f"{where}: a shard has the wrong number of checksums")
        total += vol
    if total != int(np.prod(shape, dtype=np.int64)):
        raise CheckpointError(
            f"{where}: its shards cover {total} of {int(np.prod(shape))} elements"
        )
    check_tiling(
        shape,
        [(tuple(r.start for r in s.index), tuple(r.stop for r in s.index)) for s in record.shards],
        where,
    )


#: Most cells `check_tiling` counts in a grid before it checks pairs of shards instead.
_MAX_GRID_CELLS = 1 << 22


def check_tiling(shape: tuple[int, ...], boxes: list[shardings.Box], where: str) -> None:
    """Raises unless `boxes` (inside `shape`) tile it exactly: disjoint, union the whole.

    Equal volumes alone are not enough: two shards claiming the same rows leave others
    uncovered, and restore would hand back whatever memory held. The boxes' start and
    stop coordinates cut every dimension into intervals; each box covers a block of the
    resulting grid of cells, and the tiling is exact when every cell is covered once.
    Shards of a jax sharding form such a grid with one cell per shard, so this costs
    O(shards); layouts whose cuts make a much larger grid are checked pair by pair
    along a sweep of the first dimension instead.
    """
    if not shape:
        if len(boxes) != 1:
            raise CheckpointError(f"{where}: a scalar has {len(boxes)} shards, not 1")
        return
    cuts = [
        np.unique([0, d, *(b[0][k] for b in boxes), *(b[1][k] for b in boxes)])
        for k, d in enumerate(shape)
    ]
    cells = 1
    for c in cuts:
        cells *= max(len(c) - 1, 0)
    if cells == 0:
        return  # an empty array: every box is empty
    if cells <= _MAX_GRID_CELLS:
        counts = np.zeros(tuple(len(c) - 1 for c in cuts), np.int32)
        starts = np.array([b[0] for b in boxes], np.int64).reshape(len(boxes), len(shape))
        stops = np.array([b[1] for b in boxes], np.int64).reshape(len(boxes), len(shape))
        first = np.stack([np.searchsorted(c, starts[:, k]) for k, c in enumerate(cuts)], 1)
        last = np.stack([np.searchsorted(c, stops[:, k]) for k, c in enumerate(cuts)], 1)
        single = (last - first == 1).all(axis=1)
        # A box of one cell (every box of a jax sharding's grid) is counted in one go.
        np.add.at(counts, tuple(first[single].T), 1)
        for i in np.flatnonzero(~single):
            counts[tuple(slice(a, b) for a, b in zip(first[i], last[i]))] += 1
        if counts.max() > 1:
            cell = np.unravel_index(int(np.argmax(counts)), counts.shape)
            raise CheckpointError(
                f"{where}: shards overlap at index {tuple(int(c[i]) for c, i in zip(cuts, cell))}"
                " (the layout is inconsistent)"
            )
        if counts.min() < 1:
            cell = np.unravel_index(int(np.argmin(counts)), counts.shape)
            raise CheckpointError(
                f"{where}: no shard holds index {tuple(int(c[i]) for c, i in zip(cuts, cell))}"
                " (the layout is inconsistent)"
            )
        return
    # Irregular layouts (not written by fcir): with the volumes already equal to the
    # whole, the boxes tile it exactly when no two of them overlap.
    order = sorted(range(len(boxes)), key=lambda i: boxes[i][0][0])
    active: list[int] = []
    for i in order:
        lo, hi = boxes[i]
        if lo[0] >= hi[0]:
            continue
        active = [j for j in active if boxes[j][1][0] > lo[0]]
        for j in active:
            if shardings.intersect(boxes[i], boxes[j]) is not None:
                raise CheckpointError(
                    f"{where}: shards overlap at index {shardings.intersect(boxes[i], boxes[j])[0]}"
                    " (the layout is inconsistent)"
                )
        active.append(i)


def array_bytes(record: pb.ArrayRecord) -> int:
    return sum(s.length for s in record.shards)
