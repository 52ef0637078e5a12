"""ir.md guarantee 1 for an LSTM client (a ``lax.scan`` of ``tanh`` cells in the client
function): ``xla.compile`` of the captured round, and of its gradient, is bitwise
``jax.jit`` of the same function.

The round itself (each client's step a gradient of its LSTM loss) is, on both JAX
versions. Its gradient under JAX 0.10.2 is not yet (issue 32 item 7): it differs in the last bit
(up to 3.7e-9 in the bias and input weights) for one client's LSTM loss already, with
no fed op involved. Measured: with ``jnp.sin`` in place of ``jnp.tanh`` the bits agree,
so it is the capture's tanh derivative ops (fcir/jaxcompat/derivatives.py) in this
program; unrolling the scan keeps the difference; ``--xla_backend_optimization_level=0``
and a CPU ISA without FMA keep it too, so it is not XLA's fusion or contraction but
another order of the same additions. Small programs (tanh of tanh, sigmoid times tanh,
a single LSTM cell, second-order tanh) agree bitwise on both JAX versions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fcir.interpreters import xla

import fcir

H, D, T, CLIENTS = 8, 4, 6, 4
OLD_JAX = jax.__version_info__ < (0, 11)
not_yet_on_old_jax = pytest.mark.xfail(
    OLD_JAX, strict=True, reason="issue 32 item 7: the tanh derivative ops under JAX 0.10.2"
)


def _lstm_loss(p, x, y):
    def cell(carry, xt):
        h, c = carry
        i, f, g, o = jnp.split(xt @ p["wx"] + h @ p["wh"] + p["b"], 4)
        c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
        h = jax.nn.sigmoid(o) * jnp.tanh(c)
        return (h, c), h

    (h, _), _ = jax.lax.scan(cell, (jnp.zeros(H), jnp.zeros(H)), x)
    return jnp.mean((h @ p["wo"] - y) ** 2)


def _local_step(p, x, y):
    g = jax.grad(_lstm_loss)(p, x, y)
    return jax.tree.map(lambda a, b: a - 0.1 * b, p, g)


@fcir.program(placements={"clients": CLIENTS})
def _lstm_round(p, x, y):
    return fcir.reduce_mean(fcir.map_fn(_local_step, (fcir.broadcast(p), x, y)))


def _args():
    rng = np.random.default_rng(0)
    p = {
        "wx": rng.normal(size=(D, 4 * H)),
        "wh": rng.normal(size=(H, 4 * H)) * 0.3,
        "b": rng.normal(size=(4 * H,)),
        "wo": rng.normal(size=(H, 1)),
    }
    p = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), p)
    x = jnp.asarray(rng.normal(size=(CLIENTS, T, D)), jnp.float32)
    y = jnp.asarray(rng.normal(size=(CLIENTS, 1)), jnp.float32)
    return p, x, y


def _assert_bitwise(got, want):
    for i, (a, b) in enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)):
        a, b = np.asarray(a), np.asarray(b)
        assert a.tobytes() == b.tobytes(), f"leaf {i} differs by {np.max(np.abs(a - b))}"


def _round_loss(p, x, y):
    return sum(jnp.sum(leaf**2) for leaf in jax.tree.leaves(_lstm_round(p, x, y)))


def test_an_lstm_round_compiles_bitwise_jit():
    args = _args()
    _assert_bitwise(xla.compile(fcir.capture(_lstm_round, *args))(*args), jax.jit(_lstm_round)(*args))


@not_yet_on_old_jax
def test_the_gradient_of_an_lstm_round_compiles_bitwise_jit():
    grad, args = jax.grad(_round_loss), _args()
    _assert_bitwise(xla.compile(fcir.capture(grad, *args))(*args), jax.jit(grad)(*args))


@not_yet_on_old_jax
def test_one_client_s_lstm_gradient_compiles_bitwise_jit():
    p, x, y = _args()
    grad = jax.grad(lambda p: _lstm_loss(p, x[0], y[0]))
    _assert_bitwise(xla.compile(fcir.capture(grad, p))(p), jax.jit(grad)(p))
