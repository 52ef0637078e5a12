"""Streamed rounds give the reference's numbers: a member op reading the results of two
maps, and f16 / bf16 sums accumulated in f32."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fcir.interpreters import reference, xla

import fcir


def _assert_bitwise(got, want) -> None:
    got, want = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        a, b = np.asarray(a), np.asarray(b)
        assert (a.dtype, a.shape) == (b.dtype, b.shape), i
        assert a.tobytes() == b.tobytes(), f"leaf {i}: {np.max(np.abs(a - b))}"


# --- streaming: a member op reading the results of two maps -------------------------------

STREAMED = 7


@fcir.program(placements={"clients": STREAMED})
def _two_maps(x, t):
    a = fcir.map_fn(jnp.sin, x)
    b = fcir.map_fn(lambda x: jnp.cos(x) * 2.0, x)
    return fcir.reduce_sum(a + b), fcir.reduce_weighted_mean(a, fcir.map_fn(jnp.exp, t))


@fcir.program(placements={"clients": STREAMED})
def _min_and_weighted_mean(w, x, t):
    g = fcir.map_fn(lambda w, x: jnp.tanh(w * x), (fcir.broadcast(w), x))
    return jnp.sum(fcir.reduce_min(g)) + jnp.sum(fcir.reduce_weighted_mean(g, t))


def _streamed_args():
    rng = np.random.default_rng(3)
    w = rng.normal(size=(3,)).astype(np.float32)
    x = rng.normal(size=(STREAMED, 3)).astype(np.float32)
    t = rng.uniform(size=(STREAMED,)).astype(np.float32)
    return w, x, t


@pytest.mark.parametrize(
    "program",
    [
        # map(f, x) + map(g, x): the add was absorbed by both streams.
        lambda w, x, t: _two_maps(x, t),
        # The gradient's backward maps add the cotangents of both reductions.
        jax.grad(_min_and_weighted_mean, argnums=(0, 1, 2)),
    ],
    ids=["two_maps_added", "gradient_of_min_and_weighted_mean"],
)
@pytest.mark.parametrize("k", [1, 3, STREAMED])
def test_streaming_an_op_on_two_maps_results_matches_the_reference(program, k):
    # Was: "XLA could not run the program: KeyError: Value({f32[3]}@clients)".

    args = _streamed_args()
    module = fcir.capture(program, *args)
    want = reference.run(module, *args)
    got = xla.compile(module, clients_per_step=k)(*args)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


# --- streaming: f16 / bf16 sums accumulate in f32, as the reference and jnp.sum ----------


@fcir.program(placements={"clients": 5})
def _low_precision_aggregates(x, t):
    y = fcir.map_fn(lambda x: x * 1, x)
    return fcir.reduce_sum(y), fcir.reduce_mean(y), fcir.reduce_weighted_mean(y, t)


@pytest.mark.parametrize(
    ("dtype", "members", "weights"),
    [
        # Five 20000s: their f16 sum (100000) overflows f16, their mean does not.
        (np.float16, [20000.0, 20000.0, 20000.0], [3, 3, 3, 3, 3]),
        # A bf16 running sum drops 0.01 next to 256.
        (jnp.bfloat16, [256.0, 1.0, 0.01], [1, 300, 1, 1, 1]),
    ],
    ids=["f16_overflow", "bf16_small_terms"],
)
@pytest.mark.parametrize("k", [1, 2, 3])
def test_streamed_low_precision_sums_are_the_reference_sums(dtype, members, weights, k):
    # Was: a running accumulator in the result dtype, rounded every chunk: the f16 mean
    # was inf, the bf16 weighted mean 3 ulps off (0.0101929 for 0.0100098).

    x = (np.ones((5, 3)) * np.array(members)).astype(dtype)
    t = np.asarray(weights).astype(dtype)
    module = fcir.capture(_low_precision_aggregates, x, t)
    want = reference.run(module, x, t)
    _assert_bitwise(xla.compile(module, clients_per_step=k)(x, t), want)
    _assert_bitwise(xla.compile(module)(x, t), want)
