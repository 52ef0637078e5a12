"""Damaged checkpoints are CheckpointErrors naming the array and file, never wrong numbers."""

from __future__ import annotations

import errno

import jax
import numpy as np
import pytest
from ckpt_testing import same_bits, values
from fcir.checkpoint import layout as layout_module
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from fcir import checkpoint
from fcir._proto import checkpoint_pb2 as pb
from fcir.errors import CheckpointError


@pytest.fixture
def saved(tmp_path, devices):
    """A checkpoint with a 3 MiB vector stored as one block (three checksum chunks)."""
    mesh = jax.make_mesh((8,), ("x",), devices=devices)
    vec = values((3 * 2**18,), seed=1)
    other = values((8, 8), seed=2)
    checkpoint.save(
        tmp_path / "c",
        {"params": {"vec": jax.device_put(vec, NamedSharding(mesh, P())), "other": other}},
    )
    lay = checkpoint.read_layout(tmp_path / "c")
    (shard,) = next(a for a in lay.items[0].arrays.arrays if a.path[0].name == "vec").shards
    data = tmp_path / "c" / lay.files[shard.file].name
    return tmp_path / "c", data, shard, vec, other, mesh


def flip(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))


def sharded_target(mesh, vec):
    spec = jax.ShapeDtypeStruct(vec.shape, vec.dtype, sharding=NamedSharding(mesh, P("x")))
    return {"params": {"vec": spec}}


@pytest.mark.parametrize("where", [0, 100, 2**20 - 1, 2**20, 3 * 2**20 - 1])
@pytest.mark.parametrize("onto", ["host", "sharded"])
def test_a_flipped_byte_is_an_error_naming_array_and_file(saved, where, onto):
    path, data, shard, vec, _, mesh = saved
    flip(data, shard.offset + where)
    target = None if onto == "host" else sharded_target(mesh, vec)
    with pytest.raises(CheckpointError, match=rf"'params/vec'.*{data.name}.*checksum mismatch"):
        checkpoint.restore(path, target)


def test_a_flipped_byte_in_another_array_does_not_stop_a_partial_restore(saved):
    path, data, shard, _, other, _ = saved
    flip(data, shard.offset + 5)
    out = checkpoint.restore(path, {"params": {"other": np.zeros((8, 8), np.float32)}})
    assert same_bits(out["params"]["other"], other)


def test_a_flipped_byte_in_a_chunk_shared_with_the_wanted_range_is_still_caught(saved, devices):
    """The target block [0, 384 KiB) shares its checksum chunk with bytes it does not need."""
    path, data, shard, vec, _, _ = saved
    flip(data, shard.offset + 2**20 - 8)  # in chunk 0, outside device 0's block
    mesh = jax.make_mesh((8,), ("x",), devices=devices)
    spec = jax.ShapeDtypeStruct(vec.shape, vec.dtype, sharding=NamedSharding(mesh, P("x")))
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        checkpoint.restore(path, {"params": {"vec": spec}})


def test_a_truncated_data_file_is_an_error_naming_array_and_file(saved):
    path, data, shard, *_ = saved
    with open(data, "r+b") as f:
        f.truncate(shard.offset + 2**20)
    with pytest.raises(CheckpointError, match=rf"'params/.*'.*{data.name} is truncated"):
        checkpoint.restore(path)


def test_a_missing_data_file_is_an_error_naming_array_and_file(saved):
    path, data, *_ = saved
    data.unlink()
    with pytest.raises(CheckpointError, match=rf"'params/.*': cannot open data file .*{data.name}"):
        checkpoint.restore(path)


def test_a_damaged_layout_is_detected(saved):
    path = saved[0]
    flip(path / "layout.pb", 40)
    with pytest.raises(CheckpointError, match="layout file is corrupt"):
        checkpoint.restore(path)


def test_a_layout_from_a_newer_format_is_refused(saved):
    path = saved[0]
    lay = checkpoint.read_layout(path)
    lay.layout_version = 2
    (path / "layout.pb").write_bytes(layout_module.encode(lay))
    with pytest.raises(CheckpointError, match="layout version 2 is newer"):
        checkpoint.read_layout(path)


