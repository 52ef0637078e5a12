"""Calling an executable compiled for a mesh with ``Explicit`` axes (``jax.make_mesh``'s
default) outside ``jax.set_mesh``: forward and under ``jax.grad``, ``jax.vjp``.

JAX differentiates values typed by Explicit axes only inside ``jax.set_mesh``: outside,
the cotangent of a loss built from them is laid out over the mesh on one device and
JAX refuses ("Length of device assignment 1 is not equal to the size of the mesh 8").
Called there, the executable returns its results on the same devices and layout with
``Auto`` axis types, and takes them back: the gradients are bitwise those computed
inside ``jax.set_mesh``.

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
from fcir.interpreters import xla
from jax.sharding import AxisType, NamedSharding, PartitionSpec

import fcir

EIGHT_DEVICES = Child(pathlib.Path(__file__).resolve(), "FCIR_XLA_MESH_CALLS_TESTS")
on_8_devices = EIGHT_DEVICES.on_8_devices
test_on_8_simulated_devices = EIGHT_DEVICES.waiting_test()
CLIENTS = 8


def _local_step(w, x, y):
    grad = x.T @ (x @ w - y) / x.shape[0]
    return w - 0.1 * grad, jnp.sum((x @ w - y) ** 2)


@fcir.program(placements={"clients": CLIENTS})
def _round(w, x, y):
    new_w, loss = fcir.map_fn(_local_step, (fcir.broadcast(w), x, y))
    return fcir.reduce_mean(new_w), fcir.reduce_sum(loss), fcir.reduce_max(new_w)


def _args():
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.normal(size=(4, 1)), jnp.float32)
    x = jnp.asarray(rng.normal(size=(CLIENTS, 16, 4)), jnp.float32)
    y = jnp.asarray(rng.normal(size=(CLIENTS, 16, 1)), jnp.float32)
    return w, x, y


def _executable(streamed: bool):
    w, x, y = _args()
    mesh = jax.make_mesh((CLIENTS,), ("clients",), axis_types=(AxisType.Explicit,))
    module = fcir.capture(_round, w, x, y)
    exe = xla.compile(module, mesh=mesh, clients_per_step=1 if streamed else None)
    return exe, mesh


def _bitwise(a, b) -> None:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    for i, (p, q) in enumerate(zip(la, lb)):
        p, q = np.asarray(p), np.asarray(q)
        assert p.dtype == q.dtype and p.shape == q.shape, i
        assert p.tobytes() == q.tobytes(), f"leaf {i} differs by {np.max(np.abs(p - q))}"


def _ways(exe):
    """What a user differentiates: the issue's loss of one result, value_and_grad over
    the model and the client data, and a VJP seeded from a forward call's results."""
    _, _, y = _args()

    def loss(w, x):
        new_w, total, top = exe(w, x, y)
        return jnp.sum(new_w**2) + total + jnp.sum(top)

    def vjp(w, x):
        out, pull = jax.vjp(lambda w, x: exe(w, x, y), w, x)
        return pull(jax.tree.map(lambda o: 2 * o, exe(w, x, y))), out

    return {
        "grad": lambda w, x: jax.grad(lambda w: jnp.sum(exe(w, x, y)[2]))(w),
        "value_and_grad": jax.value_and_grad(loss, argnums=(0, 1)),
        "vjp": vjp,
    }


@on_8_devices
@pytest.mark.parametrize("streamed", [False, True], ids=["plain", "streamed"])
@pytest.mark.parametrize("way", ["grad", "value_and_grad", "vjp"])
def test_differentiating_outside_set_mesh_gives_the_gradient_inside_it(way, streamed):
    exe, mesh = _executable(streamed)
    w, x, _ = _args()
    f = _ways(exe)[way]
    with jax.set_mesh(mesh):
        want = f(w, x)
    _bitwise(f(w, x), want)
    # Client data already split over the mesh, as a user's input pipeline leaves it.
    on_mesh = jax.device_put(x, NamedSharding(mesh, PartitionSpec("clients")))
    _bitwise(f(w, on_mesh), want)


@on_8_devices
def test_results_returned_outside_set_mesh_are_taken_back_by_the_next_call():
    exe, mesh = _executable(streamed=False)
    w, x, y = _args()

    def train(w):
        for _ in range(3):
            w = exe(w, x, y)[0]
            w = w - 0.1 * jax.grad(lambda w: exe(w, x, y)[1])(w)
        return w

    with jax.set_mesh(mesh):
        want = train(w)
    got = train(w)
    _bitwise(got, want)
    assert got.sharding.device_set == set(mesh.devices.flat)
    assert got.sharding.spec == jax.typeof(want).sharding.spec
