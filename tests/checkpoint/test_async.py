"""Two-phase asynchronous saves: return after the host copy, commit in the background."""

from __future__ import annotations

import os
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ckpt_testing import same_bits, values
from fcir.checkpoint import saving
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from fcir import checkpoint
from fcir.errors import CheckpointError


def test_async_save_returns_before_commit_and_wait_commits(tmp_path, gate, devices):
    x = values((64, 64), seed=1)
    mesh = jax.make_mesh((8,), ("x",), devices=devices)
    handle = checkpoint.save(
        tmp_path / "c", {"x": jax.device_put(x, NamedSharding(mesh, P("x")))}, blocking=False
    )
    assert not handle.done() and not (tmp_path / "c").exists()
    with pytest.raises(TimeoutError):
        handle.wait(timeout=0.05)
    gate.set()
    handle.wait()
    assert handle.done() and "committed" in repr(handle)
    assert same_bits(checkpoint.restore(tmp_path / "c")["x"], x)
    assert handle.blocking_seconds > 0


def test_the_saved_values_are_those_at_the_call_even_if_the_caller_moves_on(
    tmp_path, gate, devices
):
    """numpy leaves are copied; device buffers stay valid even if donated or deleted."""
    host = np.arange(16.0)
    dev = jax.device_put(np.arange(16.0, dtype=np.float32), devices[0])
    handle = checkpoint.save(tmp_path / "c", {"h": host, "d": dev}, blocking=False)
    host[:] = -1
    step = jax.jit(lambda a: a * 0 - 5, donate_argnums=0)
    new = step(dev)
    new.block_until_ready()
    gate.set()
    handle.wait()
    out = checkpoint.restore(tmp_path / "c")
    assert same_bits(out["h"], np.arange(16.0))
    assert same_bits(out["d"], np.arange(16.0, dtype=np.float32))


def test_a_second_save_waits_for_the_first(tmp_path, gate):
    first = checkpoint.save(tmp_path / "a", {"x": np.zeros(4)}, blocking=False)
    finished = []

    def second():
        checkpoint.save(tmp_path / "b", {"x": np.ones(4)}, blocking=False).wait()
        finished.append(first.done())

    t = threading.Thread(target=second)
    t.start()
    t.join(0.2)
    assert t.is_alive() and not first.done()  # blocked behind the first save
    gate.set()
    t.join(30)
    assert finished == [True]
    assert same_bits(checkpoint.restore(tmp_path / "b")["x"], np.ones(4))


def broken_pwrite(fd, data, offset):
    raise OSError(28, "No space left on device")


def test_background_errors_surface_from_wait(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "pwrite", broken_pwrite)
    handle = checkpoint.save(tmp_path / "c", {"x": np.zeros(1024)}, blocking=False)
    with pytest.raises(CheckpointError, match="No space left on device"):
        handle.wait()
    with pytest.raises(CheckpointError, match="No space left on device"):
        handle.wait()  # every wait says so
    assert list(tmp_path.iterdir()) == []  # nothing committed-looking, temp removed


def test_an_unobserved_background_error_is_raised_by_the_next_save(tmp_path, monkeypatch):
    real = os.pwrite
    monkeypatch.setattr(os, "pwrite", broken_pwrite)
    handle = checkpoint.save(tmp_path / "a", {"x": np.zeros(8)}, blocking=False)
    while not handle.done():
        threading.Event().wait(0.01)
    monkeypatch.setattr(os, "pwrite", real)
    with pytest.raises(CheckpointError, match="previous asynchronous save to .*/a failed"):
        checkpoint.save(tmp_path / "b", {"x": np.zeros(8)})
    assert not (tmp_path / "b").exists()
    checkpoint.save(tmp_path / "b", {"x": np.zeros(8)})  # reported once, then forgotten


