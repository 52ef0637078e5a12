"""Small rounds that exercise the production export beyond the corpus.

Each round has example arguments in ``EXAMPLE_ARGS`` (so ``fcir export`` can load
``rounds.py:<name>``) and is listed in ``ROUNDS``. ``REJECTED`` holds rounds that must
not export, with the reason their ExportError names.
"""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import numpy as np

import fcir

CLIENTS = 4

Scale = collections.namedtuple("Scale", ["gain", "offset"])


# --- exportable ---------------------------------------------------------------------------


def _predict(params, x):
    h = x @ params["dense"]["kernel"] + params["dense"]["bias"]
    return h * params["scale"].gain + params["scale"].offset


def _local(params, x, y):
    def loss(p):
        return jnp.mean(jnp.square(_predict(p, x) - y))

    value, grads = jax.value_and_grad(loss)(params)
    new = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
    delta = jax.tree.map(lambda a, b: a - b, new, params)
    return delta, value, jnp.int32(x.shape[0])


@fcir.program(placements={"clients": CLIENTS})
def fedavg_pytree(params, x, y):
    """FedAvg with nested dict + namedtuple params; dict output with int metrics."""
    deltas, losses, counts = fcir.map_fn(_local, (fcir.broadcast(params), x, y))
    new = jax.tree.map(lambda p, d: p + d, params, fcir.reduce_mean(deltas))
    return new, {"zloss": fcir.reduce_mean(losses), "examples": fcir.reduce_sum(counts)}


def fedavg_pytree_args():
    rng = np.random.default_rng(0)
    params = {
        "scale": Scale(jnp.float32(1.5), jnp.zeros((2,), jnp.float32)),
        "dense": {
            "kernel": jnp.asarray(rng.normal(size=(3, 2)), jnp.float32),
            "bias": jnp.zeros((2,), jnp.float32),
        },
    }
    x = jnp.asarray(rng.normal(size=(CLIENTS, 5, 3)), jnp.float32)
    y = jnp.asarray(rng.normal(size=(CLIENTS, 5, 2)), jnp.float32)
    return params, x, y


@fcir.program(placements={"clients": CLIENTS})
def weighted(w, x, counts, importance, ints):
    """Scalar int weights, per-element float weights, and int values weighted."""
    preds = fcir.map_fn(lambda w, x: x @ w, (fcir.broadcast(w), x))
    return {
        "by_count": fcir.reduce_weighted_mean(preds, counts),
        "by_element": fcir.reduce_weighted_mean(preds, importance),
        "int_values": fcir.reduce_weighted_mean(ints, counts),
    }


def weighted_args():
    rng = np.random.default_rng(1)
    return (
        jnp.asarray(rng.normal(size=(3,)), jnp.float32),
        jnp.asarray(rng.normal(size=(CLIENTS, 6, 3)), jnp.float32),
        jnp.asarray([3, 1, 4, 2], jnp.int32),
        jnp.asarray(rng.uniform(0.5, 2.0, size=(CLIENTS, 6)), jnp.float32),
        jnp.asarray(rng.integers(-5, 5, size=(CLIENTS, 2)), jnp.int32),
    )


@fcir.program(placements={"clients": CLIENTS})
def secure(small, full, bytes_):
    """secure_sum below the dtype's width (negative values too), at full width, uint8."""
    return (
        fcir.secure_sum(small, bitwidth=5),
        fcir.secure_sum(full, bitwidth=32),
        fcir.secure_sum(bytes_, bitwidth=8),
        fcir.reduce_sum(small),
    )


def secure_args():
    rng = np.random.default_rng(2)
    return (
        jnp.asarray(rng.integers(-40, 40, size=(CLIENTS, 3)), jnp.int32),
        jnp.asarray(rng.integers(-(2**20), 2**20, size=(CLIENTS,)), jnp.int32),
        jnp.asarray(rng.integers(0, 256, size=(CLIENTS, 2)), jnp.uint8),
    )


