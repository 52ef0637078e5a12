"""The eager interpreters give jit's numbers bit for bit: the base interpreter under
jax.jit on an Explicit mesh, and a nested jit that donates an argument."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fcir.interpreters import reference
from jax.sharding import AxisType, NamedSharding, PartitionSpec

import fcir

CLIENTS = 4


def _assert_bitwise(got, want) -> None:
    got, want = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        a, b = np.asarray(a), np.asarray(b)
        assert (a.dtype, a.shape) == (b.dtype, b.shape), i
        assert a.tobytes() == b.tobytes(), f"leaf {i}: {np.max(np.abs(a - b))}"


# --- the base Interpreter under jax.jit on an Explicit mesh ------------------------------


@fcir.program(placements={"clients": CLIENTS})
def _bf16_round(w, x):
    def client(w, x):
        return jnp.sum(jnp.tanh(x.astype(jnp.bfloat16) @ w.astype(jnp.bfloat16)), 0)

    return fcir.reduce_mean(fcir.map_fn(client, (fcir.broadcast(w), x))).astype(jnp.float32)


def _loss_grad(w, x):
    return jax.grad(lambda w, x: jnp.sum(_bf16_round(w, x) ** 2), argnums=(0, 1))(w, x)


@pytest.mark.parametrize("nested", [False, True], ids=["direct", "inside_jit"])
def test_base_interpreter_under_jit_on_an_explicit_mesh_is_bitwise_jit(nested):
    # Was: "Resource axis: clients of P('clients', None, None) is not found in mesh: ()":
    # the gradient's cast transposes carry a sharding over the empty mesh (captured
    # without one), which only the XLA backend put on the mesh in context.
    rng = np.random.default_rng(0)
    w = rng.normal(size=(5, 5)).astype(np.float32)
    x = rng.normal(size=(CLIENTS, 3, 5)).astype(np.float32)
    module = fcir.capture(_loss_grad, w, x)
    assert any(
        op.name == "jax.convert_element_type" and op.attrs["sharding"] is not None
        for _, op in fcir.ir.walk(module.main.body)
    ), "the gradient no longer holds a cast's transpose with a sharding param"
    mesh = jax.make_mesh((1,), ("clients",), axis_types=(AxisType.Explicit,))
    w = jax.device_put(w, NamedSharding(mesh, PartitionSpec()))
    x = jax.device_put(x, NamedSharding(mesh, PartitionSpec("clients")))

    def run(w, x):
        return fcir.Interpreter().run(module, w, x)

    with jax.set_mesh(mesh):
        want = jax.jit(_loss_grad)(w, x)
        got = jax.jit(jax.jit(run) if nested else run)(w, x)
    _assert_bitwise(got, want)


# --- a nested jax.jit that donates an argument ---------------------------------------------

_donating_step = jax.jit(lambda w, g: w - 0.1 * g, donate_argnums=0)


@fcir.program(placements={"clients": CLIENTS})
def _donating_round(w, x):
    g = fcir.reduce_mean(fcir.map_fn(lambda w, x: w * x, (fcir.broadcast(w), x)))
    return _donating_step(w, g) + w  # w is read after the call that donates it


@pytest.mark.parametrize("interpreter", ["reference", "base"])
def test_eager_interpreters_ignore_a_nested_jits_donation_as_jit_does(interpreter):
    # Was: "Array has been deleted" at the jax.add (the reference, run op by op, let the
    # nested jit donate w), and the caller's w was deleted after a run.

    def args():
        return jnp.arange(3.0), jnp.ones((CLIENTS, 3))

    module = fcir.capture(_donating_round, *args())
    assert any(True in op.attrs.get("donated_invars", ()) for op in module.main.body.ops)
    run = reference.run if interpreter == "reference" else fcir.Interpreter().run
    w, x = args()
    got = run(module, w, x)
    assert not w.is_deleted()
    _assert_bitwise(got, jax.jit(_donating_round)(*args()))