def test_a_lost_error_is_printed_at_exit(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(os, "pwrite", broken_pwrite)
    handle = checkpoint.save(tmp_path / "a", {"x": np.zeros(8)}, blocking=False)
    while not handle.done():
        threading.Event().wait(0.01)
    saving._report_lost_error()  # what atexit runs
    assert "asynchronous save to" in capsys.readouterr().err
    with pytest.raises(CheckpointError):
        handle.wait()


def test_blocking_part_does_not_copy_cpu_device_buffers(tmp_path, gate, devices):
    """On CPU the host 'copy' is a view that pins the device buffer: no bytes move."""
    mesh = jax.make_mesh((8,), ("x",), devices=devices)
    x = jax.device_put(jnp.ones((1024, 256)), NamedSharding(mesh, P("x")))
    snap = saving.snapshot.take({"x": x}, 0, copy_host_values=True)
    for shard, data in zip(x.addressable_shards, snap.items[0].arrays[0].shards):
        assert np.shares_memory(data.data, np.asarray(shard.data))
    gate.set()


# --- device shards: host copies started at once, written as they arrive ------------------


@pytest.fixture
def transfers(monkeypatch, devices):
    """CPU shards take the accelerators' path (copy_to_host_async, awaited where the
    bytes are first needed), and the save's snapshot is kept. The last shard's copy
    arrives only once some bytes have been written, or after record["wait"] seconds
    (10); record["early_write"] says which."""
    from fcir.checkpoint import snapshot

    monkeypatch.setattr(snapshot, "ZERO_COPY_PLATFORMS", ())
    kept, record = [], {"wait": 10}
    real_take, real_host, real_pwrite = snapshot.take, snapshot.ShardData.host, os.pwrite
    written = threading.Event()

    def take(*a, **k):
        kept.append(real_take(*a, **k))
        return kept[-1]

    def host(self):
        if self is kept[-1].shards()[-1] and "early_write" not in record:
            record["early_write"] = written.wait(record["wait"])
        return real_host(self)

    def pwrite(fd, data, offset):
        written.set()
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(snapshot, "take", take)
    monkeypatch.setattr(snapshot.ShardData, "host", host)
    monkeypatch.setattr(os, "pwrite", pwrite)
    return kept, record


def _sharded(devices, mib_per_shard: int = 1):
    mesh = jax.make_mesh((8,), ("x",), devices=devices)
    x = values((8 * mib_per_shard * 2**18,), seed=4)
    return x, {"x": jax.device_put(x, NamedSharding(mesh, P("x"))), "n": np.arange(3)}


def test_a_blocking_save_writes_early_shards_while_later_copies_are_in_flight(
    tmp_path, devices, transfers
):
    kept, record = transfers
    x, tree = _sharded(devices)
    checkpoint.save(tmp_path / "c", tree)
    assert record["early_write"]  # a save that awaited every copy first waits 10 s
    assert same_bits(checkpoint.restore(tmp_path / "c")["x"], x)


def test_an_async_save_returns_once_every_copy_has_arrived_and_only_then_writes(
    tmp_path, devices, transfers
):
    """The caller waits for the copies alone: no write competes with them for memory."""
    kept, record = transfers
    record["wait"] = 0.3
    x, tree = _sharded(devices)
    handle = checkpoint.save(tmp_path / "c", tree, blocking=False)
    (snap,) = kept
    assert all(s.data is not None and s.pending is None for s in snap.shards())
    assert record["early_write"] is False
    handle.wait()
    assert same_bits(checkpoint.restore(tmp_path / "c")["x"], x)


@pytest.mark.parametrize("blocking", [True, False])
def test_a_failed_device_to_host_copy_fails_the_save_and_leaves_nothing(
    tmp_path, devices, transfers, monkeypatch, blocking
):
    from fcir.checkpoint import snapshot

    kept, _ = transfers
    arrived = snapshot.ShardData.host

    def host(self):
        if self is kept[-1].shards()[-1]:
            raise RuntimeError("DEVICE_TO_HOST transfer failed")
        return arrived(self)

    monkeypatch.setattr(snapshot.ShardData, "host", host)
    _, tree = _sharded(devices)
    with pytest.raises(CheckpointError, match="transfer failed"):
        checkpoint.save(tmp_path / "c", tree, blocking=blocking).wait()
    assert os.listdir(tmp_path) == []  # no checkpoint, no temporary directory
    monkeypatch.setattr(snapshot.ShardData, "host", arrived)
    checkpoint.save(tmp_path / "c", tree).wait()  # the failure was reported once, to the caller
