"""The reference interpreter on values laid out over a mesh of 8 simulated devices.

Client data split over an ``Explicit`` ``clients`` axis is typed as split, and JAX
refused the oracle's per-member reads of it ("ShardingTypeError: Use
.at[...].get(out_sharding=)"), inside ``jax.set_mesh`` or not: the oracle takes such
leaves replicated over their mesh, and gives the bits it gives for the same values on
one device. A ``jax.shard_map`` over a 2-device ``model`` axis in the client function
runs on the reference and streamed (test_shard_map_regions.py has it on one device).

``test_on_8_simulated_devices`` runs the other tests of this file in a fresh process
with 8 simulated CPU devices (tests/eight_devices.py).
"""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from eight_devices import Child
from fcir.interpreters import reference, xla
from jax.sharding import AxisType, NamedSharding, PartitionSpec
from test_shard_map_regions import model_parallel_args, model_parallel_round

import fcir

EIGHT_DEVICES = Child(pathlib.Path(__file__).resolve(), "FCIR_REFERENCE_ON_A_MESH_TESTS")
on_8_devices = EIGHT_DEVICES.on_8_devices
test_on_8_simulated_devices = EIGHT_DEVICES.waiting_test()
CLIENTS = 8


def _local_step(w, x, y):
    grad = x.T @ (x @ w - y) / x.shape[0]
    return w - 0.1 * grad


@fcir.program(placements={"clients": CLIENTS})
def _round(w, x, y):
    return fcir.reduce_mean(fcir.map_fn(_local_step, (fcir.broadcast(w), x, y)))


def _loss(w, x, y):
    return jnp.sum(_round(w, x, y) ** 2)


def _args():
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.normal(size=(4, 1)), jnp.float32)
    x = jnp.asarray(rng.normal(size=(CLIENTS, 16, 4)), jnp.float32)
    y = jnp.asarray(rng.normal(size=(CLIENTS, 16, 1)), jnp.float32)
    return w, x, y


def _bitwise(a, b) -> None:
    for p, q in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert np.asarray(p).tobytes() == np.asarray(q).tobytes()


@on_8_devices
@pytest.mark.parametrize("in_context", [False, True], ids=["outside set_mesh", "inside"])
@pytest.mark.parametrize("program", ["round", "captured gradient"])
def test_reference_runs_client_data_split_over_an_explicit_axis(program, in_context):
    w, x, y = _args()
    fn = _round if program == "round" else jax.grad(_loss, argnums=(0, 1))
    module = fcir.capture(fn, w, x, y)
    want = reference.run(module, w, x, y)  # one device
    mesh = jax.make_mesh((CLIENTS,), ("clients",), axis_types=(AxisType.Explicit,))
    split = NamedSharding(mesh, PartitionSpec("clients"))
    x, y = jax.device_put(x, split), jax.device_put(y, split)
    if in_context:
        with jax.set_mesh(mesh):
            got = reference.run(module, w, x, y)
    else:
        got = reference.run(module, w, x, y)
    _bitwise(got, want)


@on_8_devices
def test_a_shard_map_over_two_devices_in_the_client_function_runs_on_the_reference():
    fn, args = model_parallel_round(2), model_parallel_args()
    module, want = fcir.capture(fn, *args), jax.jit(fn)(*args)
    np.testing.assert_allclose(reference.run(module, *args), want, rtol=1e-6, atol=1e-6)
    streamed = xla.compile(module, clients_per_step=2)(*args)
    np.testing.assert_allclose(streamed, want, rtol=1e-6, atol=1e-6)
