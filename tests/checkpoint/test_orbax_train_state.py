"""Orbax checkpoints of a whole optax-style train state, as training code makes them:
None leaves and empty subtrees (optax's EmptyState), typed and raw PRNG keys, scalars,
bf16 and int leaves; fcir restores them, and refuses a mismatched target."""

from __future__ import annotations

import io

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from ckpt_testing import same_bits, values
from fcir.checkpoint import inspect as ckpt_inspect
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from fcir import checkpoint
from fcir.errors import CheckpointError

ocp = pytest.importorskip("orbax.checkpoint", reason="orbax-checkpoint is in the test extra")


def _standard_save(path, tree):
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(path, tree)
    ckptr.wait_until_finished()  # it commits in the background
    ckptr.close()


SAVERS = {
    "standard": _standard_save,
    "pytree-ocdbt-zarr3": lambda path, tree: ocp.Checkpointer(
        ocp.PyTreeCheckpointHandler(use_zarr3=True)
    ).save(path, args=ocp.args.PyTreeSave(tree)),
    "pytree-directories": lambda path, tree: ocp.Checkpointer(
        ocp.PyTreeCheckpointHandler(use_ocdbt=False)
    ).save(path, args=ocp.args.PyTreeSave(tree)),
}


def _train_state(devices):
    mesh = jax.make_mesh((8,), ("x",), devices=devices)
    params = {
        "dense": {
            "kernel": jax.device_put(values((64, 8), seed=1), NamedSharding(mesh, P("x"))),
            "bias": jnp.asarray(values((8,), "bfloat16", seed=2)),
        }
    }
    return {
        "step": jnp.asarray(12, jnp.int32),
        "params": params,
        "opt_state": optax.adam(1e-3).init(params),  # (ScaleByAdamState, EmptyState())
        "key": jax.random.key(7),
        "raw_key": jax.random.PRNGKey(8),
        "lr": 0.25,
        "epoch": 3,
        "ema": None,
        "extra": {},
    }


def _key_bits(x):
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return np.asarray(jax.random.key_data(x))
    return np.asarray(x)


def _same_leaves(got, want):
    got_leaves, want_leaves = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(got_leaves) == len(want_leaves)
    for g, w in zip(got_leaves, want_leaves):
        assert same_bits(_key_bits(g), _key_bits(w))


@pytest.fixture(params=list(SAVERS))
def saved(request, tmp_path, devices):
    state = _train_state(devices)
    ckptr_path = tmp_path / "ox"
    SAVERS[request.param](ckptr_path, state)
    return ckptr_path, state


def test_a_train_state_orbax_saved_restores_without_a_target_with_empty_leaves_and_typed_keys(
    saved,
):
    path, state = saved
    out = checkpoint.restore(path)["default"]
    assert out["ema"] is None and out["extra"] == {}
    assert out["opt_state"][1] is None  # optax's EmptyState: an empty namedtuple
    assert jax.dtypes.issubdtype(out["key"].dtype, jax.dtypes.prng_key)
    assert same_bits(jax.random.key_data(out["key"]), jax.random.key_data(state["key"]))
    assert out["raw_key"].dtype == np.uint32  # raw keys are plain data
    assert out["lr"] == 0.25 and out["epoch"] == 3 and isinstance(out["epoch"], int)
    adam = state["opt_state"][0]
    assert same_bits(out["opt_state"][0]["mu"]["dense"]["bias"], adam.mu["dense"]["bias"])
    assert same_bits(out["opt_state"][0]["count"], adam.count)
    assert same_bits(out["params"]["dense"]["kernel"], state["params"]["dense"]["kernel"])


def test_a_train_state_orbax_saved_restores_into_its_abstract_state_on_another_sharding(
    saved, devices
):
    path, state = saved
    other = jax.sharding.Mesh(np.array(devices[::-1]).reshape(2, 4), ("a", "b"))

    def abstract(x):
        if not isinstance(x, jax.Array):
            return x  # Python scalars are their own target
        spec = P("b") if x.ndim == 2 else P()
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(other, spec))

    target = jax.tree.map(abstract, state)
    out = checkpoint.restore(path, {"default": target})["default"]
    assert jax.tree.structure(out) == jax.tree.structure(state)
    _same_leaves(out, state)
    assert out["key"].dtype == state["key"].dtype
    assert out["key"].sharding == target["key"].sharding
    kernel = out["params"]["dense"]["kernel"]
    assert kernel.sharding == target["params"]["dense"]["kernel"].sharding


def test_fcir_ckpt_inspect_lists_an_orbax_train_state_with_its_keys(saved):
    path, _ = saved
    out = io.StringIO()
    args = ckpt_inspect.build_parser().parse_args([str(path)])
    assert ckpt_inspect.run(args, out) == 0
    text = out.getvalue()
    assert "default/key " in text and "key<fry>" in text
    assert "default/ema" not in text  # a None leaf holds no array


