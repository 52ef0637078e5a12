"""The XLA backend's call path: a warm call is JAX's C++ dispatch, the argument checks
run on a cache miss only and still give the clear errors, and a module is traced once
however many times it is compiled, lowered or printed."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fcir.interpreters import xla
from jax._src import test_util as jtu  # JAX's own counters of cache misses

import fcir
from fcir.errors import InterpreterError, PlacementError
from fcir.frontend import jaxpr_cache as captured
from fcir.ir import attrs as A


@fcir.program(placements={"clients": 8})
def tiny_round(w, x):
    deltas = fcir.map_fn(lambda w, x: w * x - 1.0, (fcir.broadcast(w), x))
    return {"w": w + fcir.reduce_mean(deltas), "n": fcir.reduce_sum(x)}


def tiny_args():
    return jnp.arange(4, dtype=jnp.float32), jnp.ones((8, 4), jnp.float32)


@functools.cache
def warm():
    """(module, executable), called once so the fast path is warm."""
    module = fcir.capture(tiny_round, *tiny_args())
    exe = xla.compile(module)
    exe(*tiny_args())
    return module, exe


def test_warm_calls_take_jaxs_cpp_fast_path():
    module, exe = warm()
    w, x = tiny_args()
    traces = xla.trace_count(module)
    with jtu.count_pjit_cpp_cache_miss() as misses:
        outs = [exe(w, x) for _ in range(5)]
    assert misses() == 0  # never back in Python dispatch
    assert xla.trace_count(module) == traces
    expected = jax.jit(tiny_round)(w, x)
    for out in outs:
        assert jax.tree.structure(out) == jax.tree.structure(expected)
        for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(expected)):
            assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


@pytest.mark.parametrize("attempt", [1, 2])  # a failed trace is not cached: fails again
def test_wrong_arguments_give_clear_errors_after_the_fast_path_is_warm(attempt):
    _, exe = warm()
    w, x = tiny_args()
    with pytest.raises(
        InterpreterError, match=r"@tiny_round takes 2 arguments \(f32\[4\], f32\[8,4\]\), .*got 1"
    ):
        exe(w)
    with pytest.raises(InterpreterError, match=r"argument \[1\] of @tiny_round is a tuple of 2"):
        exe(w, (x, x))
    with pytest.raises(
        InterpreterError, match=r"leaf 1 \(%1: \{f32\[4\]\}@clients\) needs an array of "
        r"f32\[8,4\], got f32\[8,5\]"
    ):
        exe(w, jnp.ones((8, 5)))
    with pytest.raises(InterpreterError, match=r"leaf 0 .* needs an array of f32\[4\], got i32"):
        exe(jnp.arange(4), x)
    with pytest.raises(PlacementError, match=r"leaf 1 .*one member per clients \(8 clients\)"):
        exe(w, jnp.ones((7, 4)))
    with pytest.raises(InterpreterError, match="abstract"):
        exe(w, jax.ShapeDtypeStruct(x.shape, x.dtype))
    # The right arguments still run, on the warm executable.
    np.testing.assert_array_equal(exe(w, x)["n"], np.full(4, 8.0, np.float32))


def test_numpy_and_python_arguments_run_like_jit():
    _, exe = warm()
    w, x = tiny_args()
    out = exe(np.asarray(w), np.asarray(x))
    np.testing.assert_array_equal(out["w"], jax.jit(tiny_round)(w, x)["w"])


def test_a_module_is_traced_once_for_every_compile_format_and_call():
    module = fcir.capture(tiny_round, *tiny_args())
    first = xla.compile(module)
    for dialect in ("stablehlo", "hlo", "optimized_hlo"):
        first.as_text(dialect)  # what `fcir compile --emit ...` asks for
    first.cost()
    assert xla.trace_count(module) == 1
    second = xla.compile(module)  # compiling the same module again
    second.lower()
    second.as_text("hlo")
    assert second.compiled() is not None
    # Calls share the trace too: two flat leaves are the same pytree as the specs.
    second(*tiny_args())
    first(*tiny_args())
    assert xla.trace_count(module) == 1
    # Another pytree of the same leaves is another jit signature: one more trace.
    first(*tiny_args()[:1], [tiny_args()[1]])
    first(*tiny_args()[:1], [tiny_args()[1]])
    assert xla.trace_count(module) == 2
    # A call and compiled() with the same arguments share one XLA compilation.
    with jtu.count_jit_compilation_cache_miss() as compiles:
        second.compiled(*tiny_args())
    assert compiles() == 0


# --- the captured jaxpr instead of a second trace ----------------------------------------


@pytest.mark.parametrize("name", ["fedavg_mlp", "minmax_agg"])
def test_a_captured_module_lowers_from_its_own_jaxpr(name):
    """Without a mesh the IR would be rebuilt into the captured jaxpr: the backend takes
    that jaxpr (weak-typed literals included) and is jax.jit's program, text and bits."""
    from corpus import case

    c = case(name)
    args = c.make_args()
    module = fcir.capture(c.fn, *args)
    assert captured.captured_jaxpr(module) is not None
    exe = xla.compile(module)
    reference = jax.jit(c.fn).lower(*args)
    assert exe.as_text("stablehlo", *args) == reference.as_text()
    for a, b in zip(jax.tree.leaves(exe(*args)), jax.tree.leaves(reference.compile()(*args))):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


