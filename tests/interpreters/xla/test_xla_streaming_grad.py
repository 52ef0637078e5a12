"""Reverse mode and DP aggregates under ``clients_per_step``.

Values: ``jax.grad`` of a streamed executable (``exe(*args)``), a captured gradient
program compiled with a budget, and a meta-gradient through a ``lax.scan`` of rounds
equal the unstreamed program's gradient (1e-6 relative, the chunked sums reassociate;
``assert_streamed_equal`` of test_xla_streaming.py); ``dp_*`` and ``ddp_*`` stream to the
unstreamed values (ddp bit for bit) and gradients.

Memory: XLA's temporaries (``Compiled.memory_analysis().temp_size_in_bytes``) of each
program are the same within 1.1x for a cohort 16x larger: no per-member residual is kept
for the backward pass, and the DP aggregates fold clipped chunks into running sums.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fcir.interpreters import xla
from fcir.interpreters.xla.streaming import plan_region
from test_xla_streaming import (
    GRAD_TOL,
    assert_streamed_equal,
    skip_where_memory_analysis_cannot_tell,
)

import fcir

K = 3  # does not divide the cohorts below: every loop has a masked last chunk
D_IN, HIDDEN, D_OUT, BATCH = 6, 8, 3, 2
# XLA's backend optimizations off (LLVM at -O0): for comparisons between two programs
# the test compiles alike, within a tolerance (as test_xla_streaming.py's budgets), and
# for memory analyses. The DP noise's integer bit work made the dp rounds' default
# compiles about three times as costly. Bit-for-bit comparisons keep XLA's defaults,
# as users compile.
FAST = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def local_step(p, x, y):
    """One SGD step on the member's batch: the member's update."""

    def loss(p):
        h = jnp.tanh(x @ p["w1"])
        return jnp.mean(jnp.square(h @ p["w2"] - y))

    return jax.tree.map(lambda g: -0.1 * g, jax.grad(loss)(p))


def model():
    rng = np.random.default_rng(0)
    return {
        "w1": jnp.asarray(rng.normal(size=(D_IN, HIDDEN)) / 3, jnp.float32),
        "w2": jnp.asarray(rng.normal(size=(HIDDEN, D_OUT)) / 3, jnp.float32),
    }


def data(n):
    rng = np.random.default_rng(n)
    x = jnp.asarray(rng.normal(size=(n, BATCH, D_IN)), jnp.float32)
    y = jnp.asarray(rng.normal(size=(n, BATCH, D_OUT)), jnp.float32)
    return x, y


def server_loss(p):
    return sum(jnp.sum(jnp.sin(v)) for v in jax.tree.leaves(p))


def fedavg(n):
    @fcir.program(placements={"clients": n})
    def round_(p, x, y):
        d = fcir.map_fn(local_step, (fcir.broadcast(p), x, y))
        return jax.tree.map(jnp.add, p, fcir.reduce_mean(d))

    return round_


def rounds(n, length=3):
    @fcir.program(placements={"clients": n})
    def train(p, x, y):
        def body(p, _):
            d = fcir.map_fn(local_step, (fcir.broadcast(p), x, y))
            return jax.tree.map(jnp.add, p, fcir.reduce_mean(d)), None

        return jax.lax.scan(body, p, None, length=length)[0]

    return train


def dp_round(n, op):
    @fcir.program(placements={"clients": n})
    def round_(p, x, y, key):
        d = fcir.map_fn(local_step, (fcir.broadcast(p), x, y))
        return jax.tree.map(jnp.add, p, op(d, 0.05, 0.5, key))

    return round_


def ddp_round(n):
    @fcir.program(placements={"clients": n})
    def round_(p, x, y, keys):
        d = fcir.map_fn(local_step, (fcir.broadcast(p), x, y))
        return jax.tree.map(jnp.add, p, fcir.ddp_mean(d, 0.05, 0.5, keys, bits=20))

    return round_


def grad_of(exe, argnums=0):
    return jax.jit(jax.grad(lambda *a: server_loss(exe(*a)), argnums=argnums))


def run_fast(fn, *args):
    """``fn(*args)`` compiled at ``FAST`` (``fn``: an executable or a ``jax.jit``)."""
    return fn.lower(*args).compile(FAST)(*args)


# --- values -------------------------------------------------------------------------------


def test_grad_of_a_streamed_round_equals_the_unstreamed_gradient():
    n = 8
    p, (x, y) = model(), data(n)
    module = fcir.capture(fedavg(n), p, x, y)
    for argnums in (0, (0, 1)):  # the server model; and the client data too
        want = grad_of(xla.compile(module), argnums)(p, x, y)
        got = grad_of(xla.compile(module, clients_per_step=K), argnums)(p, x, y)
        assert_streamed_equal(got, want, exact=False, what=f"grad argnums={argnums}")


@fcir.program(placements={"clients": 7})
def every_reduction(w, x, wt):
    """Each reduction's gradient, an absorbed op, a per-member output, and ties at the
    maximum (rounded values: the gradient is shared by the members at it)."""
    y = fcir.map_fn(lambda w, x: jnp.tanh(x * w), (fcir.broadcast(w), x))
    r = fcir.map_fn(lambda w, x: jnp.round(x) * w, (fcir.broadcast(w), x))
    return {
        "sum": fcir.reduce_sum(jnp.abs(y) * 2.0),
        "mean": fcir.reduce_mean(y),
        "wmean": fcir.reduce_weighted_mean(y, wt),
        "min": fcir.reduce_min(y),
        "max_ties": fcir.reduce_max(r),
        "per_member": y,
    }


def test_every_reduction_and_per_member_output_differentiates_like_unstreamed():
    rng = np.random.default_rng(1)
    w = jnp.asarray(rng.normal(size=3), jnp.float32)
    x = jnp.asarray(rng.integers(-1, 2, size=(7, 3)) + 0.2 * rng.normal(size=(7, 3)), jnp.float32)
    wt = jnp.asarray(rng.uniform(0.5, 2, size=7), jnp.float32)
    module = fcir.capture(every_reduction, w, x, wt)

    def loss(exe):
        return lambda *a: sum(jnp.sum(jnp.cos(v)) for v in jax.tree.leaves(exe(*a)))

    want = jax.jit(jax.grad(loss(xla.compile(module)), argnums=(0, 1, 2)))(w, x, wt)
    for k in (1, 2, 7):
        streamed = xla.compile(module, clients_per_step=k)
        got = jax.jit(jax.grad(loss(streamed), argnums=(0, 1, 2)))(w, x, wt)
        assert_streamed_equal(got, want, exact=False, what=f"k={k}")


def test_captured_gradient_recomputes_the_forward_map_in_the_backward_stream():
    n = 8
    p, (x, y) = model(), data(n)
    grad = jax.grad(lambda p, x, y: server_loss(fedavg(n)(p, x, y)))
    module = fcir.capture(grad, p, x, y)
    forward, backward = plan_region(module.main.body, module.cardinality)
    # The backward map's residuals are the forward map's results: recomputed chunk by
    # chunk, so the forward stream keeps none of them for every member.
    assert forward.map_op in backward.prelude
    assert forward.materialized == [] and backward.materialized == []
    want = xla.compile(module)(p, x, y)
    assert_streamed_equal(
        xla.compile(module, clients_per_step=K)(p, x, y),
        want,
        exact=False,
        what="captured grad",
        tol=GRAD_TOL,
    )


def test_meta_gradient_through_a_scan_of_rounds_equals_the_unstreamed_one():
    n = 8
    p, (x, y) = model(), data(n)
    module = fcir.capture(rounds(n), p, x, y)
    want = grad_of(xla.compile(module))(p, x, y)
    got = grad_of(xla.compile(module, clients_per_step=K))(p, x, y)
    assert_streamed_equal(got, want, exact=False, what="meta-gradient")


@pytest.mark.slow  # 11 s for the two (docs/contributing.md)
@pytest.mark.parametrize("op", [fcir.dp_sum, fcir.dp_mean], ids=["dp_sum", "dp_mean"])
def test_dp_aggregates_stream_as_accumulated_clipped_sums(op):
    n = 8
    p, (x, y) = model(), data(n)
    key = jax.random.key(3)
    module = fcir.capture(dp_round(n, op), p, x, y, key)
    (stream,) = plan_region(module.main.body, module.cardinality)
    assert [r.name for r in stream.reductions] == [f"fed.{op.__name__}"]
    assert stream.materialized == []  # the members' updates are never all kept
    plain = xla.compile(module)
    streamed = xla.compile(module, clients_per_step=K)
    assert_streamed_equal(
        run_fast(streamed, p, x, y, key), run_fast(plain, p, x, y, key), exact=False, what="dp"
    )
    assert_streamed_equal(
        run_fast(grad_of(streamed), p, x, y, key),
        run_fast(grad_of(plain), p, x, y, key),
        exact=False,
        what="grad",
    )


def elementwise_ddp_round(n):
    """A ddp_mean round whose members' updates are elementwise in their data: the same
    bits whatever the batch (a ``dot`` under ``vmap`` is not, on jax 0.12's CPU backend:
    ``local_step`` at 3 members and at 8 differs in the last bit)."""

    @fcir.program(placements={"clients": n})
    def round_(p, x, y, keys):
        d = fcir.map_fn(
            lambda p, x, y: {
                "w1": jnp.tanh(x[:, :, None] * p["w1"]).sum(0) * 0.01,
                "w2": jnp.sin(y[:, None, :] - p["w2"]).sum(0) * 0.01,
            },
            (fcir.broadcast(p), x, y),
        )
        return jax.tree.map(jnp.add, p, fcir.ddp_mean(d, 0.05, 0.5, keys, bits=20))

    return round_


@pytest.mark.slow  # 11 s (docs/contributing.md)
def test_ddp_streams_bit_for_bit_and_differentiates_like_unstreamed():
    n = 8
    p, (x, y) = model(), data(n)
    keys = jax.random.split(jax.random.key(4), n)
    module = fcir.capture(ddp_round(n), p, x, y, keys)
    plain = xla.compile(module)
    streamed = xla.compile(module, clients_per_step=K)
    want = run_fast(grad_of(plain), p, x, y, keys)
    assert any(float(jnp.max(jnp.abs(g))) > 0 for g in jax.tree.leaves(want))
    got = run_fast(grad_of(streamed), p, x, y, keys)
    assert_streamed_equal(got, want, exact=False, what="grad")
    # The encoding makes no float decision XLA may order differently (fcir.mechanisms.ddgauss: a fixed
    # pairwise clip norm, an exact integer norm check), so given the members' updates
    # the streamed sum is the unstreamed one, bit for bit, on every jax: this round's,
    # where the map's dot is batch-invariant (XLA:CPU under jax 0.10; an accelerator's
    # matrix unit tiles a batch of 3 members otherwise than one of 8), else a round whose
    # members are elementwise in their data (compiled at XLA's defaults, as users do).
    if jax.__version_info__ < (0, 11) and jax.default_backend() == "cpu":
        what, got, want = "ddp local_step", streamed(p, x, y, keys), plain(p, x, y, keys)
    else:
        m = fcir.capture(elementwise_ddp_round(n), p, x, y, keys)
        what = "ddp elementwise"
        got, want = xla.compile(m, clients_per_step=K)(p, x, y, keys), xla.compile(m)(p, x, y, keys)
    assert_streamed_equal(got, want, exact=True, what=what)


# --- memory -------------------------------------------------------------------------------

SMALL, LARGE = 24, 384  # 16x


def _temp(compiled) -> int:
    return int(compiled.memory_analysis().temp_size_in_bytes)


# XLA's buffer assignment, which memory_analysis reports, is decided on the HLO, before
# LLVM generates the kernels: compiling at optimization level 0 (``FAST``) gives the
# same temporaries (measured, every program below at both cohorts, jax 0.10.2) at half
# the compile time.


def _programs(n):
    """(name, compiled) for each program at cohort ``n``, streamed ``K`` at a time
    (compiled for their memory analysis only: at ``FAST``)."""
    p, (x, y) = model(), data(n)
    key, keys = jax.random.key(0), jax.random.split(jax.random.key(1), n)
    module = fcir.capture(fedavg(n), p, x, y)
    exe = xla.compile(module, clients_per_step=K)
    grad = jax.grad(lambda p, x, y: server_loss(fedavg(n)(p, x, y)))
    captured = xla.compile(fcir.capture(grad, p, x, y), clients_per_step=K)
    meta = xla.compile(fcir.capture(rounds(n), p, x, y), clients_per_step=K)
    dp = xla.compile(fcir.capture(dp_round(n, fcir.dp_mean), p, x, y, key), clients_per_step=K)
    ddp = xla.compile(fcir.capture(ddp_round(n), p, x, y, keys), clients_per_step=K)
    return {
        "unstreamed jax.grad(exe)": grad_of(xla.compile(module)).lower(p, x, y).compile(FAST),
        "jax.grad(exe)": grad_of(exe).lower(p, x, y).compile(FAST),
        "exe of a captured gradient": captured.lower(p, x, y).compile(FAST),
        "meta-gradient, scan of rounds": grad_of(meta).lower(p, x, y).compile(FAST),
        "dp_mean round": dp.lower(p, x, y, key).compile(FAST),
        "jax.grad of the dp_mean round": grad_of(dp).lower(p, x, y, key).compile(FAST),
        "ddp_mean round": ddp.lower(p, x, y, keys).compile(FAST),
    }


@pytest.mark.slow  # compiles four programs at two cohort sizes
def test_gradient_and_dp_temp_memory_is_flat_in_the_cohort():
    small = {k: _temp(c) for k, c in _programs(SMALL).items()}
    large = {k: _temp(c) for k, c in _programs(LARGE).items()}
    skip_where_memory_analysis_cannot_tell(min(small.values()))
    assert min(small.values()) > 0, small
    ratios = {k: large[k] / small[k] for k in small}
    # The sizes can tell: without a budget, the gradient's temporaries grow with the cohort.
    assert ratios.pop("unstreamed jax.grad(exe)") > 4, ratios
    assert all(r <= 1.1 for r in ratios.values()), ratios
