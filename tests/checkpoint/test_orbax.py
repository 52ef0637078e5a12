"""Orbax checkpoints both ways: fcir restores what Orbax 0.12 writes (OCDBT, zarr v2/v3,
manager steps); Orbax's StandardCheckpointer restores what `format="orbax"` writes."""

from __future__ import annotations

import io
import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ckpt_testing import same_bits, values
from fcir.checkpoint import inspect as ckpt_inspect
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from fcir import checkpoint
from fcir.errors import CheckpointError

ocp = pytest.importorskip("orbax.checkpoint", reason="orbax-checkpoint is in the test extra")


def _tree(devices):
    mesh = jax.make_mesh((8,), ("x",), devices=devices)
    mesh24 = jax.make_mesh((2, 4), ("a", "b"), devices=devices)
    return {
        "w": jax.device_put(values((64, 24), seed=1), NamedSharding(mesh, P("x"))),
        "m": jax.device_put(
            values((16, 8), "bfloat16", seed=2), NamedSharding(mesh24, P("b", "a"))
        ),
        "nested": {"h": values((6,), "int32", seed=3), "r": jax.device_put(values((5,), seed=4))},
        "layers": [jax.device_put(values((4, 4), seed=5)), jax.device_put(values((3,), seed=6))],
        "n": 7,
    }


def _other_target(tree, devices):
    """Every array onto a sharding other than the saved one."""
    mesh42 = jax.make_mesh((4, 2), ("p", "q"), devices=devices)
    rev = jax.sharding.Mesh(np.array(devices[::-1]), ("x",))

    def spec(a, sharding):
        return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding)

    return {
        "w": spec(tree["w"], NamedSharding(mesh42, P("q", "p"))),
        "m": spec(tree["m"], NamedSharding(rev, P(None, "x"))),
        "nested": {
            "h": np.zeros(6, np.int32),
            "r": spec(tree["nested"]["r"], NamedSharding(rev, P())),
        },
        "layers": [spec(a, NamedSharding(rev, P())) for a in tree["layers"]],
        "n": 0,
    }


def _same(got, want):
    flat_got, flat_want = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(flat_got) == len(flat_want)
    for g, w in zip(flat_got, flat_want):
        assert same_bits(np.asarray(g), np.asarray(w))


def _orbax_save(path, tree, **handler):
    ckptr = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(**handler))
    ckptr.save(path, args=ocp.args.PyTreeSave(tree))


@pytest.mark.parametrize(
    "handler",
    [{}, {"use_zarr3": True}, {"use_ocdbt": False}],
    ids=["ocdbt-zarr2", "ocdbt-zarr3", "zarr2-directories"],
)
def test_fcir_restores_an_orbax_checkpoint_onto_other_shardings(tmp_path, devices, handler):
    tree = _tree(devices)
    _orbax_save(tmp_path / "ox", tree, **handler)
    target = _other_target(tree, devices)
    out = checkpoint.restore(tmp_path / "ox", {"default": target})["default"]
    _same(out, tree)
    assert out["w"].sharding == target["w"].sharding
    assert out["m"].sharding == target["m"].sharding and out["m"].dtype == jnp.bfloat16
    assert out["n"] == 7 and isinstance(out["n"], int)
    host = checkpoint.restore(tmp_path / "ox")["default"]  # no target: numpy, lists kept
    _same(host, tree)
    assert isinstance(host["layers"], list) and host["n"] == 7


def test_restoring_an_orbax_checkpoint_reads_only_each_devices_slice(
    tmp_path, devices, monkeypatch
):
    """One device's target box of a sharded array is all that is read of it."""
    import tensorstore as ts

    tree = _tree(devices)
    _orbax_save(tmp_path / "ox", tree)
    boxes = []
    real_open = ts.open

    class Recording:
        def __init__(self, store):
            self.store = store
            self.shape, self.dtype, self.ndim = store.shape, store.dtype, store.ndim

        def __getitem__(self, index):
            boxes.append(index)
            return self.store[index]

    def recording_open(*a, **k):
        fut = real_open(*a, **k)

        class F:
            def result(self):
                return Recording(fut.result())

        return F()

    monkeypatch.setattr(ts, "open", recording_open)
    mesh = jax.make_mesh((8,), ("x",), devices=devices)
    spec = jax.ShapeDtypeStruct((64, 24), np.float32, sharding=NamedSharding(mesh, P("x")))
    out = checkpoint.restore(tmp_path / "ox", {"default": {"w": spec}})["default"]
    _same(out["w"], tree["w"])
    assert sorted(b[0].start for b in boxes) == list(range(0, 64, 8))
    assert all(b[0].stop - b[0].start == 8 for b in boxes)