@fcir.program(placements={"clients": CLIENTS})
def minmax(x, flags):
    """Float min/max and bool min/max ("all flagged", "any flagged")."""
    peak = fcir.map_fn(lambda v: jnp.max(v), x)
    return (
        fcir.reduce_min(x),
        fcir.reduce_max(peak),
        fcir.reduce_min(flags),
        fcir.reduce_max(flags),
    )


def minmax_args():
    rng = np.random.default_rng(3)
    return (
        jnp.asarray(rng.normal(size=(CLIENTS, 3)), jnp.float32),
        jnp.asarray([[True, False], [True, True], [True, False], [True, False]]),
    )


@fcir.program(placements={"clients": CLIENTS})
def server_side(state, unused_server, x, unused_client):
    """Constants broadcast, per-client ops outside map_fn, a reduction of a broadcast
    value, server work that waits for the result, and an argument passed through."""
    two = fcir.broadcast(jnp.float32(2.0))
    scaled = x * 2.0 + 1.0  # per-client elementwise ops at the top level
    s = fcir.map_fn(lambda a, t: jnp.sum(a) * t, (scaled, two))
    decay = jnp.exp(-state["step"].astype(jnp.float32))  # server-only, not broadcast
    total = fcir.reduce_sum(fcir.broadcast(state["w"]))
    return {
        "w": state["w"] * decay + fcir.reduce_mean(s),
        "step": state["step"] + 1,
        "total": total,
        "same": state["w"],
        "data_mean": fcir.reduce_mean(x),
    }


def server_side_args():
    rng = np.random.default_rng(4)
    return (
        {"w": jnp.asarray(rng.normal(size=(2,)), jnp.float32), "step": jnp.int32(3)},
        jnp.float32(7.0),
        jnp.asarray(rng.normal(size=(CLIENTS, 2)), jnp.float32),
        jnp.zeros((CLIENTS, 5), jnp.int32),
    )


@fcir.program(placements={"clients": CLIENTS})
def server_only(w):
    """No federated op at all: every part but server_result is empty."""
    return jnp.tanh(w) * 3.0


def server_only_args():
    return (jnp.arange(3, dtype=jnp.float32),)


@fcir.program(placements={"clients": CLIENTS})
def robust(w, x):
    """Robust aggregates of client updates: the coordinate-wise median and the mean
    without the largest and smallest client per coordinate."""
    upd = fcir.map_fn(lambda w, x: w * jnp.mean(x) - x[:2], (fcir.broadcast(w), x))
    return fcir.reduce_median(upd), fcir.reduce_trimmed_mean(upd, trim=1)


def robust_args():
    rng = np.random.default_rng(6)
    return (
        jnp.asarray(rng.normal(size=(2,)), jnp.float32),
        jnp.asarray(rng.normal(size=(CLIENTS, 5)), jnp.float32),
    )


EXAMPLE_ARGS = {
    "fedavg_pytree": fedavg_pytree_args,
    "robust": robust_args,
    "weighted": weighted_args,
    "secure": secure_args,
    "minmax": minmax_args,
    "server_side": server_side_args,
    "server_only": server_only_args,
}
ROUNDS = {
    "fedavg_pytree": fedavg_pytree,
    "robust": robust,
    "weighted": weighted,
    "secure": secure,
    "minmax": minmax,
    "server_side": server_side,
    "server_only": server_only,
}


# --- rejected -----------------------------------------------------------------------------


@fcir.program(placements={"clients": CLIENTS})
def two_exchanges(w, x):
    """A second broadcast of an aggregate: two exchanges in one round."""
    first = fcir.reduce_mean(fcir.map_fn(lambda w, x: x @ w, (fcir.broadcast(w), x)))
    w2 = w * first
    return fcir.reduce_mean(fcir.map_fn(lambda w, x: x @ w, (fcir.broadcast(w2), x)))


def two_exchanges_args():
    rng = np.random.default_rng(5)
    return (
        jnp.asarray(rng.normal(size=(3,)), jnp.float32),
        jnp.asarray(rng.normal(size=(CLIENTS, 3)), jnp.float32),
    )