def test_a_typed_key_target_for_plain_saved_data_is_an_error_not_a_type_error(tmp_path):
    SAVERS["pytree-directories"](tmp_path / "ox", {"raw_key": jax.random.PRNGKey(0)})
    typed = jax.ShapeDtypeStruct((2,), jax.random.key(0).dtype)
    with pytest.raises(CheckpointError, match=r"raw_key.*PRNG keys.*plain uint32.*wrap_key_data"):
        checkpoint.restore(tmp_path / "ox", {"default": {"raw_key": typed}})


def test_typed_keys_saved_by_orbax_restore_only_into_key_targets(tmp_path):
    SAVERS["pytree-directories"](tmp_path / "ox", {"key": jax.random.key(0)})
    with pytest.raises(CheckpointError, match=r"'default/key' holds PRNG keys"):
        checkpoint.restore(tmp_path / "ox", {"default": {"key": np.zeros(2, np.uint32)}})


def test_an_int_target_for_a_saved_float_scalar_is_an_error_not_a_truncation(tmp_path):
    SAVERS["pytree-directories"](tmp_path / "ox", {"lr": 2.5})
    with pytest.raises(CheckpointError, match=r"'default/lr'.*Python int.*float64.*cast=True"):
        checkpoint.restore(tmp_path / "ox", {"default": {"lr": 0}})
    assert checkpoint.restore(tmp_path / "ox", {"default": {"lr": 0}}, cast=True)["default"] == {
        "lr": 2
    }


def test_items_given_as_a_string_is_an_error_for_orbax_checkpoints_too(tmp_path):
    SAVERS["pytree-directories"](tmp_path / "ox", {"w": np.arange(3.0)})
    with pytest.raises(CheckpointError, match="items must be a list of item names"):
        checkpoint.restore(tmp_path / "ox", items="default")


# -- the reverse: what fcir saves with format="orbax", restored by Orbax ---------------


def _abstract(tree):
    return jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)


def test_orbax_restores_an_fcir_saved_train_state_into_its_abstract_state(tmp_path, devices):
    """Orbax checks the target's structure against its tree metadata, which must list
    the None leaves and empty subtrees (optax's EmptyState) that hold no array, and
    wraps key data back into typed keys only where its array metadata names the impl."""
    state = _train_state(devices)
    checkpoint.save(tmp_path / "f", {"default": state}, format="orbax")
    got = ocp.StandardCheckpointer().restore(tmp_path / "f", _abstract(state))
    assert jax.tree.structure(got) == jax.tree.structure(state)
    _same_leaves(got, state)
    assert got["key"].dtype == state["key"].dtype
    kernel = state["params"]["dense"]["kernel"]
    assert got["params"]["dense"]["kernel"].sharding == kernel.sharding


def test_orbax_restores_an_fcir_saved_train_state_without_arguments_onto_its_shardings(
    tmp_path, devices
):
    """Without a target Orbax takes each array's sharding from its `_sharding` file."""
    mesh = jax.make_mesh((2, 4), ("a", "b"), devices=devices)
    tree = {
        "w": jax.device_put(values((8, 4), seed=4), NamedSharding(mesh, P(("a", "b")))),
        "v": jax.device_put(values((8,), seed=5), NamedSharding(mesh, P("b"))),
        "on3": jax.device_put(values((3,), seed=6), devices[3]),
        "key": jax.random.key(2),
        "host": values((4,), "int32", seed=7),
    }
    checkpoint.save(tmp_path / "f", {"default": tree}, format="orbax")
    with pytest.warns(UserWarning, match="sharding file"):  # Orbax's own notice
        got = ocp.PyTreeCheckpointer().restore(tmp_path / "f")
    _same_leaves(got, tree)
    for name in ("w", "v", "on3"):
        assert got[name].sharding.is_equivalent_to(tree[name].sharding, tree[name].ndim), name
    assert got["key"].dtype == tree["key"].dtype


def test_an_orbax_manager_restores_an_fcir_saved_step_of_a_train_state(tmp_path, devices):
    state = _train_state(devices)
    checkpoint.save(tmp_path / "run" / "4", {"state": state, "meta": {"epoch": 3}}, format="orbax")
    mgr = ocp.CheckpointManager(tmp_path / "run")
    got = mgr.restore(
        4,
        args=ocp.args.Composite(
            state=ocp.args.StandardRestore(_abstract(state)), meta=ocp.args.JsonRestore()
        ),
    )
    mgr.close()
    assert got["meta"] == {"epoch": 3}
    assert jax.tree.structure(got["state"]) == jax.tree.structure(state)
    _same_leaves(got["state"], state)
