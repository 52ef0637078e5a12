"""ir.md guarantee 1 for an LSTM client (a ``lax.scan`` of ``tanh`` cells in the client
function): ``xla.compile`` of the captured round, and of its gradient, is bitwise
``jax.jit`` of the same function, with equal XLA flops, on every supported JAX.

Under JAX 0.10.2 a captured gradient once differed from jax.jit's in the last bit. The LSTM's
cell state ``c`` feeds ``tanh`` and is also the next step's carry, so when the backward
pass reaches ``tanh`` the cotangent of ``c`` already holds the carry's piece. JAX
0.10.2's rule, ``(g + g*ans) * (1 - ans)``, reads the tangent ``g`` twice, so
``jax.jit`` adds two pieces onto it one at a time, ``(carry_ct + u) + u*ans`` with ``u
= ct * (1 - ans)``, where one captured ``tanh_cotangent`` added once gave ``carry_ct +
(u + u*ans)``. Capture now writes ``tanh_cotangent_add(acc, ct, ans, r)`` there, which
sums as the running JAX's backward pass sums (fcir/jaxcompat/derivatives.py); JAX 0.12
reads ``g`` once (``g * one_minus_square(ans)``), so there it is ``acc + ct*r``, the ops
``jax.jit`` runs. The one-client gradient prints one text on both JAX (golden
``lstm_grad``).
"""

from __future__ import annotations

import functools
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fcir.interpreters import reference, xla
from test_xla import assert_bitwise, flops

import fcir
from fcir.frontend import jaxpr_cache as captured
from fcir.jaxcompat import derivatives

H, D, T, CLIENTS = 8, 4, 6, 4
GOLDEN_DIR = pathlib.Path(__file__).parents[2] / "golden"


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


def _round_loss(p, x, y):
    return sum(jnp.sum(leaf**2) for leaf in jax.tree.leaves(_lstm_round(p, x, y)))


def _ops(module) -> set[str]:
    return {op.name for _, op in fcir.ir.walk(module.main.body)}


def _assert_fidelity(fn, args, module=None, want=None):
    """``xla.compile`` of ``module`` (default: ``fn``'s capture) rebuilt from its IR, as
    from a file, is bitwise ``jax.jit(fn)`` (``want``: compiled already) with its XLA
    flops."""
    module = fcir.capture(fn, *args) if module is None else module
    captured.forget(module)
    exe = xla.compile(module)
    want = jax.jit(fn).lower(*args).compile() if want is None else want
    assert_bitwise(exe(*args), want(*args))
    assert flops(exe.compiled(*args)) == flops(want)
    return module


@functools.cache
def _one_client():
    """The gradient of one client's LSTM loss, its arguments, and its ``jax.jit``."""
    p, x, y = _args()
    fn, args = jax.grad(_lstm_loss), (p, x[0], y[0])
    return fn, args, jax.jit(fn).lower(*args).compile()


def test_an_lstm_round_compiles_bitwise_jit():
    _assert_fidelity(_lstm_round, _args())


def test_the_gradient_of_an_lstm_round_compiles_bitwise_jit():
    # A gradient of the clients' gradients: on 0.12 the second-order ops of
    # tanh_cotangent_add; on 0.10.2 capture keeps JAX's own rules (its forward-over-
    # reverse of tanh reads a tangent twice), as for every such program.
    _assert_fidelity(jax.grad(_round_loss), _args())


@pytest.mark.usefixtures("traced_at_default_precision")  # a golden: JAX's default trace
def test_one_client_s_lstm_gradient_compiles_bitwise_jit_and_prints_one_text(golden):
    fn, args, want = _one_client()
    module = _assert_fidelity(fn, args, want=want)
    assert "jax.tanh_cotangent_add" in _ops(module)  # c's cotangent holds the carry's
    golden("lstm_grad", module.to_text())


@pytest.mark.usefixtures("traced_at_default_precision")  # an IR file: JAX's default trace
def test_the_lstm_gradient_s_ir_file_runs_like_jit_on_the_jax_reading_it():
    # An IR file is the program: the golden (one text, written under either JAX) loads,
    # checks, prints the same and runs like the reading JAX's jax.jit, and like the
    # oracle.
    text = (GOLDEN_DIR / "lstm_grad.fcir").read_text()
    module = fcir.parse(text)
    fcir.check(module)
    assert module.to_text() == text
    fn, args, want = _one_client()
    _assert_fidelity(fn, args, module, want)
    for got, expected in zip(
        jax.tree.leaves(reference.run(module, *args)), jax.tree.leaves(want(*args))
    ):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "other_use, tanh",
    [("after", jnp.tanh), ("after", jax.lax.tanh), ("before", jnp.tanh)],
    ids=["after-jnp", "after-lax", "before-jnp"],
)
def test_a_tanh_of_a_value_used_again_grads_bitwise_jit(other_use, tanh):
    """The smallest program showing the cause: ``c`` feeds ``tanh`` and a product. When
    the product comes after ``tanh`` the backward pass reaches ``tanh`` with ``c``'s
    cotangent holding the product's piece: ``tanh_cotangent_add``. Before it, ``tanh``
    writes first: ``tanh_cotangent``, and the product's piece is added to it later.
    JAX 0.12's ``jnp.tanh`` is a ``jit`` that JAX transposes with an accumulator of its
    own (then ``c``'s cotangent is ``acc + tanh_cotangent``, one piece, as 0.12's
    ``jax.jit`` adds it); 0.10.2 inlines it while tracing."""
    rng = np.random.default_rng(0)
    w, v, x = (jnp.asarray(rng.normal(size=(4096,)), jnp.float32) for _ in range(3))

    def f(x):
        c = x * 2.0
        if other_use == "before":
            cv = c * v
            return jnp.sum(cv + tanh(c) * w)
        return jnp.sum(tanh(c) * w + c * v)

    ops = _ops(_assert_fidelity(jax.grad(f), (x,)))
    own_accumulator = tanh is jnp.tanh and jax.__version_info__ >= (0, 11)
    fused = "jax.tanh_cotangent_add" in ops
    assert fused == (other_use == "after" and not own_accumulator)
    assert fused or "jax.tanh_cotangent" in ops


def test_a_tanh_of_a_value_used_once_grads_bitwise_jit():
    """Without another use of ``c`` its cotangent is the one piece: bitwise on both."""
    rng = np.random.default_rng(0)
    w, x = (jnp.asarray(rng.normal(size=(4096,)), jnp.float32) for _ in range(2))

    def f(x):
        return jnp.sum(jnp.tanh(x * 2.0) * w)

    assert "jax.tanh_cotangent_add" not in _ops(_assert_fidelity(jax.grad(f), (x,)))


def test_a_captured_vjp_with_tanh_cotangent_add_transposes_back_to_the_jvp():
    # tanh_cotangent_add is linear in (acc, ct): transposed, acc's cotangent is the
    # incoming one and ct's is tanh_tangent of it (a VJP's transpose is the JVP).
    rng = np.random.default_rng(0)
    w, v, x, t = (jnp.asarray(rng.normal(size=(64,)), jnp.float32) for _ in range(4))

    def f(x):
        c = x * 2.0
        return jax.lax.tanh(c) * w + c * v

    with derivatives.capturing():
        _, vjp = jax.vjp(f, x)
        assert "tanh_cotangent_add" in str(jax.make_jaxpr(vjp)(t))
        (got,) = jax.linear_transpose(vjp, x)((t,))
    np.testing.assert_allclose(got, jax.jvp(f, (x,), (t,))[1], rtol=1e-6, atol=1e-6)
