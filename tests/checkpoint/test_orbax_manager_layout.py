"""A step of `CheckpointManager(..., format="orbax")` is laid out as Orbax's
CheckpointManager lays it out (`<step>/<item>/`, even for one item), so each manager
restores the other's steps; steps fcir wrote before (one item in the step itself)
still restore in fcir."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from ckpt_testing import same_bits, values
from fcir.checkpoint import orbax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from fcir import checkpoint

ocp = pytest.importorskip("orbax.checkpoint", reason="orbax-checkpoint is in the test extra")


def _state(devices):
    mesh = jax.make_mesh((8,), ("x",), devices=devices)
    return {
        "w": jax.device_put(values((16, 4), seed=1), NamedSharding(mesh, P("x"))),
        "b": jax.device_put(values((4,), seed=2)),
        "step": 7,
    }


def _abstract(tree):
    return jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)


def _same(got, want):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert same_bits(np.asarray(g), np.asarray(w))


def test_a_one_item_step_saved_as_orbax_is_in_its_item_folder_and_orbax_manager_restores_it(
    tmp_path, devices
):
    state = _state(devices)
    mgr = checkpoint.CheckpointManager(tmp_path / "run", format="orbax")
    mgr.save(0, {"state": state})
    mgr.wait_until_finished()
    step = tmp_path / "run" / "0"
    assert (step / "state" / "_METADATA").is_file() and (step / "state" / "w" / ".zarray").is_file()
    assert not (step / "_METADATA").exists() and not (step / "w").exists()

    omgr = ocp.CheckpointManager(tmp_path / "run")
    assert omgr.all_steps() == [0]
    got = omgr.restore(0, args=ocp.args.Composite(state=ocp.args.StandardRestore(_abstract(state))))
    omgr.close()
    _same(got["state"], state)
    assert got["state"]["w"].sharding == state["w"].sharding
    _same(mgr.restore(0, {"state": _abstract(state)})["state"], state)
    _same(checkpoint.restore(step)["state"], jax.tree.map(np.asarray, state))


def test_a_lone_json_item_goes_into_its_folder_as_orbax_json_save_writes_it(tmp_path):
    mgr = checkpoint.CheckpointManager(tmp_path / "run", format="orbax")
    mgr.save(2, {"meta": {"round": 2}}, blocking=True)
    assert (tmp_path / "run" / "2" / "meta" / "metadata").is_file()
    omgr = ocp.CheckpointManager(tmp_path / "run")
    assert omgr.restore(2, args=ocp.args.Composite(meta=ocp.args.JsonRestore())) == {
        "meta": {"round": 2}
    }
    omgr.close()
    assert mgr.restore(2) == {"meta": {"round": 2}}


def test_fcir_manager_restores_one_item_steps_orbax_manager_wrote_and_saves_beside_them(
    tmp_path, devices
):
    state = _state(devices)
    omgr = ocp.CheckpointManager(tmp_path / "run")
    omgr.save(1, args=ocp.args.Composite(state=ocp.args.StandardSave(state)))
    omgr.save(2, args=ocp.args.Composite(state=ocp.args.StandardSave(state)))
    omgr.wait_until_finished()
    omgr.close()
    unnamed = ocp.CheckpointManager(tmp_path / "unnamed")
    unnamed.save(1, args=ocp.args.StandardSave(state))  # Orbax's single item "default"
    unnamed.wait_until_finished()
    unnamed.close()
    assert (tmp_path / "unnamed" / "1" / "default" / "_METADATA").is_file()
    got = checkpoint.CheckpointManager(tmp_path / "unnamed").restore(
        1, {"default": _abstract(state)}
    )
    _same(got["default"], state)

    mgr = checkpoint.CheckpointManager(tmp_path / "run", format="orbax", max_to_keep=2)
    assert mgr.all_steps() == [1, 2]
    _same(mgr.restore(1, {"state": _abstract(state)})["state"], state)
    mgr.save(3, {"state": jax.tree.map(lambda a: a + 1, state)}, blocking=True)
    assert mgr.all_steps() == [2, 3]
    omgr = ocp.CheckpointManager(tmp_path / "run")
    assert omgr.all_steps() == [2, 3]
    got = omgr.restore(3, args=ocp.args.Composite(state=ocp.args.StandardRestore(_abstract(state))))
    omgr.close()
    _same(got["state"], jax.tree.map(lambda a: a + 1, state))


def test_a_one_item_step_in_the_older_layout_still_restores_in_fcirs_manager(tmp_path, devices):
    """Before, fcir's manager wrote a one-item Orbax step into the step itself, as a
    plain `save` still does; those steps stay readable."""
    state = _state(devices)
    checkpoint.save(tmp_path / "run" / "4", {"state": state}, format="orbax")
    assert (tmp_path / "run" / "4" / "_METADATA").is_file()
    old = checkpoint.read_layout(tmp_path / "run" / "4")
    assert not orbax.in_item_folders(old)
    mgr = checkpoint.CheckpointManager(tmp_path / "run", format="orbax")
    assert mgr.latest_step() == 4
    _same(mgr.restore(4, {"state": _abstract(state)})["state"], state)
    mgr.save(5, {"state": state}, blocking=True)
    assert orbax.in_item_folders(checkpoint.read_layout(tmp_path / "run" / "5"))
    assert set(orbax.metadata_files(old)) == set(orbax.metadata_files(old, item_folders=False))
    _same(mgr.restore(5, {"state": _abstract(state)})["state"], state)
