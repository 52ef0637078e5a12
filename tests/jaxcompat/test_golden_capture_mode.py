"""Capture's version-neutral derivatives (fcir/jaxcompat/derivatives.py) keep ir.md's
guarantee 1 and do not depend on what JAX traced before.

While capturing, ``tanh``'s first derivative is fcir's ``tanh_residual`` /
``tanh_tangent`` / ``tanh_cotangent`` ops, their derivative the ``tanh_*_jvp*`` ops, and
a ``custom_jvp_call`` in the linear part of a derivative is inlined (as JAX 0.10.2
does), so scan_rounds, fedavg_mlp's gradient and scan_rounds' and meta-learning's
gradients of a gradient print the same on JAX 0.10.2 and 0.12. Capture mode is part of
JAX's trace context, so JAX's trace caches never hand a trace made with JAX's own rules
to a capture, nor a capture's trace to ``jax.jit``: the cache-order tests run each order
in a fresh process (what earlier tests in this process traced cannot mask a leak), one
for the three programs, whose traces of one kind all come before any of the other.
"""

from __future__ import annotations

import functools
import json
import pathlib
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fcir.interpreters import reference, xla
from fcir.interpreters.xla import zeros

import fcir
from fcir.frontend import jaxpr_cache as captured
from fcir.jaxcompat import derivatives

TESTS = pathlib.Path(__file__).resolve().parents[1]
DERIVATIVE_OPS = {f"jax.{name}" for name in derivatives.OPS}

# One process per order: JAX traces and differentiates the corpus programs itself (jit,
# make_jaxpr, running them), then fcir captures them, or the other way round: every
# trace of one kind before any of the other, so within the process no capture comes
# before a JAX trace (jax_first), or no JAX trace before a capture (capture_first). It
# prints, for each program, the captured text's match with its golden and whether
# xla.compile of the IR is bitwise jax.jit.
_SCRIPT = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, {tests!r})
    import jax, numpy as np
    import fcir
    from fcir.frontend import jaxpr_cache as captured
    from fcir.interpreters import xla
    from corpus import case
    from conftest import GOLDEN_DIR, _JAX_DIR

    jax_first, names = sys.argv[1] == "jax_first", sys.argv[2:]

    def program(name):
        c = case(name.removesuffix("_grad"))
        fn = c.fn
        if name.endswith("_grad"):
            fn = jax.grad(lambda *a: c.loss(c.fn(*a)), c.grad_argnums)
        return fn, c.make_args()

    programs = {{name: program(name) for name in names}}

    def by_jax(name):
        fn, args = programs[name]
        jaxpr = str(jax.make_jaxpr(fn)(*args))
        compiled = jax.jit(fn).lower(*args).compile()
        return jaxpr, compiled, compiled(*args)

    def by_capture(name):
        fn, args = programs[name]
        return fcir.capture(fn, *args, name=name)

    if jax_first:
        traced = {{name: by_jax(name) for name in names}}
        modules = {{name: by_capture(name) for name in names}}
    else:
        modules = {{name: by_capture(name) for name in names}}
        traced = {{name: by_jax(name) for name in names}}

    def flops(comp):
        a = comp.cost_analysis()
        return (a[0] if isinstance(a, (list, tuple)) else a)["flops"]

    results = {{}}
    for name in names:
        module, (jaxpr, compiled, expected), args = modules[name], traced[name], programs[name][1]
        path = GOLDEN_DIR / _JAX_DIR / f"{{name}}.fcir"
        if not path.exists():
            path = GOLDEN_DIR / f"{{name}}.fcir"
        captured.forget(module)  # the backend rebuilds the program from the IR
        exe = xla.compile(module)
        got = exe(*args)
        same = all(
            np.asarray(a).tobytes() == np.asarray(b).tobytes()
            for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected))
        )
        results[name] = {{
            "golden": module.to_text() == path.read_text(),
            "bitwise": same,
            "flops": [flops(exe.compiled(*args)), flops(compiled)],
            "jax_trace_has_fcir_ops": any(n in jaxpr for n in ("tanh_tangent", "tanh_cotangent")),
        }}
    print(json.dumps(results))
    """
).format(tests=str(TESTS))
CAPTURE_ORDER_PROGRAMS = ["scan_rounds", "fedavg_mlp_grad", "scan_rounds_grad"]


@functools.cache
def _run(order: str) -> dict:
    """Each program's results in the fresh process of ``order`` (one per order)."""
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT, order, *CAPTURE_ORDER_PROGRAMS],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=TESTS.parent,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # a fresh process for each order: left out of the fast tier
@pytest.mark.parametrize("order", ["jax_first", "capture_first"])
@pytest.mark.parametrize("name", CAPTURE_ORDER_PROGRAMS)
def test_capture_matches_golden_and_jit_whatever_jax_traced_before(name, order):
    result = _run(order)[name]
    assert result["golden"], f"{name} captured after/before JAX's own trace differs from its golden"
    assert result["bitwise"], f"xla.compile(capture({name})) is not bitwise jax.jit ({order})"
    assert result["flops"][0] == result["flops"][1]
    assert not result["jax_trace_has_fcir_ops"], "capture mode leaked into jax.make_jaxpr"


