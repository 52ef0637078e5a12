"""Child process of test_multiprocess.py.

    mp_worker.py pair DIR PORT PROCESS_ID   one of 2 jax.distributed processes (4 devices each)
    mp_worker.py single DIR                 one process; device count from XLA_FLAGS
    mp_worker.py s3pair URL PORT PROCESS_ID the pair's saves into an object store (s3://)

`pair` saves a tree sharded over all 8 devices (blocking, async, and with a manager),
checks that each process wrote only its own shards, then restores onto another
sharding and checks each process read only the bytes its devices need. `single`
restores the same checkpoints in one process. Prints "OK" on success.
"""

from __future__ import annotations

import os
import pathlib
import sys
import threading

import jax
import numpy as np
from ckpt_testing import same_bits, values
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from fcir import checkpoint

EXPECTED = {
    "w": values((64, 48), seed=1),
    "m": values((16, 8, 4), "bfloat16", seed=2),
    "r": values((48,), seed=3),
    "h": values((8, 6), "int32", seed=4),
}


def saved_shardings(devices: list[jax.Device]) -> dict[str, NamedSharding]:
    mesh8 = Mesh(np.array(devices), ("x",))
    mesh24 = Mesh(np.array(devices).reshape(2, 4), ("a", "b"))
    return {
        "w": NamedSharding(mesh8, P("x")),
        "m": NamedSharding(mesh24, P("b", None, "a")),
        "r": NamedSharding(mesh8, P()),  # replicated over both processes: stored once
        "h": NamedSharding(mesh24, P("a")),  # each half replicated within one process
    }


def tree(shardings: dict[str, NamedSharding], step: int = 0) -> dict:
    params = {
        k: jax.make_array_from_callback(v.shape, shardings[k], lambda i, v=v: v[i] + step)
        for k, v in EXPECTED.items()
    }
    return {"params": params, "host": {"n": np.arange(10), "s": 3.5}, "meta": {"run": "mp"}}


def check(params: dict, step: int = 0) -> None:
    for name, arr in params.items():
        want = EXPECTED[name] + step
        if isinstance(arr, np.ndarray):
            assert same_bits(arr, want), name
            continue
        for shard in arr.addressable_shards:
            assert same_bits(shard.data, want[shard.index]), (name, shard.index)


class ReadCounter:
    """Counts the bytes this process reads from checkpoint data files."""

    def __init__(self) -> None:
        self.total = 0
        self._lock = threading.Lock()
        self._real = os.preadv
        os.preadv = self._preadv

    def _preadv(self, fd: int, buffers: list, offset: int) -> int:
        n = self._real(fd, buffers, offset)
        with self._lock:
            self.total += n
        return n


def pair(directory: pathlib.Path, port: int, process_id: int) -> None:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process_id)
    assert jax.process_count() == 2 and jax.device_count() == 8
    assert jax.local_device_count() == 4
    devices = jax.devices()
    shardings = saved_shardings(devices)
    state = tree(shardings)

    checkpoint.save(directory / "blocking", state)
    checkpoint.save(directory / "async", state, blocking=False).wait()
    checkpoint.save(directory / "orbax", state, format="orbax")  # each process its chunks
    mgr = checkpoint.CheckpointManager(directory / "run", max_to_keep=1)
    for step in range(3):
        mgr.save(step, tree(shardings, step))
    mgr.wait_until_finished()
    assert mgr.all_steps() == [2], mgr.all_steps()

    # Each process wrote only its own shards; replicated data once.
    layout = checkpoint.read_layout(directory / "blocking")
    assert layout.num_processes == 2
    assert [f.process_index for f in layout.files] == [0, 1]
    records = {a.path[0].name: a for a in layout.items[0].arrays.arrays}
    assert len(records["w"].shards) == 8 and len(records["m"].shards) == 8
    assert len(records["r"].shards) == 1 and len(records["h"].shards) == 2
    owner = {d.id: d.process_index for d in devices}
    for name, record in records.items():
        by_box = {}
        for d, idx in shardings[name].devices_indices_map(EXPECTED[name].shape).items():
            by_box.setdefault(tuple((s.start or 0) for s in idx), []).append(owner[d.id])
        for shard in record.shards:
            owners = by_box[tuple(r.start for r in shard.index)]
            assert shard.process_index in owners, (name, shard.process_index, owners)
            assert layout.files[shard.file].process_index == shard.process_index
    assert {s.process_index for s in records["w"].shards} == {0, 1}
    host = {a.path[0].name: a for a in layout.items[1].arrays.arrays}
    assert [s.process_index for s in host["n"].shards] == [0]

    # (a) Restore in the same two processes onto other shardings. The reversed mesh puts
    # each process on the other half of w's rows: it must read exactly that half.
    reversed_mesh = Mesh(np.array(devices[::-1]), ("x",))
    mesh42 = Mesh(np.array(devices).reshape(4, 2), ("a", "b"))
    target = {
        "w": jax.ShapeDtypeStruct(
            (64, 48), np.float32, sharding=NamedSharding(reversed_mesh, P("x"))
        ),
    }
    counter = ReadCounter()
    got = checkpoint.restore(directory / "async", {"params": target})["params"]
    assert counter.total == EXPECTED["w"].nbytes // 2, counter.total
    check(got)
    other = {
        "w": NamedSharding(mesh42, P("b", "a")),
        "m": NamedSharding(mesh42, P(None, "a", "b")),
        "r": NamedSharding(mesh42, P("a")),
        "h": NamedSharding(reversed_mesh, P()),
    }
    target = {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=other[k]) for k, v in EXPECTED.items()
    }
    out = checkpoint.restore(directory / "blocking", {"params": target, "host": None, "meta": None})
    check(out["params"])
    assert out["meta"] == {"run": "mp"} and out["host"]["s"] == 3.5
    check(mgr.restore(2, {"params": target})["params"], step=2)


