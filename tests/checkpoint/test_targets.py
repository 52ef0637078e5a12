"""Restore targets fcir's own format refuses with a CheckpointError that says why."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from fcir import checkpoint
from fcir.errors import CheckpointError


def test_a_typed_key_target_for_plain_saved_data_is_a_checkpoint_error(tmp_path):
    """Raw keys (jax.random.PRNGKey) are plain uint32 data: numpy cannot even name a
    key dtype, which was a TypeError from deep inside restore."""
    checkpoint.save(tmp_path / "c", {"keys": {"k": jax.random.PRNGKey(3)}})
    typed = jax.ShapeDtypeStruct((2,), jax.random.key(0).dtype)
    with pytest.raises(CheckpointError, match=r"'keys/k'.*PRNG keys.*plain uint32.*wrap_key_data"):
        checkpoint.restore(tmp_path / "c", {"keys": {"k": typed}})
    raw = checkpoint.restore(tmp_path / "c", {"keys": {"k": np.zeros(2, np.uint32)}})
    assert (raw["keys"]["k"] == np.asarray(jax.random.PRNGKey(3))).all()


def test_typed_keys_restore_as_keys_into_the_key_data_struct_orbax_utils_make(tmp_path, devices):
    """`jax.tree.map(orbax.checkpoint.utils.to_shape_dtype_struct, state)`, the usual
    way to make an abstract state, turns typed keys into uint32 structs of their key
    data's shape; Orbax restores keys from such a target, and so does fcir."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    keys = jax.random.split(jax.random.key(4), 8)
    checkpoint.save(tmp_path / "c", {"keys": {"k": keys}})
    mesh = jax.make_mesh((8,), ("x",), devices=devices)
    physical = jax.ShapeDtypeStruct((8, 2), np.uint32, sharding=NamedSharding(mesh, P("x")))
    out = checkpoint.restore(tmp_path / "c", {"keys": {"k": physical}})["keys"]["k"]
    assert out.dtype == keys.dtype and out.shape == (8,)
    assert (jax.random.key_data(out) == jax.random.key_data(keys)).all()
    assert out.sharding.is_equivalent_to(NamedSharding(mesh, P("x")), 1)