def test_an_inconsistent_layout_is_refused(saved):
    path = saved[0]
    lay = checkpoint.read_layout(path)
    lay.items[0].arrays.arrays[0].shards[0].length += 4
    (path / "layout.pb").write_bytes(layout_module.encode(lay))
    with pytest.raises(CheckpointError, match="byte length does not match its index"):
        checkpoint.read_layout(path)


def test_a_layout_with_missing_shards_is_refused(saved):
    path = saved[0]
    lay = checkpoint.read_layout(path)
    record: pb.ArrayRecord = next(
        a for a in lay.items[0].arrays.arrays if a.path[0].name == "other"
    )
    del record.shards[:]
    (path / "layout.pb").write_bytes(layout_module.encode(lay))
    with pytest.raises(CheckpointError, match="'params/other'.*cover 0 of 64 elements"):
        checkpoint.read_layout(path)


def _rows_saved(tmp_path, devices):
    mesh = jax.make_mesh((8,), ("x",), devices=devices)
    rows = values((16, 4), seed=3)
    checkpoint.save(
        tmp_path / "r", {"params": {"w": jax.device_put(rows, NamedSharding(mesh, P("x")))}}
    )
    return tmp_path / "r", rows


def _edit_shard_index(path, shard, starts, stops):
    lay = checkpoint.read_layout(path)
    record = lay.items[0].arrays.arrays[0]
    del record.shards[shard].index[:]
    record.shards[shard].index.extend(pb.IndexRange(start=a, stop=b) for a, b in zip(starts, stops))
    (path / "layout.pb").write_bytes(layout_module.encode(lay))  # layout checksum recomputed


@pytest.mark.parametrize("onto", ["host", "sharded"])
def test_a_layout_whose_shard_claims_another_shards_rows_is_refused(tmp_path, devices, onto):
    """The same volume as the array, but rows 2-3 are held twice and rows 0-1 by none."""
    path, rows = _rows_saved(tmp_path, devices)
    _edit_shard_index(path, 1, (0, 0), (2, 4))  # shard 1 says it holds shard 0's rows
    mesh = jax.make_mesh((8,), ("x",), devices=devices)
    target = None
    if onto == "sharded":
        sds = jax.ShapeDtypeStruct(rows.shape, rows.dtype, sharding=NamedSharding(mesh, P("x")))
        target = {"params": {"w": sds}}
    with pytest.raises(CheckpointError, match=r"'params/w'.*shards overlap at index \(0, 0\)"):
        checkpoint.restore(path, target)


def test_a_layout_with_a_gap_and_an_overlap_across_columns_is_refused(tmp_path, devices):
    """Shard 1 keeps its volume but moves a column over: an overlap with shard 0's block."""
    path, _ = _rows_saved(tmp_path, devices)
    _edit_shard_index(path, 1, (1, 0), (3, 4))
    with pytest.raises(CheckpointError, match=r"'params/w'.*shards overlap"):
        checkpoint.read_layout(path)


def test_exact_tiling_check_names_the_uncovered_index():
    boxes = [((0, 0), (2, 4)), ((2, 0), (4, 2)), ((2, 2), (4, 4)), ((2, 0), (4, 2))]
    with pytest.raises(CheckpointError, match=r"arr: shards overlap at index \(2, 0\)"):
        layout_module.check_tiling((4, 4), boxes, "arr")
    gap = [((0, 0), (2, 4)), ((2, 0), (4, 2))]
    with pytest.raises(CheckpointError, match=r"arr: no shard holds index \(2, 2\)"):
        layout_module.check_tiling((4, 4), gap, "arr")
    layout_module.check_tiling((4, 4), boxes[:3], "arr")  # an exact tiling passes


def test_exact_tiling_check_is_linear_for_many_grid_shards():
    """65,536 shards of a 256x256 grid: checked in well under a second, not pairwise."""
    import time

    boxes = [((i, j), (i + 1, j + 1)) for i in range(256) for j in range(256)]
    started = time.perf_counter()
    layout_module.check_tiling((256, 256), boxes, "arr")
    assert time.perf_counter() - started < 5.0
    boxes[-1] = ((255, 254), (256, 255))
    with pytest.raises(CheckpointError, match=r"overlap at index \(255, 254\)"):
        layout_module.check_tiling((256, 256), boxes, "arr")