def _tanh_fit(w, x, y):
    return jnp.mean(jnp.square(jnp.tanh(x @ w) - y))


def _ops(module) -> set[str]:
    return {op.name for _, op in fcir.ir.walk(module.main.body)}


def _args():
    rng = np.random.default_rng(3)
    w = rng.normal(size=(4,)).astype(np.float32)
    x = rng.normal(size=(8, 4)).astype(np.float32)
    y = rng.normal(size=(8,)).astype(np.float32)
    return w, x, y


def _assert_bitwise_jit(fn, args):
    module = fcir.capture(fn, *args)
    captured.forget(module)
    exe = xla.compile(module)
    ref = jax.jit(fn).lower(*args).compile()
    for a, b in zip(jax.tree.leaves(exe(*args)), jax.tree.leaves(ref(*args))):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()

    def flops(comp):
        a = comp.cost_analysis()
        return (a[0] if isinstance(a, (list, tuple)) else a)["flops"]

    assert flops(exe.compiled(*args)) == flops(ref)
    return module


def test_first_derivative_of_tanh_captures_to_fcir_ops_that_run_like_jit():
    args = _args()
    module = _assert_bitwise_jit(jax.grad(_tanh_fit), args)
    assert {"jax.tanh_residual", "jax.tanh_cotangent"} <= _ops(module)
    assert not _ops(module) & {"jax.one_minus_square"}
    fcir.check(module)
    text = module.to_text()
    again = fcir.parse(text)
    assert again.to_text() == text
    np.testing.assert_allclose(
        reference.run(again, *args), jax.jit(jax.grad(_tanh_fit))(*args), rtol=1e-6
    )


def test_forward_mode_keeps_tanh_tangent_and_runs_like_jit():
    w, x, y = _args()

    def jvp(w, t):
        return jax.jvp(lambda w: _tanh_fit(w, x, y), (w,), (t,))[1]

    module = _assert_bitwise_jit(jvp, (w, np.ones_like(w)))
    assert "jax.tanh_tangent" in _ops(module)


def test_vmapped_derivative_runs_like_jit():
    w, x, y = _args()
    fn = jax.vmap(jax.grad(_tanh_fit), in_axes=(0, None, None))
    _assert_bitwise_jit(fn, (np.stack([w, 2 * w]), x, y))


def _outer(w, x, y):
    return jnp.sum(jax.grad(_tanh_fit)(w, x, y) ** 2)


def test_gradient_of_a_gradient_captures_to_second_order_ops_that_run_like_jit():
    # JAX's own gradient of a gradient re-differentiates the first derivative's
    # expression eqn by eqn (0.10.2: sub, neg and one more add_any; 0.12:
    # one_minus_square and mul -2); capture writes version-neutral ops that run it.
    w, x, y = _args()
    module = _assert_bitwise_jit(jax.grad(_outer), (w, x, y))
    ops = _ops(module)
    assert {"jax.tanh_cotangent_jvp", "jax.tanh_cotangent_jvp_cotangent"} <= ops
    assert not ops & {"jax.one_minus_square", "jax.neg"}
    fcir.check(module)
    text = module.to_text()
    again = fcir.parse(text)
    assert again.to_text() == text
    np.testing.assert_allclose(
        reference.run(again, w, x, y), jax.jit(jax.grad(_outer))(w, x, y), rtol=1e-5
    )


def _layers(ws, x):
    h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)
    return jnp.sum(h**2)


