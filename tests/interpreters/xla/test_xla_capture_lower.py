"""Capture and lowering at scale do no work twice: ``xla.compile`` of a
module straight from ``fcir.capture`` does not type-check it again, while any module
edited since, parsed from text or converted without a check still is; the collector
is paused while capture traces the program and builds the module and while it is
lowered, and left as it was found; and the fast paths taken for common attribute values give what the general path gives."""

from __future__ import annotations

import gc

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fcir.interpreters import xla
from fcir.interpreters.xla import build

import fcir
from fcir.errors import FcirError, PrivacyError
from fcir.frontend import jaxpr_cache as captured
from fcir.frontend.capture import capture_unchecked
from fcir.ir import attrs as A
from fcir.ir.types import TensorType, dtype_name


@fcir.program(placements={"clients": 4})
def small_round(w, x):
    deltas = fcir.map_fn(lambda w, x: jnp.tanh(w * x) - 1.0, (fcir.broadcast(w), x))
    return w + fcir.reduce_mean(deltas)


ARGS = (jnp.arange(3, dtype=jnp.float32), jnp.ones((4, 3), jnp.float32))


@pytest.fixture
def checks(monkeypatch):
    """The modules ``xla.compile`` type-checks, in order."""
    seen = []
    real = build.check

    def counting(module):
        seen.append(module)
        return real(module)

    monkeypatch.setattr(build, "check", counting)
    return seen


def test_compile_does_not_check_a_module_capture_just_checked(checks):
    module = fcir.capture(small_round, *ARGS)
    exe = xla.compile(module)
    assert checks == []
    np.testing.assert_array_equal(exe(*ARGS), jax.jit(small_round)(*ARGS))


def test_compile_checks_modules_capture_did_not_check(checks):
    module = fcir.capture(small_round, *ARGS)
    parsed = fcir.parse(module.to_text(full_constants=True))
    unchecked = capture_unchecked(small_round, *ARGS)
    xla.compile(parsed)
    xla.compile(unchecked)
    assert checks == [parsed, unchecked]


def test_compile_checks_a_captured_module_edited_in_place(checks):
    module = fcir.capture(small_round, *ARGS)
    # A result retyped in place: no longer what capture checked, and wrong.
    module.main.body.results[0].type = TensorType("f32", (3,))
    with pytest.raises(FcirError):
        xla.compile(module)
    assert checks == [module]


def test_compile_checks_a_captured_module_made_private_since(checks):
    module = fcir.capture(small_round, *ARGS)
    module.private = True  # now the leak check applies: fed.mean releases client data
    with pytest.raises(PrivacyError, match="privacy/C1"):
        xla.compile(module)
    assert checks == [module]


def test_compile_checks_a_module_whose_capture_record_was_dropped(checks):
    module = fcir.capture(small_round, *ARGS)
    captured.forget(module)
    xla.compile(module)
    assert checks == [module]


@pytest.mark.parametrize("enabled", [True, False])
def test_capture_and_lowering_leave_the_collector_as_they_found_it(enabled):
    was = gc.isenabled()
    (gc.enable if enabled else gc.disable)()
    try:
        module = fcir.capture(small_round, *ARGS)
        assert gc.isenabled() is enabled
        xla.compile(module).lower(*ARGS)
        assert gc.isenabled() is enabled
        with pytest.raises(FcirError):  # a failing capture too
            fcir.capture(small_round, ARGS[0], jnp.ones((5, 3), jnp.float32))
        assert gc.isenabled() is enabled
    finally:
        (gc.enable if was else gc.disable)()


def test_capture_traces_the_program_with_the_collector_paused():
    """The trace is the bulk of what capture makes (the jaxpr: millions of long-lived
    objects at FAX scale, no cycles): the collector is off while the program runs under
    the trace, as while the module is built, and on again afterwards."""
    during = []

    @fcir.program(placements={"clients": 4})
    def noting(w, x):
        during.append(gc.isenabled())
        deltas = fcir.map_fn(lambda w, x: jnp.tanh(w * x), (fcir.broadcast(w), x))
        return w + fcir.reduce_mean(deltas)

    assert gc.isenabled()
    fcir.capture(noting, *ARGS)
    assert during == [False]
    assert gc.isenabled()
    with pytest.raises(FcirError):  # a trace that fails releases the pause too
        fcir.capture(noting, ARGS[0], jnp.ones((5, 3), jnp.float32))
    assert during == [False, False]
    assert gc.isenabled()


PLAIN = [
    None, True, 0, -7, 2**40, 1.5, "x", (), (1, 2, 3), ((1,), (0,)), (((1,), (0,)), ((), ())),
    (None, "a", True, 2.0), (np.int32(3), 4), (np.float32(0.5),),
]  # fmt: skip


@pytest.mark.parametrize("value", PLAIN, ids=repr)
def test_attribute_fast_paths_encode_as_the_general_path(value):
    """``encode`` returns plain values and tuples of them without the general checks; the
    result is what the general path (taken for a primitive encoded by name) gives."""
    fast = A.encode(value, "dot_general", "dimension_numbers", None)
    general = A.encode(value, "custom_jvp_call", "symbolic_zeros", None)
    assert fast == general
    assert _typed_tree(fast) == _typed_tree(general)


def _typed_tree(v):
    if isinstance(v, tuple):
        return (tuple, tuple(_typed_tree(x) for x in v))
    return (type(v), v)


@pytest.mark.parametrize(
    "dtype, name",
    [(np.float32, "f32"), (np.dtype("float32"), "f32"), ("float32", "f32"), (jnp.bfloat16, "bf16"),
     (np.dtype("int8"), "i8"), (bool, "bool"), (np.uint32, "u32"), (np.complex64, "c64")],
)  # fmt: skip
def test_dtype_names_are_the_same_when_asked_again(dtype, name):
    assert dtype_name(dtype) == name
    assert dtype_name(dtype) == name  # from the memo


def test_dtype_name_of_a_key_dtype_is_remembered_per_implementation():
    fry = jax.random.key(0, impl="threefry2x32").dtype
    rbg = jax.random.key(0, impl="rbg").dtype
    assert dtype_name(fry) == "key<fry>" and dtype_name(rbg) == "key<rbg>"
    assert dtype_name(fry) == "key<fry>" and dtype_name(rbg) == "key<rbg>"
