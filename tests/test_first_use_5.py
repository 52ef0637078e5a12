"""Defects a first-time user finds (fifth hunt): each test is the plausible program or
call, and what it must give: the numbers plain JAX gives, or an ``fcir.FcirError`` that
says what to do."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fcir.interpreters import reference, xla
from fcir.interpreters.reference import ReferenceInterpreter

import fcir

# --- @fcir.impl with a misspelt op name: the method was dead code --------------------------


def test_a_misspelt_fed_op_name_in_impl_is_an_error_naming_the_closest_op():
    with pytest.raises(fcir.FcirError, match=r"'fed\.braodcast'.*did you mean 'fed\.broadcast'"):

        class Count(ReferenceInterpreter):
            @fcir.impl("fed.braodcast")
            def broadcast(self, op, x):
                return super().broadcast(op, x)


def test_impl_refuses_unprefixed_and_unknown_fcir_names_but_takes_any_jax_primitive_name():
    with pytest.raises(fcir.FcirError, match=r"did you mean 'fed\.broadcast'"):
        fcir.impl("broadcast")
    with pytest.raises(fcir.FcirError, match=r"did you mean 'jax\.scan'"):
        fcir.impl("scan")
    with pytest.raises(fcir.FcirError, match=r"did you mean 'fcir\.constant'"):
        fcir.impl("fcir.constnat")
    with pytest.raises(fcir.FcirError, match="an op name is fed"):
        fcir.impl("jax.not a name")
    # jax.* is JAX's open set of primitives (different per JAX version, and an
    # interpreter may implement one the running JAX lacks): taken as written.
    for name in ("jax.scan", "jax.scatter-add", "jax.a_primitive_of_another_jax"):
        assert fcir.impl(name)(lambda self, op: None).fcir_ops == (name,)


def test_an_impl_spelt_right_still_runs_in_place_of_the_inherited_one():
    seen = []

    class Count(ReferenceInterpreter):
        @fcir.impl("fed.broadcast")
        def broadcast(self, op, x):
            seen.append(op.attrs["to"])
            return super().broadcast(op, x)

    @fcir.program(placements={"clients": 2})
    def echo(w):
        return fcir.reduce_sum(fcir.broadcast(w))

    assert float(Count().run(fcir.capture(echo, jnp.float32(3.0)), jnp.float32(3.0))) == 6.0
    assert seen == ["clients"]


# --- the reference's mean: a division by n, where jnp.mean (and xla) multiply by 1/n -------


@pytest.mark.parametrize("dtype", [np.int32, np.int8, np.uint8, np.bool_, np.float32])
def test_the_reference_mean_is_bitwise_jnp_mean_and_xla_for_int_and_scalar_members(dtype):
    n = 7

    @fcir.program(placements={"clients": n})
    def mean_of(x):
        return fcir.reduce_mean(x)

    rng = np.random.default_rng(0)
    # Scalars and vectors; totals below 2**24, so every summation order adds exactly.
    jnp_mean = jax.jit(lambda x: jnp.mean(x, axis=0))
    for shape in [(), (5,)]:
        low = 0 if dtype in (np.uint8, np.bool_) else -100
        xs = rng.integers(low, 100, (10, n, *shape)).astype(dtype)
        module = fcir.capture(mean_of, xs[0])
        exe = xla.compile(module)
        for x in xs:
            expected = np.asarray(jnp_mean(x))
            np.testing.assert_array_equal(np.asarray(reference.run(module, x)), expected)
            np.testing.assert_array_equal(np.asarray(exe(x)), expected)


def test_the_int_mean_of_three_ones_among_seven_clients_is_what_jnp_mean_gives():
    @fcir.program(placements={"clients": 7})
    def share(x):
        return fcir.reduce_mean(x)

    x = np.array([0, 0, 0, 0, 1, 1, 1], np.int32)
    # jnp.mean: 3 * f32(1/7) = 0.42857146; a division 3 / 7 gives 0.42857143, 1 ulp off.
    assert float(jnp.mean(x)) == float(np.float32(3) * (np.float32(1) / np.float32(7)))
    got = reference.run(fcir.capture(share, x), x)
    assert got.dtype == jnp.float32 and float(got) == float(jnp.mean(x))


def test_the_reference_dp_mean_without_noise_is_bitwise_xla_for_scalar_members():
    # dp_mean is dp_sum times 1/n: with noise 0 and no member clipped, what xla gives.
    @fcir.program(placements={"clients": 7})
    def dp_share(x, key):
        return fcir.dp_mean(x, 1.0, 0.0, key)

    rng = np.random.default_rng(0)
    xs = rng.uniform(-0.3, 0.3, (10, 7)).astype(np.float32)
    key = jax.random.key(1)
    module = fcir.capture(dp_share, xs[0], key)
    exe = xla.compile(module)
    for x in xs:
        np.testing.assert_array_equal(np.asarray(reference.run(module, x, key)), exe(x, key))


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


# --- an interpreter's unsupported table: a plain string was taken for a method name -------


def test_an_unsupported_entry_that_is_not_an_unsupported_object_is_refused_at_the_class():
    with pytest.raises(fcir.FcirError, match=r"fcir\.fed\.Unsupported\('use fed\.mean'\)"):

        class NoMedian(ReferenceInterpreter):
            unsupported = {fcir.fed.Median: "use fed.mean"}

    with pytest.raises(fcir.FcirError, match="not a fed op class"):

        class NoMedianByName(ReferenceInterpreter):
            unsupported = {"fed.median": fcir.fed.Unsupported("use fed.mean")}

    class Refuses(ReferenceInterpreter):
        unsupported = {fcir.fed.Median: fcir.fed.Unsupported("use fed.mean")}

    @fcir.program(placements={"clients": 3})
    def middle(x):
        return fcir.reduce_median(x)

    module = fcir.capture(middle, jnp.arange(3.0))
    with pytest.raises(fcir.UnsupportedError, match="fed.median: use fed.mean"):
        Refuses().run(module, jnp.arange(3.0))


def test_a_wrong_argument_shape_is_written_as_the_ir_writes_types_so_the_two_compare():
    module = fcir.capture(_spread, jnp.ones(2), jnp.ones((3, 2)))
    with pytest.raises(
        fcir.InterpreterError, match=r"needs an array of f32\[3,2\], got f32\[3,4\]$"
    ):
        reference.run(module, jnp.ones(2), jnp.ones((3, 4)))