def test_gradient_of_a_gradient_through_a_scan_compiles_to_jits_flops():
    # Under JAX 0.12 tanh_cotangent_jvp_cotangent's cotangent of ans is zero (0.12's
    # tanh_cotangent, ct * r, reads no ans): JAX adds nothing, the IR (the same on every
    # JAX) adds it, and that zero goes from one scan's ys to the next scan's xs, where
    # XLA does not fold the add (5619 flops against jax.jit's 5587). The XLA backend
    # drops it first (interpreters/xla/zeros.py).
    rng = np.random.default_rng(0)
    ws = (0.5 * rng.normal(size=(3, 8, 8))).astype(np.float32)
    x = rng.normal(size=(4, 8)).astype(np.float32)

    def outer(ws, x):
        return jnp.sum(jax.grad(_layers)(ws, x) ** 2)

    module = _assert_bitwise_jit(jax.grad(outer), (ws, x))
    assert "jax.tanh_cotangent_jvp_cotangent" in _ops(module)
    lowered = zeros.without_structural_zeros(module)
    assert (lowered is not module) == (jax.__version_info__ >= (0, 11))
    fcir.check(lowered)  # what XLA compiles is well-typed IR too


def test_meta_learning_gradient_runs_like_jit():
    # meta_learning_grad's golden (second-order ops, one text for both JAX) compiles to
    # jax.jit's bits and flops on each (scan_rounds_grad: test_xla.py's corpus tests).
    import importlib.util

    path = TESTS.parent / "examples" / "meta_learning.py"
    spec = importlib.util.spec_from_file_location("meta_learning_example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    args = example.EXAMPLE_ARGS["post_round_loss"]()
    module = _assert_bitwise_jit(jax.grad(example.post_round_loss), args)
    assert "jax.tanh_cotangent_jvp_cotangent" in _ops(module)


def test_vmapped_gradient_of_a_gradient_runs_like_jit_whichever_rules_capture_keeps():
    # Batched over w only, a second-order op can meet batched and unbatched operands;
    # it then batches as JAX's expression (no broadcast of the unbatched one), which
    # sends capture back to JAX's own rules (here, on both JAX).
    w, x, y = _args()
    fn = jax.vmap(jax.grad(_outer), in_axes=(0, None, None))
    _assert_bitwise_jit(fn, (np.stack([w, 2 * w]), x, y))


def test_forward_over_forward_runs_like_jit_whichever_rules_capture_keeps():
    # JAX 0.10.2's tanh tangent reads g twice ((g + g*ans) * r): a fused transpose would
    # sum its cotangents in another order, so capture keeps JAX's own rules there.
    w, x, y = _args()
    t = np.ones_like(w)

    def fwd_fwd(w):
        inner = lambda w: jax.jvp(lambda w: _tanh_fit(w, x, y), (w,), (t,))[1]  # noqa: E731
        return jax.jvp(inner, (w,), (t,))[1]

    _assert_bitwise_jit(jax.grad(fwd_fwd), (w,))


def test_capture_mode_is_off_outside_capture_and_in_the_trace_context():
    w, x, y = _args()
    fn = jax.grad(_tanh_fit)
    fcir.capture(fn, w, x, y)
    assert not derivatives.CAPTURE_MODE.value
    assert "tanh_cotangent" not in str(jax.make_jaxpr(fn)(w, x, y))
    with derivatives.capturing():
        assert "tanh_cotangent" in str(jax.make_jaxpr(fn)(w, x, y))
    assert "tanh_cotangent" not in str(jax.make_jaxpr(fn)(w, x, y))


def test_jaxs_trace_caches_keep_capture_traces_apart_in_both_directions():
    # A jitted gradient JAX has traced and run is traced afresh in capture mode (its
    # cached jaxpr holds JAX's rule), and capture's trace is not what JAX gets after.
    @jax.jit
    def inner(w):
        return jnp.sum(jnp.tanh(w))

    g = jax.jit(jax.grad(inner))
    w = np.ones(3, np.float32)
    before = str(jax.make_jaxpr(g)(w))
    g(w)
    with derivatives.capturing():
        during = str(jax.make_jaxpr(g)(w))
    after = str(jax.make_jaxpr(g)(w))
    assert "tanh_cotangent" in during
    assert "tanh_cotangent" not in before and after == before