def test_an_orbax_manager_step_restores_as_items(tmp_path, devices):
    tree = _tree(devices)
    mgr = ocp.CheckpointManager(tmp_path / "run")
    mgr.save(
        3,
        args=ocp.args.Composite(
            default=ocp.args.StandardSave(tree),
            opt=ocp.args.StandardSave({"mu": np.arange(4.0)}),
            meta=ocp.args.JsonSave({"round": 3}),
        ),
    )
    mgr.wait_until_finished()
    out = checkpoint.restore(tmp_path / "run" / "3", {"default": _other_target(tree, devices)})
    _same(out["default"], tree)
    rest = checkpoint.restore(tmp_path / "run" / "3", items=["opt", "meta"])
    assert same_bits(rest["opt"]["mu"], np.arange(4.0)) and rest["meta"] == {"round": 3}
    with pytest.raises(CheckpointError, match=r"no item\(s\) \['params'\].*'default'"):
        checkpoint.restore(tmp_path / "run" / "3", items=["params"])
    fmgr = checkpoint.CheckpointManager(tmp_path / "run")  # fcir's manager sees Orbax's steps
    assert fmgr.latest_step() == 3
    assert fmgr.restore(items=["meta"]) == {"meta": {"round": 3}}


def test_orbax_standard_checkpointer_restores_what_fcir_saves_as_orbax(tmp_path, devices):
    tree = _tree(devices)
    checkpoint.save(tmp_path / "one", {"default": tree}, format="orbax")
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)
    got = ocp.StandardCheckpointer().restore(tmp_path / "one", abstract)
    _same(got, tree)
    assert got["w"].sharding == tree["w"].sharding
    _same(checkpoint.restore(tmp_path / "one", {"default": abstract})["default"], tree)


def test_several_items_saved_as_orbax_are_subfolders_an_orbax_manager_restores(tmp_path, devices):
    tree = _tree(devices)
    opt = {"mu": jax.device_put(values((8, 3), seed=9))}
    checkpoint.save(
        tmp_path / "run" / "5",
        {"params": tree, "opt": opt, "meta": {"round": 5}},
        format="orbax",
    )
    assert {p.name for p in (tmp_path / "run" / "5").iterdir()} >= {"params", "opt", "meta"}
    mgr = ocp.CheckpointManager(tmp_path / "run")
    assert mgr.latest_step() == 5
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)
    got = mgr.restore(
        5,
        args=ocp.args.Composite(
            params=ocp.args.StandardRestore(abstract),
            opt=ocp.args.StandardRestore(jax.tree.map(ocp.utils.to_shape_dtype_struct, opt)),
            meta=ocp.args.JsonRestore(),
        ),
    )
    _same(got["params"], tree)
    _same(got["opt"], opt)
    assert got["meta"] == {"round": 5}
    back = checkpoint.restore(tmp_path / "run" / "5")
    _same(back["params"], tree)
    _same(back["opt"], opt)
    assert back["meta"] == {"round": 5}
    assert checkpoint.CheckpointManager(tmp_path / "run").latest_step() == 5
    fmgr = checkpoint.CheckpointManager(tmp_path / "run", format="orbax", max_to_keep=1)
    fmgr.save(6, {"params": tree, "opt": opt, "meta": {"round": 6}}, blocking=True)
    assert fmgr.all_steps() == [6]
    assert ocp.CheckpointManager(tmp_path / "run").all_steps() == [6]


