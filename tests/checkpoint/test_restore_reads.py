"""What a restore onto another sharding reads: a stored shard that several destinations
each need a short run of (shorter than a checksum chunk) is read once and copied out,
not read again (whole chunk, for its checksum) by every destination; and every byte
of it is still verified."""

from __future__ import annotations

import os

import jax
import numpy as np
import pytest
from ckpt_testing import mapped_from, same_bits, values
from fcir.checkpoint import reader
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from fcir import checkpoint
from fcir.errors import CheckpointError


def _record_reads(monkeypatch):
    """Bytes of stored data read from here on: each buffer a preadv fills, and each
    block the reader maps (in whole checksum chunks, as it verifies them)."""
    reads = []
    real_preadv, real_fill = os.preadv, reader._fill_mapped

    def preadv(fd, bufs, off):
        reads.extend(len(memoryview(b).cast("B")) for b in bufs)
        return real_preadv(fd, bufs, off)

    def fill_mapped(m, at, lo, start, stop, shard, chunk, *rest):
        reads.append(min(-(-stop // chunk) * chunk, shard.length) - lo)
        return real_fill(m, at, lo, start, stop, shard, chunk, *rest)

    monkeypatch.setattr(os, "preadv", preadv)
    monkeypatch.setattr(reader, "_fill_mapped", fill_mapped)
    return reads


def _save(tmp_path, devices, x, spec, saved_devices=8):
    """`x` saved over `saved_devices` devices as `spec`; the rows-over-8 target sharding."""
    mesh = jax.make_mesh((saved_devices,), ("x",), devices=devices[:saved_devices])
    checkpoint.save(tmp_path / "c", {"v": jax.device_put(x, NamedSharding(mesh, spec))})
    mesh8 = jax.make_mesh((8,), ("x",), devices=devices)
    return NamedSharding(mesh8, P("x"))


@pytest.mark.parametrize(
    ("shape", "saved_spec", "saved_devices"),
    [((4096,), P(), 8), ((64, 256), P(), 8), ((64, 256), P("x"), 2)],
    ids=["vector-replicated", "matrix-replicated", "matrix-rows-over-2"],
)
def test_short_runs_of_one_stored_shard_onto_8_devices_read_it_once(
    tmp_path, monkeypatch, devices, shape, saved_spec, saved_devices
):
    """A 16 KiB vector and 64 KiB matrices (stored shards of one checksum chunk or less)
    restored onto rows over 8 devices: each device needs a run of 2-8 KiB of a stored
    shard that 4 or 8 devices share. Each used to read the whole chunk again to verify
    it (4-8x the stored bytes)."""
    x = values(shape, seed=3)
    target = _save(tmp_path, devices, x, saved_spec, saved_devices)
    reads = _record_reads(monkeypatch)
    got = checkpoint.restore(
        tmp_path / "c", {"v": jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=target)}
    )["v"]
    assert same_bits(got, x) and got.sharding == target
    assert sum(reads) == x.nbytes


def test_a_flipped_byte_of_a_stored_shard_read_once_for_8_devices_is_caught(tmp_path, devices):
    """A flipped byte in any destination's run of the one stored shard (and in the part
    of the chunk no destination of this process needs: none here) is an error."""
    x = values((4096,), seed=4)
    target = _save(tmp_path, devices, x, P())
    lay = checkpoint.read_layout(tmp_path / "c")
    shard = lay.items[0].arrays.arrays[0].shards[0]
    data = tmp_path / "c" / lay.files[shard.file].name
    spec = {"v": jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=target)}
    original = data.read_bytes()
    for at in (0, 2047, 2048, 9000, shard.length - 1):  # every run's edges, and inside one
        blob = bytearray(original)
        blob[shard.offset + at] ^= 0x10
        data.write_bytes(bytes(blob))
        with pytest.raises(CheckpointError, match=rf"'v'.*{data.name}.*checksum mismatch"):
            checkpoint.restore(tmp_path / "c", spec)
    data.write_bytes(original)
    assert np.array_equal(np.asarray(checkpoint.restore(tmp_path / "c", spec)["v"]), x)


@pytest.mark.parametrize(("shape", "align"), [((512, 1024), 2 << 20), ((3, 5), 64)])
def test_destination_blocks_of_2_mib_and_more_start_on_a_huge_page(shape, align):
    """numpy asks for huge pages on large buffers, but only their 2 MiB-aligned parts
    get them: at a 64-byte boundary a quarter of each 8 MiB block faulted in 4 KiB at
    a time. Smaller blocks stay 64-byte aligned (what jax needs to adopt them)."""
    for _ in range(4):  # whatever address malloc hands out
        buf = reader.aligned_empty(shape, np.dtype(np.float32))
        assert buf.shape == shape and buf.flags.c_contiguous
        assert buf.ctypes.data % align == 0


def _restore_rows(tmp_path, x, devices):
    mesh = jax.make_mesh((8,), ("x",), devices=devices)
    sds = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, P("x")))
    return checkpoint.restore(tmp_path / "c", {"v": sds})["v"]