def test_irregular_tilings_are_checked_pair_by_pair(monkeypatch):
    monkeypatch.setattr(layout_module, "_MAX_GRID_CELLS", 0)
    staggered = [((0, 0), (1, 3)), ((1, 0), (2, 1)), ((1, 1), (2, 3)), ((2, 0), (3, 2))]
    with pytest.raises(CheckpointError, match=r"overlap at index \(1, 1\)"):
        layout_module.check_tiling((3, 3), [*staggered[:3], ((1, 1), (2, 2))], "arr")
    layout_module.check_tiling((3, 3), [*staggered[:3], ((2, 0), (3, 3))], "arr")


@pytest.mark.parametrize("where", [0, 70_000, 2**20 + 5, 2**22 - 1])
def test_a_flipped_byte_is_caught_when_rows_are_split_onto_another_sharding(
    tmp_path, devices, where
):
    """Restoring 256 KiB rows onto a (4, 2) mesh copies half rows from mappings of the
    data file; each chunk is still verified whole, before any of it is used."""
    mesh8 = jax.make_mesh((8,), ("x",), devices=devices)
    big = values((16, 65536), seed=4)  # 4 MiB, two rows per stored block
    checkpoint.save(tmp_path / "c", {"w": jax.device_put(big, NamedSharding(mesh8, P("x")))})
    lay = checkpoint.read_layout(tmp_path / "c")
    first = lay.items[0].arrays.arrays[0].shards[0]
    data = tmp_path / "c" / lay.files[first.file].name
    offset = next(
        s.offset + where - k * first.length
        for k, s in enumerate(lay.items[0].arrays.arrays[0].shards)
        if k * first.length <= where < (k + 1) * first.length
    )
    flip(data, offset)
    mesh42 = jax.make_mesh((4, 2), ("a", "b"), devices=devices)
    spec = jax.ShapeDtypeStruct(big.shape, big.dtype, sharding=NamedSharding(mesh42, P("a", "b")))
    with pytest.raises(CheckpointError, match=rf"'w'.*{data.name}.*checksum mismatch"):
        checkpoint.restore(tmp_path / "c", {"w": spec})


def _saved_rows(tmp_path, devices):
    """A 4 MiB array saved over 8 devices, and the spec restoring it onto a (4, 2)
    mesh: rows split between destinations, read through mappings of the data file."""
    mesh8 = jax.make_mesh((8,), ("x",), devices=devices)
    big = values((16, 65536), seed=5)
    checkpoint.save(tmp_path / "c", {"w": jax.device_put(big, NamedSharding(mesh8, P("x")))})
    lay = checkpoint.read_layout(tmp_path / "c")
    data = tmp_path / "c" / lay.files[lay.items[0].arrays.arrays[0].shards[0].file].name
    mesh42 = jax.make_mesh((4, 2), ("a", "b"), devices=devices)
    spec = jax.ShapeDtypeStruct(big.shape, big.dtype, sharding=NamedSharding(mesh42, P("a", "b")))
    return data, {"w": spec}


def test_a_truncated_data_file_is_an_error_when_rows_are_split_onto_another_sharding(
    tmp_path, devices
):
    """A mapping past the end of a file would end the process with SIGBUS when read."""
    data, target = _saved_rows(tmp_path, devices)
    with open(data, "r+b") as f:
        f.truncate(data.stat().st_size // 2)
    with pytest.raises(CheckpointError, match=rf"'w'.*{data.name} is truncated"):
        checkpoint.restore(tmp_path / "c", target)


def test_a_read_error_while_populating_a_mapping_is_a_checkpoint_error(
    tmp_path, devices, monkeypatch
):
    """The kernel reports an I/O error (or a file cut short after it was mapped) when it
    populates the pages; it must not be ignored, or reading them raises SIGBUS."""
    from fcir.checkpoint import reader

    data, target = _saved_rows(tmp_path, devices)
    real = reader._advise

    def failing(m, advice, start, length):
        if advice == reader._POPULATE and advice is not None:
            return OSError(errno.EIO, "Input/output error")
        return real(m, advice, start, length)

    monkeypatch.setattr(reader, "_advise", failing)
    with pytest.raises(
        CheckpointError, match=rf"'w': cannot read data file .*{data.name} bytes .*Input/output"
    ):
        checkpoint.restore(tmp_path / "c", target)
