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