def set_member_constant(module, value: float) -> None:
    """Edits ``module`` in place: the member's constant (the 1.0 of tiny_round)."""
    member = next(op for op in module.main.body.ops if op.name == "fed.map").regions[0]
    const = next(op for op in member.ops if op.name == "fcir.constant")
    const.attrs["value"] = A.Tensor.from_array(np.float32(value))


def test_a_module_edited_in_place_is_traced_from_its_ir():
    w, x = tiny_args()
    edited = fcir.capture(tiny_round, w, x)
    set_member_constant(edited, 3.0)
    assert captured.captured_jaxpr(edited) is None
    out = xla.compile(edited)(w, x)
    np.testing.assert_array_equal(out["w"], w + (w * x - 3.0).mean(0))
    # Edited after a compile: compiling again traces the edit, not the cached program.
    module = fcir.capture(tiny_round, w, x)
    before = xla.compile(module)(w, x)["w"]
    set_member_constant(module, 3.0)
    np.testing.assert_array_equal(xla.compile(module)(w, x)["w"], before - 2.0)


def test_a_module_with_large_constants_does_not_keep_its_jaxpr(monkeypatch):
    """The IR holds the constants already: a second copy in the jaxpr is not kept."""
    monkeypatch.setattr(captured, "MAX_CONSTANT_BYTES", 8)
    table = np.arange(16, dtype=np.float32)

    @fcir.program(placements={"clients": 2})
    def lookup(x):
        return fcir.reduce_sum(fcir.map_fn(lambda x: x * jnp.asarray(table), x))

    x = np.ones((2, 16), np.float32)
    module = fcir.capture(lookup, x)
    assert captured.captured_jaxpr(module) is None
    np.testing.assert_array_equal(xla.compile(module)(x), 2 * table)


CLI_TARGET = '''
import jax.numpy as jnp, fcir

@fcir.program(placements={"clients": 3})
def tiny(w, x):
    return fcir.reduce_mean(fcir.map_fn(lambda w, x: w * x, (fcir.broadcast(w), x)))

EXAMPLE_ARGS = {"tiny": lambda: (jnp.ones(4), jnp.ones((3, 4)))}
'''


@pytest.mark.parametrize("kind", ["py", "fcir"])
def test_fcir_compile_traces_once_for_all_formats(kind, tmp_path, monkeypatch, capsys):
    """`fcir compile --emit ir,hlo,stablehlo,cost`: a Python target (the captured jaxpr)
    and an IR file (rebuilt op by op) are each traced once for all four outputs."""
    from fcir import cli

    src = tmp_path / "target.py"
    src.write_text(CLI_TARGET)
    target = f"{src}:tiny"
    if kind == "fcir":
        assert cli.main(["compile", target, "--emit", "ir", "-o", str(tmp_path / "ir")]) == 0
        target = str(tmp_path / "ir" / "tiny.fcir")
    compiled = []
    real_compile = xla.compile
    monkeypatch.setattr(xla, "compile", lambda m, **kw: compiled.append(m) or real_compile(m, **kw))
    out = tmp_path / "out"
    assert cli.main(["compile", target, "--emit", "ir,hlo,stablehlo,cost", "-o", str(out)]) == 0
    (module,) = compiled
    assert (captured.captured_jaxpr(module) is not None) == (kind == "py")
    assert xla.trace_count(module) == 1
    assert (out / "tiny.hlo.txt").read_text().startswith("HloModule jit_tiny")
