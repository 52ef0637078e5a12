"""Differentiating a program, and tracing it, on a mesh with ``Explicit`` axes.

Under Explicit axes a value's type carries its layout and JAX checks it: a cotangent
must be typed like its primal ("Expected cotangent type f32[8@clients,3] but got
f32[8,3]"), and the operands vmap maps together alike. The fed ops' rules bind
``fed.broadcast`` themselves (a reduction's transpose, ``fed.min``'s tie indicator); run
eagerly (``jax.grad`` without ``jax.jit``), such a broadcast is typed as its abstract
eval says, and laid out like the placed value it meets, also where client data is
replicated instead of split over ``clients``.

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
from jax.sharding import AxisType, NamedSharding, PartitionSpec

import fcir

EIGHT_DEVICES = Child(pathlib.Path(__file__).resolve(), "FCIR_EXPLICIT_MESH_AUTODIFF_TESTS")
on_8_devices = EIGHT_DEVICES.on_8_devices
test_on_8_simulated_devices = EIGHT_DEVICES.waiting_test()
CLIENTS = 8


def _local(w, x):
    return jnp.tanh(w * x)


# Each reduces placed ``v``; ``u`` is another placed value laid out like it (weights).
REDUCTIONS = {
    "sum": lambda v, u: fcir.reduce_sum(v),
    "mean": lambda v, u: fcir.reduce_mean(v),
    "min": lambda v, u: fcir.reduce_min(v),
    "max": lambda v, u: fcir.reduce_max(v),
    "weighted_mean": lambda v, u: fcir.reduce_weighted_mean(v, u),
    "median": lambda v, u: fcir.reduce_median(v),
    "trimmed_mean": lambda v, u: fcir.reduce_trimmed_mean(v, trim=1),
    "dp_mean": lambda v, u: fcir.dp_mean(v, 1.0, 0.5, jax.random.key(0)),
}


def _round(reduce, *, mapped: bool):
    """A round ending in ``reduce``: of the clients' work (``mapped``), or of the client
    data itself, laid out as it came (the frontend lays out only what map_fn and
    broadcast touch)."""

    @fcir.program(placements={"clients": CLIENTS})
    def round_(w, x):
        if mapped:
            v = fcir.map_fn(_local, (fcir.broadcast(w), x))
            return reduce(v, fcir.map_fn(lambda a: a * a + 1.0, v))
        return reduce(x * 1.0, x * x + 1.0) * w

    return round_


def _args():
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.normal(size=(3,)), jnp.float32)
    x = jnp.asarray(rng.normal(size=(CLIENTS, 3)), jnp.float32)
    return w, x


def _explicit_mesh():
    return jax.make_mesh((CLIENTS,), ("clients",), axis_types=(AxisType.Explicit,))


# Under jax.jit a broadcast is typed from the abstract mesh in context: only client data
# left replicated then met a transpose's broadcast split over clients.
WAYS = [
    pytest.param("split over clients", False, id="eager-split"),
    pytest.param("replicated", False, id="eager-replicated"),
    pytest.param("replicated", True, id="jit-replicated"),
]


@on_8_devices
@pytest.mark.parametrize(("layout", "jitted"), WAYS)
@pytest.mark.parametrize("name", list(REDUCTIONS))
def test_grad_under_set_mesh_types_each_cotangent_like_its_primal(name, layout, jitted):
    split = layout == "split over clients"
    fn = _round(REDUCTIONS[name], mapped=split)
    grad = jax.grad(lambda w, x: jnp.sum(fn(w, x) ** 2), argnums=(0, 1))
    w, x = _args()
    want = grad(w, x)  # one device, no mesh
    mesh = _explicit_mesh()
    spec = PartitionSpec("clients") if split else PartitionSpec()
    placed = jax.device_put(x, NamedSharding(mesh, spec))
    with jax.set_mesh(mesh):
        got = (jax.jit(grad) if jitted else grad)(w, placed)
    for g, v in zip(want, got):
        np.testing.assert_allclose(np.asarray(v), np.asarray(g), rtol=2e-5, atol=1e-6)
    assert jax.typeof(got[1]).sharding.spec == jax.typeof(placed).sharding.spec


@on_8_devices
def test_jit_of_client_data_on_the_mesh_outside_set_mesh_says_to_set_the_mesh():
    fn = _round(REDUCTIONS["mean"], mapped=True)
    w, x = _args()
    mesh = _explicit_mesh()
    placed = jax.device_put(x, NamedSharding(mesh, PartitionSpec("clients")))
    with pytest.raises(fcir.PlacementError) as e:
        jax.jit(fn)(w, placed)
    message = str(e.value)
    assert "with jax.set_mesh(mesh):" in message and "axis named 'clients'" in message
    assert "add a mesh axis" not in message  # the mesh has one
    with jax.set_mesh(mesh):  # what the message says to do
        got = jax.jit(fn)(w, placed)
    np.testing.assert_allclose(got, fn(w, x), rtol=1e-6, atol=1e-6)
