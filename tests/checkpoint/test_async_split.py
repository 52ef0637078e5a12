"""What the blocking part of an asynchronous save does, and what it leaves to phase 2.

The caller waits only for the checks and the host copy; every error about what is
saved is still raised by `save` itself, and what runs later surfaces through `wait()`.
"""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap
import threading
import weakref

import jax
import numpy as np
import pytest
from ckpt_testing import same_bits, values
from fcir.checkpoint import commit, parallel, snapshot
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from fcir import checkpoint
from fcir.errors import CheckpointError


def _sharded(devices, seed=0):
    mesh = jax.make_mesh((8,), ("x",), devices=devices)
    return jax.device_put(values((64, 16), seed=seed), NamedSharding(mesh, P("x")))


def _nothing_started(tmp_path):
    return [p.name for p in tmp_path.iterdir() if commit.is_leftover(p.name)] == []


@pytest.mark.parametrize(
    ("tree", "message"),
    [
        ({"x": np.array(["a", "b"])}, "has dtype <U1, which cannot be saved"),
        ({"x": np.zeros(2, dtype=[("a", "i4")])}, "cannot be saved"),
        ({"x": object()}, "is a object; a checkpoint holds jax arrays"),
        ({"x": [2**70, np.zeros(2)]}, "does not fit in int64"),
        ({"": np.zeros(2)}, "item names must be non-empty strings"),
        ({"x": {(1, 2): np.zeros(2)}}, "cannot be saved; use str or int keys"),
    ],
)
def test_bad_leaves_raise_from_the_async_call_itself(tmp_path, tree, message):
    with pytest.raises(CheckpointError, match=message.replace("(", r"\(")):
        checkpoint.save(tmp_path / "c", tree, blocking=False)
    assert _nothing_started(tmp_path) and not (tmp_path / "c").exists()
    checkpoint.save(tmp_path / "c", {"x": np.zeros(2)}, blocking=False).wait()  # not stuck


def test_a_deleted_or_extended_jax_array_raises_from_the_async_call(tmp_path, devices):
    x = _sharded(devices)
    x.delete()
    with pytest.raises(CheckpointError, match=r"array 'p/x' has been deleted \(was it donated"):
        checkpoint.save(tmp_path / "c", {"p": {"x": x}}, blocking=False)
    key = jax.random.key(0)
    key.delete()
    with pytest.raises(CheckpointError, match=r"array 'k' has been deleted"):
        checkpoint.save(tmp_path / "c", {"k": key}, blocking=False)
    assert not (tmp_path / "c").exists()


def test_a_path_that_cannot_be_saved_to_raises_from_the_async_call(tmp_path):
    (tmp_path / "taken").mkdir()
    with pytest.raises(CheckpointError, match="already exists; pass overwrite=True"):
        checkpoint.save(tmp_path / "taken", {"x": np.zeros(2)}, blocking=False)
    with pytest.raises(CheckpointError, match="no checkpoint storage for memory://"):
        checkpoint.save("memory://x/y", {"x": np.zeros(2)}, blocking=False)
    with pytest.raises(CheckpointError, match="a checkpoint is a dict of named items"):
        checkpoint.save(tmp_path / "c", [np.zeros(2)], blocking=False)


def test_values_changed_right_after_the_call_are_saved_as_they_were(tmp_path, gate, devices):
    """numpy leaves and JSON metadata are copied at the call; device buffers pinned."""
    host = np.arange(8.0)
    meta = {"step": 3, "tags": ["a"]}
    x = _sharded(devices, seed=4)
    want = np.asarray(x)
    handle = checkpoint.save(tmp_path / "c", {"h": {"v": host}, "m": meta, "x": x}, blocking=False)
    host += 100
    meta["step"] = 4
    meta["tags"].append("b")
    x.delete()
    gate.set()
    handle.wait()
    out = checkpoint.restore(tmp_path / "c")
    assert same_bits(out["h"]["v"], np.arange(8.0))
    assert out["m"] == {"step": 3, "tags": ["a"]}
    assert same_bits(out["x"], want)


