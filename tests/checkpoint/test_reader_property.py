"""Property: reading any set of boxes from any tiling of stored blocks equals numpy slicing.

Uses tiny checksum chunks and slabs so chunk boundaries cut through every read, and
exercises the direct path, the scatter path (preadv straight into the destinations'
runs, with any shortest run) and the scratch-slab path of the reader.
"""

from __future__ import annotations

import itertools
import pathlib
import tempfile

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from fcir._proto import checkpoint_pb2 as pb
from fcir.checkpoint import checksums, parallel, reader


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
    slab = draw(st.sampled_from([8, 24, 1 << 20]))
    dtype = draw(st.sampled_from(["float32", "int8", "float64"]))
    min_run = draw(st.sampled_from([1, 8, 1 << 30]))  # scatter reads always, some, never
    return shape, stored, wanted, chunk, slab, dtype, min_run


@settings(max_examples=150, deadline=None)
@given(cases())
def test_any_boxes_from_any_tiling(case):
    shape, stored, wanted, chunk, slab, dtype, min_run = case
    full = (np.arange(int(np.prod(shape)), dtype=np.int64) * 7 + 3).astype(dtype).reshape(shape)
    with tempfile.TemporaryDirectory() as tmp:
        directory = pathlib.Path(tmp)
        layout = pb.CheckpointLayout(
            layout_version=1,
            checksum_algorithm=pb.CHECKSUM_ALGORITHM_CRC32,
            checksum_chunk_bytes=chunk,
        )
        record = pb.ArrayRecord(shape=shape, dtype=dtype)
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
        (directory / "d.bin").write_bytes(bytes(blob))
        layout.files.add(name="d.bin", size_bytes=len(blob))
        dests = [(box, np.full(tuple(b - a for a, b in zip(*box)), 99, dtype)) for box in wanted]
        old = reader.SLAB_BYTES, reader.SCATTER_MIN_RUN_BYTES
        reader.SLAB_BYTES, reader.SCATTER_MIN_RUN_BYTES = slab, min_run
        try:
            with reader.DataFiles(directory, layout) as files:
                parallel.run_tasks(reader.plan_array(files, record, "x", dests))
        finally:
            reader.SLAB_BYTES, reader.SCATTER_MIN_RUN_BYTES = old
        for (lo, hi), buf in dests:
            np.testing.assert_array_equal(buf, full[tuple(map(slice, lo, hi))])
