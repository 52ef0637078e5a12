"""Property: reading any set of boxes from any tiling of stored blocks equals numpy slicing.

Uses tiny checksum chunks, mappings and slabs so chunk and block boundaries cut through
every read, and exercises the direct path (a contiguous range straight into its
destination) and the block path (whole rows, from a mapping of a local file or from
scratch for an object store, copied into each destination), with rows too long for
the block budget taken one at a time along a later dimension. Every dtype size from 1
to 8 bytes, bfloat16 included.
"""

from __future__ import annotations

import itertools
import pathlib
import tempfile

import ml_dtypes
import numpy as np
import pytest
from fcir.checkpoint import checksums, parallel, reader
from hypothesis import given, settings
from hypothesis import strategies as st

from fcir._proto import checkpoint_pb2 as pb
from fcir.errors import CheckpointError

DTYPES = ["int8", "float16", "bfloat16", "float32", "uint32", "float64", "int64"]


class _MemoryStore:
    """An object store of one object, for ObjectDataFiles: ranged reads of a blob."""

    url = "memory://test"

    def __init__(self, blob: bytes) -> None:
        self.blob = blob

    def read(self, key: str, start: int, stop: int) -> bytes:
        return self.blob[start:stop]


@st.composite
def cases(draw):
    ndim = draw(st.integers(0, 3))
    shape = tuple(draw(st.integers(1, 7)) for _ in range(ndim))
    cuts = [
        sorted({0, size, *draw(st.lists(st.integers(1, max(1, size - 1)), max_size=2))})
        for size in shape
    ]
    stored = [
        (tuple(a for a, _ in box), tuple(b for _, b in box))
        for box in itertools.product(*[list(itertools.pairwise(c)) for c in cuts])
        if all(a < b for a, b in box)
    ]
    wanted = []
    for _ in range(draw(st.integers(1, 3))):
        lo = tuple(draw(st.integers(0, size - 1)) for size in shape)
        hi = tuple(draw(st.integers(lo_ + 1, size)) for lo_, size in zip(lo, shape))
        wanted.append((lo, hi))
    chunk = draw(st.sampled_from([4, 12, 16, 1 << 20]))
    block = draw(st.sampled_from([8, 24, 1 << 20]))
    dtype = draw(st.sampled_from(DTYPES))
    store = draw(st.sampled_from(["file", "object"]))
    return shape, stored, wanted, chunk, block, dtype, store


def _values(shape: tuple[int, ...], dtype: str) -> np.ndarray:
    """Values that differ from element to element (as far as the dtype allows) and from
    the 99 the destinations start with."""
    ints = np.arange(int(np.prod(shape)), dtype=np.int64) * 7 + 3
    if dtype in ("int8", "float16", "bfloat16"):
        ints = ints % 120 + 100
    return ints.astype(np.dtype(dtype) if dtype != "bfloat16" else ml_dtypes.bfloat16).reshape(
        shape
    )


def read_boxes(full, stored, wanted, chunk, block, store, flip=None):
    """Stores `full` as the `stored` blocks (at odd offsets), with the bit 0x10 of byte
    `flip` of the data file flipped after checksumming, and reads the `wanted` ones."""
    dtype = full.dtype
    with tempfile.TemporaryDirectory() as tmp:
        directory = pathlib.Path(tmp)
        layout = pb.CheckpointLayout(
            layout_version=1,
            checksum_algorithm=pb.CHECKSUM_ALGORITHM_CRC32,
            checksum_chunk_bytes=chunk,
        )
        record = pb.ArrayRecord(shape=full.shape, dtype=dtype.name)
        blob = bytearray()
        for lo, hi in stored:
            data = np.ascontiguousarray(full[tuple(map(slice, lo, hi))]).tobytes()
            record.shards.add(
                index=[pb.IndexRange(start=a, stop=b) for a, b in zip(lo, hi)],
                file=0,
                offset=len(blob) + 5,
                length=len(data),
                chunk_checksums=checksums.chunk_crcs(memoryview(data), chunk),
            )
            blob += b"\xee" * 5 + data
        if flip is not None:
            blob[flip] ^= 0x10
        (directory / "d.bin").write_bytes(bytes(blob))
        layout.files.add(name="d.bin", size_bytes=len(blob))
        dests = [(box, np.full(tuple(b - a for a, b in zip(*box)), 99, dtype)) for box in wanted]
        old = reader.SLAB_BYTES, reader.MAP_BYTES
        reader.SLAB_BYTES = reader.MAP_BYTES = block
        try:
            if store == "file":
                files = reader.DataFiles(directory, layout)
            else:
                files = reader.ObjectDataFiles(_MemoryStore(bytes(blob)), layout)
            with files:
                parallel.run_tasks(reader.plan_array(files, record, "x", dests))
        finally:
            reader.SLAB_BYTES, reader.MAP_BYTES = old
        return dests


@settings(max_examples=200, deadline=None)
@given(cases())
def test_any_boxes_from_any_tiling(case):
    shape, stored, wanted, chunk, block, dtype, store = case
    full = _values(shape, dtype)
    for (lo, hi), buf in read_boxes(full, stored, wanted, chunk, block, store):
        want = full[tuple(map(slice, lo, hi))]
        assert buf.shape == want.shape and buf.tobytes() == want.tobytes()


@pytest.mark.parametrize("store", ["file", "object"])
@pytest.mark.parametrize("block", [8, 1 << 20])  # 8: rows too long, taken one at a time
def test_every_flipped_byte_of_rows_split_between_destinations_is_caught(store, block):
    """Two destinations need parts of every row of two stored blocks (columns 2..5 and
    5..24 of a (4, 24) float32 stored as rows 0..2 and 2..4): a flipped byte anywhere
    in the blocks, needed by a destination or not (columns 0..2), is a checksum error;
    one in the bytes before each block is not read."""
    full = _values((4, 24), "float32")
    stored = [((0, 0), (2, 24)), ((2, 0), (4, 24))]
    wanted = [((0, 2), (4, 5)), ((0, 5), (4, 24))]
    n = 2 * 24 * 4  # bytes per stored block, each after 5 bytes of padding
    for flip in [*range(5, 5 + n), *range(10 + n, 10 + 2 * n)]:
        with pytest.raises(CheckpointError, match=r"'x'.*d\.bin.*checksum mismatch"):
            read_boxes(full, stored, wanted, 16, block, store, flip)
    for flip in [*range(5), *range(5 + n, 10 + n)]:
        for (lo, hi), buf in read_boxes(full, stored, wanted, 16, block, store, flip):
            assert buf.tobytes() == full[tuple(map(slice, lo, hi))].tobytes()
