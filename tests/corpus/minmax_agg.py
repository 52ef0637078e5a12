"""Min/max aggregation: per-client statistics of a broadcast model's residuals.

Each client computes the smallest and largest residual of the model on its data and
its (int32) example count; the server gets the global residual range, the largest
client gradient norm (a clipping bound) and the smallest and largest client sizes.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

import fcir

from . import loops
from .case import Case
from .oracle_jit import oracle_jit

NUM_CLIENTS = 7
EXAMPLES = 10
DIM = 6


def client_stats(w, x, y, valid):
    residual = x @ w - y
    grad = x.T @ jnp.where(valid, residual, 0.0) / jnp.sum(valid)
    return {
        "lo": jnp.min(jnp.where(valid, residual, jnp.inf)),
        "hi": jnp.max(jnp.where(valid, residual, -jnp.inf)),
        "grad_norm": jnp.sqrt(jnp.sum(jnp.square(grad))),
        "count": jnp.sum(valid, dtype=jnp.int32),
    }


@fcir.program(placements={"clients": NUM_CLIENTS})
def minmax_agg(w, x, y, valid):
    stats = fcir.map_fn(client_stats, (fcir.broadcast(w), x, y, valid))
    return {
        "residual_range": (fcir.reduce_min(stats["lo"]), fcir.reduce_max(stats["hi"])),
        "clip_norm": fcir.reduce_max(stats["grad_norm"]),
        "count_range": (fcir.reduce_min(stats["count"]), fcir.reduce_max(stats["count"])),
    }


def make_args():
    rng = np.random.default_rng(10)
    w = rng.normal(size=(DIM,))
    x = rng.normal(size=(NUM_CLIENTS, EXAMPLES, DIM))
    y = rng.normal(size=(NUM_CLIENTS, EXAMPLES))
    valid = np.arange(EXAMPLES) < rng.integers(3, EXAMPLES + 1, (NUM_CLIENTS, 1))
    return (
        jnp.asarray(w, jnp.float32),
        jnp.asarray(x, jnp.float32),
        jnp.asarray(y, jnp.float32),
        jnp.asarray(valid),
    )


@oracle_jit
def _oracle_client(w, x, y, valid, i):
    residual = x[i] @ w - y[i]
    count = jnp.count_nonzero(valid[i])
    return {
        "lo": jnp.min(residual, where=valid[i], initial=jnp.inf),
        "hi": jnp.max(residual, where=valid[i], initial=-jnp.inf),
        "grad_norm": jnp.linalg.norm(x[i].T @ (residual * valid[i]) / count),
        "count": count.astype(jnp.int32),
    }


@oracle_jit
def _oracle_server(stats):
    counts = [s["count"] for s in stats]
    return {
        "residual_range": (
            loops.minimum([s["lo"] for s in stats]),
            loops.maximum([s["hi"] for s in stats]),
        ),
        "clip_norm": loops.maximum([s["grad_norm"] for s in stats]),
        "count_range": (loops.minimum(counts), loops.maximum(counts)),
    }


def oracle(w, x, y, valid):
    return _oracle_server([_oracle_client(w, x, y, valid, i) for i in range(NUM_CLIENTS)])


CASE = Case(
    name="minmax_agg",
    fn=minmax_agg,
    make_args=make_args,
    oracle=oracle,
    grad_argnums=(0, 1, 2),
    loss=lambda out: (
        out["residual_range"][1] - out["residual_range"][0] + jnp.square(out["clip_norm"])
    ),
)