def test_on_cpu_large_blocks_are_the_data_file_s_pages_and_stay_private(tmp_path, devices):
    """Onto the saved sharding on CPU, each 1 MiB block is not read into fresh memory
    (on these VMs the cost of a process's first restore) but mapped copy-on-write from
    the data file, which jax adopts. Such arrays outlive the checkpoint's files, and
    what writes into their memory (a donated buffer) never reaches the file."""
    x = values((64, 32768), seed=5)  # 8 MiB: 1 MiB per device
    _save(tmp_path, devices, x, P("x"))
    (data,) = (tmp_path / "c").glob("data-*.bin")
    stored = data.read_bytes()
    got, kept = _restore_rows(tmp_path, x, devices), _restore_rows(tmp_path, x, devices)
    maps = mapped_from(data)
    for s in got.addressable_shards:
        lo = s.data.unsafe_buffer_pointer()
        assert any(a <= lo and lo + s.data.nbytes <= b for a, b in maps)
    assert same_bits(got, x)
    bumped = jax.jit(lambda a: a + 1, donate_argnums=0)(got)
    assert same_bits(bumped, x + 1) and data.read_bytes() == stored
    for name in os.listdir(tmp_path / "c"):  # the checkpoint goes, the arrays stay
        os.unlink(tmp_path / "c" / name)
    os.rmdir(tmp_path / "c")
    assert same_bits(kept, x)


def test_a_flipped_byte_or_a_cut_file_under_a_mapped_block_is_caught(tmp_path, devices):
    x = values((64, 32768), seed=6)
    _save(tmp_path, devices, x, P("x"))
    (data,) = (tmp_path / "c").glob("data-*.bin")
    shard = checkpoint.read_layout(tmp_path / "c").items[0].arrays.arrays[0].shards[5]
    original = data.read_bytes()
    blob = bytearray(original)
    blob[shard.offset + (3 << 18)] ^= 0x01
    data.write_bytes(bytes(blob))
    with pytest.raises(CheckpointError, match=rf"'v'.*{data.name}.*checksum mismatch"):
        _restore_rows(tmp_path, x, devices)
    data.write_bytes(original[: shard.offset + 100])
    with pytest.raises(CheckpointError, match=rf"'v'.*{data.name}.*truncated"):
        _restore_rows(tmp_path, x, devices)
    data.write_bytes(original)
    assert same_bits(_restore_rows(tmp_path, x, devices), x)


def test_where_a_data_file_cannot_be_mapped_its_blocks_are_read(tmp_path, monkeypatch, devices):
    """Some file systems (FUSE mounts) refuse mmap: the blocks are then read, as before."""
    x = values((64, 32768), seed=7)
    _save(tmp_path, devices, x, P("x"))
    real = reader.mmap.mmap

    def refuse_private(fd, length, *args, **kwargs):
        if kwargs.get("access") == reader.mmap.ACCESS_COPY:
            raise OSError(19, "No such device")
        return real(fd, length, *args, **kwargs)

    monkeypatch.setattr(reader.mmap, "mmap", refuse_private)
    reads = _record_reads(monkeypatch)
    assert same_bits(_restore_rows(tmp_path, x, devices), x)
    assert sum(reads) == x.nbytes