def grad_through_round(w, x):
    """Reverse-mode AD through a round: the backward pass broadcasts the cotangent of
    an aggregate, a second exchange."""

    @fcir.program(placements={"clients": CLIENTS})
    def loss(w, x):
        preds = fcir.map_fn(lambda w, x: jnp.tanh(x @ w), (fcir.broadcast(w), x))
        return jnp.square(fcir.reduce_mean(preds))

    return jax.grad(loss)(w, x)


@fcir.program(placements={"clients": CLIENTS})
def rounds_in_a_loop(w, x):
    """Several rounds under lax.fori_loop: federated ops under control flow."""

    def step(_, w):
        return w + fcir.reduce_mean(fcir.map_fn(lambda w, x: x * w, (fcir.broadcast(w), x)))

    return jax.lax.fori_loop(0, 3, step, w)


def rounds_in_a_loop_args():
    return (jnp.float32(0.5), jnp.arange(CLIENTS, dtype=jnp.float32))


@fcir.program(placements={"clients": CLIENTS})
def returns_client_values(w, x):
    return fcir.map_fn(lambda w, x: x * w, (fcir.broadcast(w), x))


@fcir.program(placements={"clients": CLIENTS})
def broadcasts_a_key(key, x):
    """A PRNG key crosses the broadcast: federated_language has no key dtype."""

    def noisy(k, x):
        return x + jax.random.normal(k, x.shape)

    return fcir.reduce_mean(fcir.map_fn(noisy, (fcir.broadcast(key), x)))


def broadcasts_a_key_args():
    return (jax.random.key(0), jnp.zeros((CLIENTS, 3), jnp.float32))


@fcir.program(placements={"silos": 2, "clients": 2})
def two_levels(w, x):
    def silo(w, x):
        return fcir.reduce_mean(fcir.map_fn(lambda w, x: x * w, (fcir.broadcast(w), x)))

    return fcir.reduce_mean(fcir.map_fn(silo, (fcir.broadcast(w), x)))


def two_levels_args():
    return (jnp.float32(2.0), jnp.ones((2, 2, 3), jnp.float32))


# Hand-written IR for what capture itself refuses to produce.
PER_MEMBER_READ_IR = """\
fcir.module @peek ir_version=1 placements=[clients:4]
func @main(%0: {f32[3]}@clients) -> (f32[3]@server) {
  %1: f32[3]@server = jax.reduce_sum %0 {axes=[0], out_sharding=none}
  return %1
}
"""

CLIENT_TO_CLIENT_IR = """\
fcir.module @gossip ir_version=1 placements=[clients:4]
func @main(%0: {f32[3]}@clients) -> (f32[3]@server) {
  %1: {f32[3]}@clients = fed.map %0 {
    ^member(%2: f32[3]):
      %3: f32[3] = jax.psum %2 {axes=["clients"], axis_index_groups=none}
      yield %3
  }
  %4: f32[3]@server = fed.mean %1
  return %4
}
"""

UNBROADCAST_IR = """\
fcir.module @leak ir_version=1 placements=[clients:4]
func @main(%0: f32[]@server, %1: {f32[3]}@clients) -> (f32[3]@server) {
  %2: f32[]@server = jax.exp %0 {accuracy=none}
  %3: {f32[3]}@clients = jax.mul %1, %2 {out_dtype=none}
  %4: f32[3]@server = fed.mean %3
  return %4
}
"""

ILL_TYPED_IR = """\
fcir.module @bad ir_version=1 placements=[clients:4]
func @main(%0: {f32[3]}@clients) -> (f32[2]@server) {
  %1: f32[2]@server = fed.mean %0
  return %1
}
"""

# A computed server scalar joining per-client code: copied into client work, whose
# member-level code then holds no server-typed value (regions included).
CONSTANT_CHAIN_IR = """\
fcir.module @chain ir_version=1 placements=[clients:2]
func @main(%0: {f32[3]}@clients) -> (f32[3]@server) {
  %1: f32[]@server = fcir.constant {value=dense<f32[]: 3.0>}
  %2: f32[]@server = jax.exp %1 {accuracy=none}
  %3: {f32[3]}@clients = jax.mul %0, %2 {out_dtype=none}
  %4: f32[3]@server = fed.sum %3
  return %4
}
"""