def test_sharding_records_are_made_in_phase_2(tmp_path, gate, devices, monkeypatch):
    described = []
    real = snapshot.shardings.describe
    monkeypatch.setattr(snapshot.shardings, "describe", lambda *a: described.append(a) or real(*a))
    handle = checkpoint.save(tmp_path / "c", {"x": _sharded(devices)}, blocking=False)
    assert described == []  # the caller did not wait for them
    gate.set()
    handle.wait()
    assert len(described) == 1
    assert checkpoint.restore(tmp_path / "c")["x"].shape == (64, 16)


def test_an_error_of_phase_2_s_describing_surfaces_from_wait(tmp_path, devices, monkeypatch):
    def broken(*args):
        raise RuntimeError("no record for this sharding")

    monkeypatch.setattr(snapshot.shardings, "describe", broken)
    handle = checkpoint.save(tmp_path / "c", {"x": _sharded(devices)}, blocking=False)
    with pytest.raises(CheckpointError, match="saving .* failed: no record for this sharding"):
        handle.wait()
    assert list(tmp_path.iterdir()) == []  # the temporary directory went too


def test_the_async_call_starts_no_thread_once_warm(tmp_path, devices, monkeypatch):
    tree = {"x": _sharded(devices)}
    checkpoint.save(tmp_path / "warm", tree, blocking=False).wait()
    starts = []
    real = threading.Thread.start

    def start(self):
        if threading.current_thread() is threading.main_thread():
            starts.append(self.name)
        real(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    handle = checkpoint.save(tmp_path / "c", tree, blocking=False)
    called = list(starts)
    handle.wait()
    assert called == []


def test_pooled_threads_run_nested_tasks_and_report_the_first_error():
    done = []

    def inner(i):
        return lambda: done.append(i)

    def outer(k):
        return lambda: parallel.run_tasks([inner(10 * k + j) for j in range(5)], 3)

    parallel.run_tasks([outer(k) for k in range(parallel.THREADS * 2)])
    assert sorted(done) == sorted(10 * k + j for k in range(parallel.THREADS * 2) for j in range(5))

    def fail():
        raise OSError(5, "disk gone")

    with pytest.raises(OSError, match="disk gone"):
        parallel.run_tasks([fail] + [lambda: None] * 8, 4)


def test_pooled_threads_let_go_of_the_tasks_they_ran():
    """A restore's tasks hold its destination buffers. Pooled threads kept their first
    job (in the Thread's args, for as long as the thread lives) and their last one, so
    each restore's arrays stayed in memory after the caller dropped them and the next
    restore took fresh memory (on these VMs the slow part of a first restore)."""

    class Buffer:
        pass

    refs = []

    def task():
        buf = Buffer()
        refs.append(weakref.ref(buf))
        return lambda: buf

    # More threads than the pool has idle: both new threads and pooled ones run jobs.
    threads = 2 * parallel.THREADS + 2
    parallel.run_tasks([task() for _ in range(threads)], threads)
    gc.collect()
    assert len(refs) == threads and not [r for r in refs if r() is not None]


def test_an_async_save_started_just_before_exit_is_committed(tmp_path):
    """Phase 2 runs on a pooled (daemon) thread; the interpreter still waits for it, and
    where it refuses new threads by then (Python 3.12) the save writes on fewer."""
    script = textwrap.dedent(
        """
        import sys, time
        import numpy as np
        from fcir import checkpoint
        from fcir.checkpoint import saving
        real = saving._write_and_commit
        def late(*args):
            time.sleep(0.5)  # the main thread has returned: the interpreter is exiting
            real(*args)
        saving._write_and_commit = late
        tree = {f"x{i}": np.arange(2**18, dtype=np.float32) + i for i in range(3)}
        checkpoint.save(sys.argv[1], tree, blocking=False)
        print("returned", flush=True)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "c")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "returned" in done.stdout and "failed" not in done.stderr, done.stderr
    got = checkpoint.restore(tmp_path / "c")
    for i in range(3):
        assert same_bits(got[f"x{i}"], np.arange(2**18, dtype=np.float32) + i)
