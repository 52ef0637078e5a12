"""Sums and means give plain JAX's numbers on every backend: f16 / bf16 members
accumulate in f32, the reference's mean multiplies by 1/n as ``jnp.mean`` does, a
weighted mean of cancelling weights is what its docstring says, and ``secure_sum``
wraps in the reference as in jit."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fcir.interpreters import reference, xla

import fcir

N = 4


# --- f16 / bf16 client data: sums and means accumulate as jnp.sum / jnp.mean do --------------


@fcir.program(placements={"clients": N})
def _sum_and_mean(x):
    return fcir.reduce_sum(x), fcir.reduce_mean(x)


def _plain_sum_and_mean(x):  # the same round without fcir: the member axis is axis 0
    return jnp.sum(x, axis=0), jnp.mean(x, axis=0)


_HALF = [
    # an intermediate sum overflows f16 (max 65504) though the total does not
    np.array([[60000.0], [60000.0], [-60000.0], [-60000.0]], np.float16),
    np.full((N, 1), 60000.0, np.float16),  # the mean is representable, the sum is not
    np.array([[256.0], [1.0], [1.0], [1.0]], jnp.bfloat16),  # bf16 drops the 1s one by one
]


@fcir.program(placements={"clients": N})
def _weighted(x, w):
    return fcir.reduce_weighted_mean(x, w)


@pytest.mark.parametrize("x", _HALF, ids=["f16-cancel", "f16-mean-of-big", "bf16-small-terms"])
def test_half_precision_weighted_mean_equals_jnp_average_on_every_backend(x):
    """Before: the reference interpreter added the weighted members in bf16 one by one
    (256 + 1 + 1 + 1 stayed 256), where jit and jnp.average accumulate in f32."""
    w = np.ones(N, x.dtype)
    want = jnp.average(x, axis=0, weights=w)
    module = fcir.capture(_weighted, x, w)
    for name, got in [
        ("jit", jax.jit(_weighted)(x, w)),
        ("reference", reference.run(module, x, w)),
        ("xla", xla.compile(module)(x, w)),
    ]:
        assert got.dtype == want.dtype, name
        np.testing.assert_array_equal(
            np.asarray(got, np.float32), np.asarray(want, np.float32), name
        )


@fcir.program(placements={"clients": N})
def _dp_unclipped(x, key):  # a clip norm above every member and no noise: the plain sum
    return fcir.dp_sum(x, 1e6, 0.0, key), fcir.dp_mean(x, 1e6, 0.0, key)


@pytest.mark.parametrize("x", _HALF, ids=["f16-cancel", "f16-mean-of-big", "bf16-small-terms"])
def test_half_precision_dp_sum_without_noise_or_clipping_equals_jnp_sum_on_every_backend(x):
    """Before: the reference interpreter added clipped members in the narrow dtype."""
    key = jax.random.key(0)
    want = (jnp.sum(x, axis=0), (jnp.sum(x, axis=0) / N).astype(x.dtype))
    module = fcir.capture(_dp_unclipped, x, key)
    for name, got in [
        ("jit", jax.jit(_dp_unclipped)(x, key)),
        ("reference", reference.run(module, x, key)),
        ("xla", xla.compile(module)(x, key)),
    ]:
        for g, w in zip(got, want):
            assert g.dtype == w.dtype, name
            np.testing.assert_array_equal(
                np.asarray(g, np.float32), np.asarray(w, np.float32), name
            )


@pytest.mark.parametrize("x", _HALF, ids=["f16-cancel", "f16-mean-of-big", "bf16-small-terms"])
def test_half_precision_sum_and_mean_equal_plain_jax_on_every_backend(x):
    want = jax.jit(_plain_sum_and_mean)(x)
    module = fcir.capture(_sum_and_mean, x)
    for name, got in [
        ("jit", jax.jit(_sum_and_mean)(x)),
        ("reference", reference.run(module, x)),
        ("xla", xla.compile(module)(x)),
    ]:
        for g, w in zip(got, want):
            assert g.dtype == w.dtype, name
            np.testing.assert_array_equal(
                np.asarray(g, np.float32), np.asarray(w, np.float32), name
            )


def test_weighted_mean_with_cancelling_weights_is_what_the_docstring_says():
    """The docstring said compiled code returns NaN for a zero total weight; with
    weights that cancel (``[-1, 1, 0, 0]``) it is +-inf, as jnp.average's."""

    @fcir.program(placements={"clients": N})
    def round_(x, w):
        return fcir.reduce_weighted_mean(x, w)

    x = jnp.arange(12.0).reshape(N, 3)
    cancel, zero = jnp.array([-1.0, 1.0, 0.0, 0.0]), jnp.zeros(N)
    got = jax.jit(round_)(x, cancel)
    np.testing.assert_array_equal(got, jnp.average(x, axis=0, weights=cancel))
    assert np.isinf(got).all() and np.isnan(jax.jit(round_)(x, zero)).all()
    assert "+-inf where it is not" in fcir.reduce_weighted_mean.__doc__
    with pytest.raises(fcir.InterpreterError, match="total weight is zero"):
        reference.run(fcir.capture(round_, x, cancel), x, cancel)


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


# --- secure_sum wraps in the reference interpreter as in jit ---------------------


@pytest.mark.parametrize("dtype", ["int8", "int16", "int32", "uint8", "uint16", "uint32"])
def test_reference_secure_sum_wraps_like_jit(dtype):
    bits = np.iinfo(dtype).bits
    widths = sorted({1, bits // 2, bits - 1, bits})

    @fcir.program(placements={"clients": 3})
    def sums(x):
        return tuple(fcir.secure_sum(x, bitwidth=b) for b in widths)

    info = np.iinfo(dtype)
    rng = np.random.default_rng(bits)
    x = rng.integers(info.min, info.max, size=(3, 4), endpoint=True).astype(dtype)
    x[:, 0] = 1 << (bits - 2)  # 3 × 2**(bits-2) wraps a signed full-width sum
    x[:, 1] = info.max
    expected = jax.jit(sums)(x)
    got = reference.run(fcir.capture(sums, x), x)
    for w, e, g in zip(widths, expected, got):
        assert g.dtype == e.dtype and np.array_equal(g, e), (dtype, w, e, g)


def test_int32_full_width_secure_sum_is_minus_2_to_the_30():
    @fcir.program(placements={"clients": 3})
    def s(x):
        return fcir.secure_sum(x, bitwidth=32)

    x = np.full((3, 2), 1 << 30, np.int32)
    np.testing.assert_array_equal(reference.run(fcir.capture(s, x), x), [-(1 << 30)] * 2)