def test_fcir_catches_every_flipped_byte_of_an_orbax_format_checkpoint(tmp_path, devices):
    tree = {"default": {"w": _tree(devices)["w"]}}
    checkpoint.save(tmp_path / "c", tree, format="orbax")
    chunk = tmp_path / "c" / "w" / "3.0"
    size = chunk.stat().st_size
    for offset in range(0, size, 37):
        data = bytearray(chunk.read_bytes())
        data[offset] ^= 0x04
        chunk.write_bytes(bytes(data))
        with pytest.raises(CheckpointError, match=r"'default/w'.*w/3\.0.*checksum mismatch"):
            checkpoint.restore(tmp_path / "c")
        data[offset] ^= 0x04
        chunk.write_bytes(bytes(data))
    _same(checkpoint.restore(tmp_path / "c")["default"], tree["default"])


def test_shards_of_unequal_shapes_cannot_be_orbax_chunks(tmp_path, devices):
    """jax shards evenly, but a layout whose shards differ cannot be zarr chunks."""
    from fcir.checkpoint import orbax

    from fcir._proto import checkpoint_pb2 as pb

    mesh = jax.make_mesh((8,), ("x",), devices=devices)
    checkpoint.save(
        tmp_path / "c",
        {"default": {"u": jax.device_put(np.arange(16.0), NamedSharding(mesh, P("x")))}},
    )
    lay = checkpoint.read_layout(tmp_path / "c")
    shards = lay.items[0].arrays.arrays[0].shards
    del shards[0].index[:]
    shards[0].index.append(pb.IndexRange(start=0, stop=3))
    with pytest.raises(CheckpointError, match=r"'default/u'.*shards of different shapes"):
        orbax.metadata_files(lay)


def test_fcir_ckpt_inspect_reads_both_formats(tmp_path, devices):
    import argparse

    tree = _tree(devices)
    _orbax_save(tmp_path / "ox", tree)
    checkpoint.save(tmp_path / "fx", {"default": tree}, format="orbax")

    def run(path, as_json=False):
        out = io.StringIO()
        args = argparse.Namespace(directory=str(path), no_verify=False, shards=False, json=as_json)
        return ckpt_inspect.run(args, out), out.getvalue()

    code, text = run(tmp_path / "ox")
    assert code == 0 and "format: Orbax" in text
    assert re.search(r"default/w +float32 +\[64, 24\]", text), text
    assert "OCDBT, zarr v2" in text and "every array read" in text
    code, text = run(tmp_path / "ox", as_json=True)
    doc = json.loads(text)
    assert code == 0 and doc["format"] == "orbax" and doc["integrity"]["bytes_read"] > 6000
    assert {
        "path": "default/w",
        "dtype": "float32",
        "shape": [64, 24],
        "storage": "OCDBT, zarr v2",
    } in doc["items"]["default"]
    code, text = run(tmp_path / "fx")
    assert code == 0 and "with fcir's layout and checksums" in text and "integrity: OK" in text


def test_format_must_be_fcir_or_orbax(tmp_path):
    with pytest.raises(CheckpointError, match="format must be 'fcir' or 'orbax'"):
        checkpoint.save(tmp_path / "c", {"a": np.ones(2)}, format="zarr")
    assert not os.listdir(tmp_path)


def test_replicated_partly_replicated_one_device_and_0d_arrays_saved_as_orbax_restore_in_orbax(
    tmp_path, devices
):
    mesh24 = jax.make_mesh((2, 4), ("a", "b"), devices=devices)
    tree = {
        "replicated": jax.device_put(values((3, 4), seed=1), NamedSharding(mesh24, P())),
        "half": jax.device_put(values((8, 4), seed=2), NamedSharding(mesh24, P("a"))),
        "cols": jax.device_put(values((4, 8), seed=3), NamedSharding(mesh24, P(None, "b"))),
        "dev3": jax.device_put(values((5,), "int32", seed=4), devices[3]),
        "zero_d": jax.device_put(np.float32(2.5), NamedSharding(mesh24, P())),
        "empty": jax.device_put(np.zeros((0, 8), np.float32), NamedSharding(mesh24, P(None, "b"))),
    }
    checkpoint.save(tmp_path / "c", {"default": tree}, format="orbax")
    chunks = {p.name for p in (tmp_path / "c" / "half").iterdir()}
    assert chunks == {".zarray", "0.0", "1.0"}  # each distinct block once
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)
    got = ocp.StandardCheckpointer().restore(tmp_path / "c", abstract)
    _same(got, tree)
    assert all(got[k].sharding == tree[k].sharding for k in tree)
    _same(checkpoint.restore(tmp_path / "c")["default"], tree)
