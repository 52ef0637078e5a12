"""Large shards are written past the page cache (O_DIRECT) where the file system takes
it, and the data file is byte for byte the one the page-cache path writes."""

from __future__ import annotations

import errno
import fcntl
import os

import numpy as np
import pytest
from ckpt_testing import same_bits, values
from fcir.checkpoint import checksums, writer

from fcir import checkpoint
from fcir.errors import CheckpointError

CHUNK = checksums.CHUNK_BYTES


def _direct_supported(directory) -> bool:
    path = directory / "probe"
    path.write_bytes(b"")
    fd = writer._open_direct(path)
    path.unlink()
    if fd is None:
        return False
    os.close(fd)
    return True


def _is_direct(fd: int) -> bool:
    return bool(fcntl.fcntl(fd, fcntl.F_GETFL) & getattr(os, "O_DIRECT", 0))


def _tree() -> dict:
    """Shards with whole chunks and ragged tails, small leaves packed between them."""
    return {
        "a": values((3 * CHUNK // 4 + 25,), "float32", seed=1),  # 3 chunks + 100 bytes
        "b": np.arange(7, dtype=np.int8),
        "c": values((2 * CHUNK // 8, 1), "float64", seed=2),  # exactly 2 chunks
        "d": values((5 * CHUNK // 2 + 3,), "int16", seed=3),  # 5 chunks + 6 bytes
        "e": values((17 * CHUNK // 4,), "float32", seed=4),  # 17 chunks: two pieces
        "empty": np.zeros((0, 3), np.float32),
    }


def _data_files(directory) -> dict[str, bytes]:
    """Every file's bytes but the layout's and Orbax's metadata (they carry the time)."""
    return {
        str(p.relative_to(directory)): p.read_bytes()
        for p in directory.rglob("*")
        if p.is_file() and p.name not in ("layout.pb", "_CHECKPOINT_METADATA")
    }


@pytest.fixture
def pwrites(monkeypatch):
    """Records (direct, length, offset) of every pwrite a save makes."""
    seen = []
    real = os.pwrite

    def recording(fd, data, offset):
        seen.append((_is_direct(fd), len(data), offset))
        return real(fd, data, offset)

    monkeypatch.setattr(writer.os, "pwrite", recording)
    return seen


def test_whole_chunks_of_large_shards_are_written_with_direct_io(tmp_path, pwrites):
    if not _direct_supported(tmp_path):
        pytest.skip(f"the file system of {tmp_path} has no direct I/O")
    tree = _tree()
    checkpoint.save(tmp_path / "c", tree)
    direct = [(n, o) for d, n, o in pwrites if d]
    assert sum(n for n, _ in direct) == (3 + 2 + 5 + 17) * CHUNK
    assert all(n % 4096 == 0 == o % 4096 and n <= writer.DIRECT_BYTES for n, o in direct)
    got = checkpoint.restore(tmp_path / "c")
    assert all(same_bits(np.asarray(got[k]), v) for k, v in tree.items())


def test_page_aligned_shards_are_written_from_their_own_memory(tmp_path, monkeypatch):
    """No copy into the writer's aligned buffer when the bytes are aligned already."""
    if not _direct_supported(tmp_path):
        pytest.skip(f"the file system of {tmp_path} has no direct I/O")
    from fcir.checkpoint.reader import aligned_empty

    aligned = aligned_empty((5 * CHUNK // 4 + 3,), np.dtype(np.float32))  # 2 MiB aligned
    aligned[...] = values(aligned.shape, "float32", seed=5)
    other = aligned_empty((3 * CHUNK // 4 + 16,), np.dtype(np.float32))[16:]  # 64 bytes off
    other[...] = values(other.shape, "float32", seed=6)
    start, end = aligned.ctypes.data, aligned.ctypes.data + aligned.nbytes
    sources = []
    real = os.pwrite

    def recording(fd, data, offset):
        if _is_direct(fd):
            at = np.frombuffer(data, np.uint8).ctypes.data
            sources.append(("aligned" if start <= at < end else "buffer", len(data)))
        return real(fd, data, offset)

    monkeypatch.setattr(writer.os, "pwrite", recording)
    checkpoint.save(tmp_path / "c", {"a": aligned, "o": other})
    assert sum(n for k, n in sources if k == "aligned") == 5 * CHUNK
    assert sum(n for k, n in sources if k == "buffer") == 3 * CHUNK  # other: copied in
    got = checkpoint.restore(tmp_path / "c")
    assert same_bits(got["a"], aligned) and same_bits(got["o"], other)


@pytest.mark.parametrize("fmt", ["fcir", "orbax"])
def test_without_direct_io_the_files_are_the_same_bytes(tmp_path, monkeypatch, pwrites, fmt):
    tree = {"default": _tree()} if fmt == "orbax" else _tree()
    checkpoint.save(tmp_path / "direct", tree, format=fmt)
    assert any(d for d, _, _ in pwrites) or not _direct_supported(tmp_path)
    monkeypatch.setattr(writer, "_open_direct", lambda path: None)
    pwrites.clear()
    checkpoint.save(tmp_path / "cached", tree, format=fmt)
    assert not any(d for d, _, _ in pwrites)
    assert _data_files(tmp_path / "direct") == _data_files(tmp_path / "cached")
    a, b = checkpoint.read_layout(tmp_path / "direct"), checkpoint.read_layout(tmp_path / "cached")
    a.commit_time_unix = b.commit_time_unix = 0
    assert a.SerializeToString() == b.SerializeToString()


def test_direct_io_refused_during_a_save_falls_back_to_the_page_cache(
    tmp_path, monkeypatch, pwrites
):
    """A file system that opens O_DIRECT files but refuses a write (EINVAL) gets the
    rest of the save through the page cache, and the same bytes."""
    if not _direct_supported(tmp_path):
        pytest.skip(f"the file system of {tmp_path} has no direct I/O")
    tree = _tree()
    checkpoint.save(tmp_path / "cached", tree)
    recording = writer.os.pwrite
    direct_calls = []

    def refusing(fd, data, offset):
        if _is_direct(fd):
            direct_calls.append(offset)
            if len(direct_calls) > 1:
                raise OSError(errno.EINVAL, "Invalid argument")
        return recording(fd, data, offset)

    monkeypatch.setattr(writer.os, "pwrite", refusing)
    checkpoint.save(tmp_path / "refused", tree)
    assert len(direct_calls) >= 2
    assert _data_files(tmp_path / "refused") == _data_files(tmp_path / "cached")
    got = checkpoint.restore(tmp_path / "refused")
    assert all(same_bits(np.asarray(got[k]), v) for k, v in tree.items())


@pytest.mark.parametrize("blocking", [True, False])
def test_a_failing_direct_write_is_a_checkpoint_error_and_leaves_nothing(
    tmp_path, monkeypatch, pwrites, blocking
):
    if not _direct_supported(tmp_path):
        pytest.skip(f"the file system of {tmp_path} has no direct I/O")
    checkpoint.save(tmp_path / "old", {"x": np.ones(4)})
    recording = writer.os.pwrite

    def full(fd, data, offset):
        if _is_direct(fd):
            raise OSError(errno.ENOSPC, "No space left on device")
        return recording(fd, data, offset)

    monkeypatch.setattr(writer.os, "pwrite", full)
    with pytest.raises(CheckpointError, match="No space left on device"):
        checkpoint.save(tmp_path / "new", _tree(), blocking=blocking).wait()
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old"]
