"""A captured program runs with the arguments it was captured with: keyword arguments as
recorded, a dict with the captured keys, arrays of the captured types and number;
anything else is an InterpreterError that names the argument."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from fcir.interpreters import reference, xla

import fcir

N = 4


_ARGS = (jnp.zeros(3), jnp.ones((N, 5, 3)))


# --- keyword arguments: a module captured with f(w, x=x) runs with f(w, x=x) ---------------


@fcir.program(placements={"clients": N})
def _scaled_stats(w, x, y):
    return {"mean": w * fcir.reduce_mean(x), "max": fcir.reduce_max(y) - w}


def _keyword_args():
    w = jnp.float32(3.0)
    x = jnp.arange(N, dtype=jnp.float32)
    y = jnp.asarray([5.0, -1.0, 2.0, 0.5], jnp.float32)
    return w, x, y


def test_reference_and_xla_run_with_the_keyword_arguments_capture_recorded():
    w, x, y = _keyword_args()
    module = fcir.capture(_scaled_stats, w, y=y, x=x)
    assert '.args (($0,), {"x": $1, "y": $2})' in module.to_text()
    want = _scaled_stats(w, x=x, y=y)
    exe = xla.compile(module)
    for got in (
        reference.run(module, w, x=x, y=y),
        reference.run(module, w, y=y, x=x),  # keyword order is free, as in Python
        exe(w, x=x, y=y),
        exe(w, y=np.asarray(y), x=x),  # numpy leaves take the checked path
        exe(w, x=x, y=y),  # warm
    ):
        np.testing.assert_allclose(got["mean"], want["mean"])
        np.testing.assert_allclose(got["max"], want["max"])
    assert exe.lower(w, x=x, y=y).as_text() == exe.lower(w, x=x, y=y).as_text()
    exe(w, x, y)  # positional leaves in flatten order still run, as before


def test_cost_and_as_text_take_the_keyword_arguments_capture_recorded():
    w, x, y = _keyword_args()
    exe = xla.compile(fcir.capture(_scaled_stats, w, x=x, y=y))
    by_keyword, by_specs = exe.cost(w, x=x, y=y), exe.cost()
    assert by_keyword["xla"] == by_specs["xla"]
    assert exe.as_text("hlo", w, x=x, y=y) == exe.as_text("hlo")
    with pytest.raises(fcir.InterpreterError, match=r"cost: .*got \(1 positional, x=\)"):
        exe.cost(w, x=x)


@fcir.program(placements={"clients": N})
def _with_intermediates_keyword(w, intermediates):
    return w * fcir.reduce_mean(intermediates)


def test_a_program_keyword_named_intermediates_is_the_programs_not_run_s_flag():
    w, x, _ = _keyword_args()
    module = fcir.capture(_with_intermediates_keyword, w, intermediates=x)
    want = _with_intermediates_keyword(w, intermediates=x)
    np.testing.assert_allclose(reference.run(module, w, intermediates=x), want)
    plain = fcir.capture(_with_intermediates_keyword, w, x)
    with pytest.raises(fcir.InterpreterError, match=r"takes True or False, got .*Array"):
        reference.run(plain, w, intermediates=x)


def test_keyword_arguments_that_do_not_match_the_capture_are_an_fcir_error_naming_them():
    w, x, y = _keyword_args()
    module = fcir.capture(_scaled_stats, w, x=x, y=y)
    exe = xla.compile(module)
    for run in (lambda **kw: reference.run(module, w, **kw), lambda **kw: exe(w, **kw)):
        with pytest.raises(
            fcir.InterpreterError, match=r"1 positional, x=, y=.*got \(1 positional, x=, z=\)"
        ):
            run(x=x, z=y)
        with pytest.raises(fcir.InterpreterError, match=r"1 positional, x=, y="):
            run(x=x)
    with pytest.raises(fcir.InterpreterError, match=r"got \(2 positional, y=\)"):
        exe(w, x, y=y)
    positional = fcir.capture(_scaled_stats, w, x, y)
    for run in (
        lambda: reference.run(positional, w, x, y=y),
        lambda: xla.compile(positional)(w, x, y=y),
    ):
        with pytest.raises(
            fcir.InterpreterError,
            match=r"captured without keyword arguments \(it takes 3 positional\)",
        ):
            run()


# --- a dict argument with other keys than at capture: leaves matched by sorted position ----


@fcir.program(placements={"clients": 2})
def _affine(p, x):
    return fcir.reduce_sum(fcir.map_fn(lambda p, x: p["w"] * x + p["b"], (fcir.broadcast(p), x)))


def _affine_module():
    p = {"w": jnp.float32(2.0), "b": jnp.float32(10.0)}
    return fcir.capture(_affine, p, jnp.ones(2))


@pytest.mark.parametrize("backend", ["reference", "xla"])
def test_a_dict_argument_with_renamed_keys_is_refused_not_matched_by_sorted_position(backend):
    module = _affine_module()
    run = reference.run if backend == "reference" else (lambda m, *a: xla.compile(m)(*a))
    # Renamed w -> kernel, b -> shift: sorted ("kernel", "shift") would run b=2, w=10
    # (22 where the program computes 24; jax.jit of the program raises a KeyError).
    renamed = {"kernel": jnp.float32(2.0), "shift": jnp.float32(10.0)}
    with pytest.raises(fcir.InterpreterError, match=r"argument \[0\].*'kernel', 'shift'.*'b', 'w'"):
        run(module, renamed, jnp.ones(2))
    # The captured keys, in any order, and flat leaves still run.
    assert float(run(module, {"w": 2.0, "b": 10.0}, jnp.ones(2))) == 24.0
    assert float(run(module, jnp.float32(10.0), jnp.float32(2.0), jnp.ones(2))) == 24.0


def test_a_renamed_nested_dict_key_is_refused_by_xla_lower_and_cost_too():
    exe = xla.compile(_affine_module())
    renamed = ({"kernel": jnp.float32(2.0), "shift": jnp.float32(10.0)}, jnp.ones(2))
    for call in (exe.lower, exe.cost):
        with pytest.raises(fcir.InterpreterError, match="captured with"):
            call(*renamed)


@fcir.program(placements={"clients": 3})
def _spread(w, x):
    return fcir.reduce_mean(fcir.map_fn(lambda w, x: w * x, (fcir.broadcast(w), x)))


def test_a_wrong_argument_shape_is_written_as_the_ir_writes_types_so_the_two_compare():
    module = fcir.capture(_spread, jnp.ones(2), jnp.ones((3, 2)))
    with pytest.raises(
        fcir.InterpreterError, match=r"needs an array of f32\[3,2\], got f32\[3,4\]$"
    ):
        reference.run(module, jnp.ones(2), jnp.ones((3, 4)))


# --- arguments a backend is called with that are not the captured ones -----------------------


@pytest.fixture(scope="module")
def module():
    @fcir.program(placements={"clients": N})
    def rnd(w, x):
        upd = fcir.map_fn(lambda w, x: w + x.mean(0), (fcir.broadcast(w), x))
        return fcir.reduce_mean(upd)

    return fcir.capture(rnd, *_ARGS)


_BACKENDS = {
    "reference": lambda m, *a: reference.run(m, *a),
    "xla": lambda m, *a: xla.compile(m)(*a),
}


@pytest.mark.parametrize("backend", sorted(_BACKENDS))
@pytest.mark.parametrize(
    "bad, said",
    [("w", r"of type str \('w'\)"), (None, "None"), ([0.0, 0.0, 0.0], "a list of 3 item")],
)
def test_an_argument_that_is_not_an_array_is_an_fcir_error_naming_it(module, backend, bad, said):
    """Before: a str was JAX's TypeError, None and a list 'takes 2 array leaves, got 1/4'."""
    with pytest.raises(
        fcir.InterpreterError, match=rf"argument \[0\] of @rnd is {said}.*an array of f32\[3\]"
    ):
        _BACKENDS[backend](module, bad, _ARGS[1])


@pytest.mark.parametrize("backend", sorted(_BACKENDS))
def test_too_few_or_many_arguments_say_what_the_program_takes(module, backend):
    expected = r"@rnd takes 2 arguments \(f32\[3\], f32\[4,5,3\]\), as it was captured; got "
    with pytest.raises(fcir.InterpreterError, match=expected + "1"):
        _BACKENDS[backend](module, _ARGS[0])
    with pytest.raises(fcir.InterpreterError, match=expected + "3"):
        _BACKENDS[backend](module, *_ARGS, _ARGS[0])
