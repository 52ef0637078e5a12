"""The HLO flop counter (fcir/interpreters/xla/hlo_flops.py): XLA's cost-analysis rules,
applied to the HLO text, on every platform.

Where XLA's own analysis of the unoptimized HLO exists (JAX runs it on CPU only), the
counter agrees with it exactly, but for a ``custom-call`` (XLA -1, the counter 0). The
rest pins what XLA's analysis does not give: every iteration of a loop."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from corpus import CASES, case
from fcir.interpreters.xla import hlo_flops

F32 = jax.ShapeDtypeStruct((8,), jnp.float32)
I32 = jax.ShapeDtypeStruct((8,), jnp.int32)

on_cpu = pytest.mark.skipif(
    jax.default_backend() != "cpu",
    reason="compares with XLA's analysis of the unoptimized HLO, which JAX runs on the CPU "
    "backend only (Lowered.cost_analysis() is None on a TPU or GPU)",
)


def compare_with_xla(fn, *specs) -> None:
    lowered = jax.jit(fn).lower(*specs)
    ours = hlo_flops.count(lowered.as_text("hlo"))
    xla = lowered.cost_analysis()
    # XLA counts a custom-call (a LAPACK routine, a sharding annotation) as -1 flops.
    assert ours.flops_loops_once - ours.custom_calls == xla["flops"]
    assert ours.transcendentals_loops_once == xla.get("transcendentals", 0.0)


def _gradient(c):
    return jax.grad(lambda *a: c.loss(c.fn(*a)), argnums=c.grad_argnums)


@on_cpu
@pytest.mark.parametrize("name", [c.name for c in CASES])
def test_corpus_program_and_its_gradient_count_as_xla_counts(name):
    c = case(name)
    args = c.make_args()
    compare_with_xla(c.fn, *args)
    if c.grad_argnums and c.loss:
        compare_with_xla(_gradient(c), *args)


def _conv(x, y, **kw):
    return jax.lax.conv_general_dilated(x.reshape(1, 2, 4), y.reshape(2, 2, 2), **kw)


SINGLE_OPS = {
    "elementwise": lambda x, y, i: jnp.tanh(x) * y + jnp.exp(x) - (i >> 1).astype(x.dtype),
    "convolution, padded and dilated": lambda x, y, i: _conv(
        x, y, window_strides=(2,), padding=[(3, 4)], lhs_dilation=(2,), rhs_dilation=(3,)
    ),
    "grouped convolution": lambda x, y, i: jax.lax.conv_general_dilated(
        x.reshape(1, 2, 4), y[:4].reshape(2, 1, 2), (1,), "SAME", feature_group_count=2
    ),
    "cumsum (reduce-window)": lambda x, y, i: jnp.cumsum(x),
    "max pool gradient (select-and-scatter)": lambda x, y, i: jax.grad(
        lambda x: jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (2,), (2,), "VALID").sum()
    )(x),
    "scatter-add": lambda x, y, i: x.at[i % 8].add(y),
    "sort of two keys": lambda x, y, i: jax.lax.sort((x, y)),
    "argmax (variadic reduce)": lambda x, y, i: jnp.argmax(jnp.outer(x, y), axis=0),
    "fft": lambda x, y, i: jnp.fft.fft(x).real,
    "cholesky (a custom call)": lambda x, y, i: jnp.linalg.cholesky(jnp.outer(x, x) + jnp.eye(8)),
    "cond": lambda x, y, i: jax.lax.cond(x[0] > 0, lambda: x * y, lambda: jnp.sin(x)),
    "random normal": lambda x, y, i: jax.random.normal(jax.random.key(0), (8,)) + x,
}


@on_cpu
@pytest.mark.parametrize("what", list(SINGLE_OPS))
def test_single_ops_count_as_xla_counts(what):
    compare_with_xla(SINGLE_OPS[what], F32, F32, I32)


def _scan(length):
    def f(w, xs):
        return jax.lax.scan(lambda w, x: (jnp.tanh(x @ w), None), w, xs)[0]

    specs = (
        jax.ShapeDtypeStruct((8, 8), jnp.float32),
        jax.ShapeDtypeStruct((length, 8, 8), jnp.float32),
    )
    return hlo_flops.count(jax.jit(f).lower(*specs).as_text("hlo"))


def test_a_scan_counts_every_iteration_and_xlas_count_once():
    one, two, five = _scan(1), _scan(2), _scan(5)
    step = two.flops - one.flops  # an iteration: x @ w, 2 * 8 * 8 * 8, and the counter
    assert 2 * 8**3 <= step <= 2 * 8**3 + 4
    assert five.flops == one.flops + 4 * step
    assert five.transcendentals == 5 * 64 and five.transcendentals_loops_once == 64
    assert one.flops_loops_once == two.flops_loops_once == five.flops_loops_once == one.flops
    assert five.unknown_trip_counts == 0


def test_fori_loop_with_static_bounds_counts_its_trips():
    def f(x):
        return jax.lax.fori_loop(0, 7, lambda i, c: c * 2.0, x)

    counted = hlo_flops.count(jax.jit(f).lower(F32).as_text("hlo"))
    assert counted.flops >= 7 * 8 and counted.flops == 7 * counted.flops_loops_once


def test_a_loop_whose_trip_count_depends_on_data_counts_once_and_says_so():
    def f(x):
        return jax.lax.while_loop(lambda c: c[0] < 10.0, lambda c: c * 2.0, x)

    counted = hlo_flops.count(jax.jit(f).lower(F32).as_text("hlo"))
    assert counted.unknown_trip_counts == 1 and counted.flops == counted.flops_loops_once


def test_dot_and_convolution_counts_are_multiply_adds_times_two():
    dot = jax.jit(lambda a, b: a @ b).lower(
        jax.ShapeDtypeStruct((4, 8), jnp.float32), jax.ShapeDtypeStruct((8, 3), jnp.float32)
    )
    assert hlo_flops.count(dot.as_text("hlo")).flops == 2 * 4 * 3 * 8
    # NCW input 1x2x6, kernel OIW 3x2x3, VALID: 4 outputs, each 3 x 2 x 3 multiply-adds.
    conv = jax.jit(lambda x, k: jax.lax.conv(x, k, (1,), "VALID")).lower(
        jax.ShapeDtypeStruct((1, 2, 6), jnp.float32), jax.ShapeDtypeStruct((3, 2, 3), jnp.float32)
    )
    assert hlo_flops.count(conv.as_text("hlo")).flops == 2 * 4 * 3 * 2 * 3


@pytest.mark.skipif(
    jax.default_backend() != "cpu",
    reason="about XLA:CPU's optimized module: another platform's compiler rewrites the "
    "ops it is given (a TPU's dot can become a convolution), so its count is its own",
)
def test_the_text_of_an_optimized_module_counts_too():
    """The compiled module's text (fusions, XLA's ``%``-prefixed names on some versions)
    counts its fused computations."""

    def f(w, x):
        return jnp.tanh(x @ w).sum()

    specs = jax.ShapeDtypeStruct((8, 8), jnp.float32), jax.ShapeDtypeStruct((8, 8), jnp.float32)
    lowered = jax.jit(f).lower(*specs)
    optimized = hlo_flops.count(lowered.compile().as_text())
    assert optimized.flops >= 2 * 8**3 and optimized.transcendentals == 64