def s3pair(url: str, port: int, process_id: int) -> None:
    """Both processes write their own objects; process 0 commits; both restore."""
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process_id)
    devices = jax.devices()
    shardings = saved_shardings(devices)
    checkpoint.save(url + "/blocking", tree(shardings))
    checkpoint.save(url + "/async", tree(shardings, 1), blocking=False).wait()
    checkpoint.save(url + "/orbax", tree(shardings, 3), format="orbax")
    mgr = checkpoint.CheckpointManager(url + "/run", max_to_keep=1)
    for step in range(3):
        mgr.save(step, tree(shardings, step))
    mgr.wait_until_finished()
    assert mgr.all_steps() == [2], mgr.all_steps()
    layout = checkpoint.read_layout(url + "/blocking")
    assert layout.num_processes == 2
    assert sorted({f.process_index for f in layout.files}) == [0, 1]
    reversed_mesh = Mesh(np.array(devices[::-1]), ("x",))
    target = {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(reversed_mesh, P("x")))
        for k, v in EXPECTED.items()
        if k != "m"
    }
    check(checkpoint.restore(url + "/blocking", {"params": target})["params"])
    check(checkpoint.restore(url + "/async", {"params": target})["params"], step=1)
    check(mgr.restore(2, {"params": target})["params"], step=2)
    check(checkpoint.restore(url + "/orbax", {"params": target})["params"], step=3)


def single(directory: pathlib.Path) -> None:
    n = jax.device_count()
    mesh = jax.make_mesh((n,), ("x",))
    target = {
        "w": NamedSharding(mesh, P("x")),
        "m": NamedSharding(mesh, P(None, "x")),
        "r": NamedSharding(mesh, P()),
        "h": NamedSharding(mesh, P(None, None) if n > 6 else P("x")),
    }
    for name in ("blocking", "async"):
        out = checkpoint.restore(directory / name, {"params": target})
        check(out["params"])
        check(checkpoint.restore(directory / name)["params"])  # host numpy
    out = checkpoint.restore(directory / "orbax", {"params": target})  # fcir, verified
    check(out["params"])
    if n == 8:  # what two processes wrote in Orbax's format, Orbax restores
        import orbax.checkpoint as ocp

        abstract = {
            k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=target[k])
            for k, v in EXPECTED.items()
        }
        check(ocp.StandardCheckpointer().restore(directory / "orbax" / "params", abstract))
    mgr = checkpoint.CheckpointManager(directory / "run")
    assert mgr.latest_step() == 2
    check(mgr.restore(target={"params": target})["params"], step=2)


if __name__ == "__main__":
    mode, where = sys.argv[1], pathlib.Path(sys.argv[2])
    if mode == "s3pair":
        s3pair(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    elif mode == "pair":
        pair(where, int(sys.argv[3]), int(sys.argv[4]))
    else:
        single(where)
    print("OK", flush=True)
