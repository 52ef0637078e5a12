"""Checkpoints of arrays held in the default device's memory (a TPU's HBM in the device
tier, docs/contributing.md; host memory on a CPU): saved and restored onto that device
bit for bit, asynchronously with the device buffers reused while the write goes on, and
in Orbax's format. The other checkpoint tests run on 8 simulated CPU devices."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ckpt_testing import same_bits, values
from jax.sharding import SingleDeviceSharding

from fcir import checkpoint


@pytest.fixture(scope="module")
def device():
    return jax.devices()[0]


def model_and_adam_state(device) -> dict:
    """A small model and an Adam state as optax lays it out (count, mu, nu), in the
    dtypes training keeps: float32 and bfloat16 weights, an int32 count."""
    params = {
        "embed": values((256, 64), "bfloat16", seed=1),
        "dense": {"w": values((64, 128), seed=2), "b": values((128,), seed=3)},
    }
    zeros = jax.tree.map(np.zeros_like, params)
    tree = {
        "params": params,
        "opt": {"count": np.int32(7), "mu": jax.tree.map(lambda z: z + 1, zeros), "nu": zeros},
    }
    return jax.device_put(tree, device)


def on(device, tree) -> dict:
    sharding = SingleDeviceSharding(device)
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)


def assert_same(restored, saved, device) -> None:
    got, want = jax.tree.leaves(restored), jax.tree.leaves(saved)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert isinstance(g, jax.Array) and g.devices() == {device}
        assert same_bits(g, w)


def test_a_model_and_its_adam_state_in_device_memory_restore_bit_for_bit(tmp_path, device):
    tree = model_and_adam_state(device)
    checkpoint.save(tmp_path / "c", {"state": tree})
    restored = checkpoint.restore(tmp_path / "c", {"state": on(device, tree)})["state"]
    assert_same(restored, tree, device)


def test_an_async_save_keeps_the_values_of_the_call_while_the_device_moves_on(tmp_path, device):
    x = jax.device_put(values((512, 1024), seed=4), device)  # 2 MiB in device memory
    want = np.asarray(x)
    handle = checkpoint.save(tmp_path / "c", {"x": x}, blocking=False)
    # The next step reuses the buffer (donated): the save holds its own host copy.
    step = jax.jit(lambda a: a * 0.0 - 5.0, donate_argnums=0)
    step(x).block_until_ready()
    handle.wait()
    restored = checkpoint.restore(tmp_path / "c", {"x": on(device, want)})["x"]
    assert restored.devices() == {device} and same_bits(restored, want)


def test_orbax_format_from_device_memory(tmp_path, device):
    pytest.importorskip("tensorstore", reason="format='orbax' writes with tensorstore")
    tree = model_and_adam_state(device)
    checkpoint.save(tmp_path / "o", {"default": tree}, format="orbax")
    restored = checkpoint.restore(tmp_path / "o", {"default": on(device, tree)})["default"]
    assert_same(restored, tree, device)
    assert jnp.issubdtype(restored["params"]["embed"].dtype, jnp.bfloat16)
