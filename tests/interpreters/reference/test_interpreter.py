"""The Interpreter base class: per-op overrides, fallbacks, debugging switches, errors;
the reference checks a parsed module before running it, as xla does, once per module."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fcir.interpreters import reference, xla
from fcir.interpreters.reference import ReferenceInterpreter

import fcir


@fcir.program(placements={"clients": 3})
def weighted_round(w, x, counts):
    local = fcir.map_fn(lambda w, x: jnp.tanh(x @ w), (fcir.broadcast(w), x))
    return fcir.reduce_weighted_mean(local, counts), fcir.reduce_sum(local)


ARGS = (jnp.ones(4), jnp.arange(24.0).reshape(3, 2, 4) / 24, jnp.array([1.0, 2.0, 3.0]))


@pytest.fixture(scope="module")
def module():
    return fcir.capture(weighted_round, *ARGS)


def test_subclass_overrides_one_op_and_inherits_the_rest(module):
    class DoubleSum(ReferenceInterpreter):
        @fcir.impl("fed.sum")
        def sum(self, op, x):
            return 2 * super().sum(op, x)

    base = reference.run(module, *ARGS)
    doubled = DoubleSum().run(module, *ARGS)
    np.testing.assert_allclose(doubled[1], 2 * base[1], rtol=1e-6)
    np.testing.assert_array_equal(doubled[0], base[0])


def test_counting_bytes_per_placement(module):
    class CountTraffic(ReferenceInterpreter):
        def __init__(self):
            super().__init__()
            self.sent, self.received = 0, 0

        @fcir.impl("fed.broadcast")
        def broadcast(self, op, x):
            out = super().broadcast(op, x)
            self.sent += out.nbytes
            return out

        @fcir.impl("fed.sum")
        def sum(self, op, x):
            self.received += x.nbytes
            return super().sum(op, x)

        @fcir.impl("fed.weighted_mean")
        def weighted_mean(self, op, x, w):
            self.received += x.nbytes + w.nbytes
            return super().weighted_mean(op, x, w)

    counter = CountTraffic()
    counter.run(module, *ARGS)
    assert counter.sent == 3 * 4 * 4  # f32[4] to each of 3 clients
    assert counter.received == 2 * (3 * 2 * 4) + 3 * 4


def test_base_interpreter_under_jit_is_bitwise_the_original(module):
    expected = jax.jit(weighted_round)(*ARGS)
    actual = jax.jit(lambda *a: fcir.Interpreter().run(module, *a))(*ARGS)
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
        np.testing.assert_array_equal(a, e)


def test_intermediates_are_keyed_by_printed_value_numbers(module):
    out, values = reference.run(module, *ARGS, intermediates=True)
    text = module.to_text()
    for number in values:
        assert f"%{number}:" in text or f"%{number} " in text
    final = [int(t.strip(" %")) for t in text.split("return")[-1].split("\n")[0].split(",")]
    np.testing.assert_array_equal(values[final[0]], out[0])


def test_verbose_logs_each_op(module, caplog):
    caplog.set_level("INFO", logger="fcir.interpreter")
    ReferenceInterpreter(verbose=True).run(module, *ARGS)
    logged = [r.getMessage() for r in caplog.records]
    assert "fed.broadcast" in logged and "fed.weighted_mean" in logged


def test_zero_total_weight_is_an_error_naming_the_op(module):
    with pytest.raises(fcir.InterpreterError, match=r"fed\.weighted_mean.*total weight is zero"):
        reference.run(module, ARGS[0], ARGS[1], jnp.zeros(3))


def test_zero_total_weight_in_compiled_code_is_nan(module):
    # Documented: compiled code divides 0 by 0 and returns NaN instead of raising.
    out = jax.jit(weighted_round)(ARGS[0], ARGS[1], jnp.zeros(3))
    assert np.all(np.isnan(out[0]))


def test_wrong_arguments_are_reported_with_types(module):
    with pytest.raises(
        fcir.InterpreterError, match=r"argument leaf 1 .* needs an array of f32\[3,2,4\]"
    ):
        reference.run(module, ARGS[0], jnp.ones((2, 2, 4)), ARGS[2])
    with pytest.raises(fcir.InterpreterError, match="takes 3 arguments"):
        reference.run(module, ARGS[0])


def test_op_without_implementation_names_itself(module):
    text = module.to_text().replace("fed.sum", "fed.frobnicate")
    broken = fcir.parse(text)
    # The reference checks the module first (as xla.compile does): the checker names it.
    with pytest.raises(fcir.IRTypeError, match="unknown federated op fed.frobnicate"):
        reference.run(broken, *ARGS)
    # An interpreter that runs it unchecked has no implementation of it, and says so.
    with pytest.raises(fcir.UnsupportedError, match="no implementation of fed.frobnicate"):
        fcir.Interpreter().run(broken, *ARGS)


def test_reference_full_width_signed_secure_sum_wraps_like_jnp_sum():
    """A full-width secure sum of a signed dtype is the wrapped signed sum (the bits
    modulo 2**bits read as signed), as fed.secure_sum's jnp lowering gives it."""

    @fcir.program(placements={"clients": 3})
    def agg(x):
        return fcir.secure_sum(x, bitwidth=16), fcir.secure_sum(x, bitwidth=12)

    x = jnp.array([[30000, -5], [30000, -7], [-1, 2]], jnp.int16)
    module = fcir.capture(agg, x)
    full, low = reference.run(module, x)
    assert full.dtype == jnp.int16
    np.testing.assert_array_equal(full, np.array([59999 - 65536, -10], np.int16))
    np.testing.assert_array_equal(full, agg(x)[0])
    np.testing.assert_array_equal(low, np.array([59999 % 4096, (-10) % 4096], np.int16))


# --- the reference ran IR that fcir check (and xla) refuse ---------------------------------


@fcir.program(placements={"clients": 3})
def _spread(w, x):
    return fcir.reduce_mean(fcir.map_fn(lambda w, x: w * x, (fcir.broadcast(w), x)))


def test_the_reference_refuses_an_ill_typed_ir_file_naming_the_op_as_xla_does():
    w, x = jnp.ones(2), jnp.ones((3, 2))
    text = fcir.capture(_spread, w, x).to_text()
    # An edited file: the mean (and so the program) now claims to give f16, while the
    # members are f32.
    edited = text.replace("f32[2]@server = fed.mean", "f16[2]@server = fed.mean")
    edited = edited.replace("-> (f32[2]@server)", "-> (f16[2]@server)")
    assert edited != text
    module = fcir.parse(edited)
    with pytest.raises(fcir.FcirError, match=r"fed\.mean.*C3"):
        xla.compile(module)
    with pytest.raises(fcir.FcirError, match=r"fed\.mean.*C3"):
        reference.run(module, w, x)
    # The file as written runs, and a parsed module is checked once, not per call.
    good = fcir.parse(text)
    assert np.asarray(reference.run(good, w, x)).tolist() == [1.0, 1.0]
    from fcir.frontend import jaxpr_cache as captured

    assert captured.checked(good)
