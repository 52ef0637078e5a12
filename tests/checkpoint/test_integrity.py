"""Damaged checkpoints are CheckpointErrors naming the array and file, never wrong numbers."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from ckpt_testing import same_bits, values
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from fcir import checkpoint
from fcir._proto import checkpoint_pb2 as pb
from fcir.checkpoint import layout as layout_module
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
