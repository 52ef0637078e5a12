"""Robust aggregation: the coordinate-wise median and trimmed mean of client updates.

Each client takes one gradient step of a linear model on its data; one client is
adversarial and sends a huge update. The server gets the median of the updated models
and their trimmed mean (the largest and smallest client dropped per coordinate), both
unmoved by the outlier, and the plain mean for comparison.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import fcir

from . import loops
from .case import Case
from .oracle_jit import oracle_jit

NUM_CLIENTS = 7
EXAMPLES = 6
DIM = 4
LR = 0.1


def local_step(w, x, y):
    grad = jax.grad(lambda w: jnp.mean(jnp.square(x @ w - y)))(w)
    return w - LR * grad


@fcir.program(placements={"clients": NUM_CLIENTS})
def robust_agg(w, x, y):
    updated = fcir.map_fn(local_step, (fcir.broadcast(w), x, y))
    return {
        "median": fcir.reduce_median(updated),
        "trimmed": fcir.reduce_trimmed_mean(updated, trim=1),
        "mean": fcir.reduce_mean(updated),
    }


def make_args():
    rng = np.random.default_rng(21)
    w = rng.normal(size=(DIM,))
    x = rng.normal(size=(NUM_CLIENTS, EXAMPLES, DIM))
    y = rng.normal(size=(NUM_CLIENTS, EXAMPLES))
    y[3] *= 1000.0  # the adversary
    return tuple(jnp.asarray(a, jnp.float32) for a in (w, x, y))


@oracle_jit
def _oracle_client(w, x, y, i):
    return local_step(w, x[i], y[i])


@oracle_jit
def _oracle_server(updates):
    ordered = jnp.sort(jnp.stack(updates), axis=0)
    n = len(updates)
    return {
        "median": ordered[(n - 1) // 2],
        "trimmed": loops.mean([ordered[j] for j in range(1, n - 1)]),
        "mean": loops.mean(updates),
    }


def oracle(w, x, y):
    return _oracle_server([_oracle_client(w, x, y, i) for i in range(NUM_CLIENTS)])


CASE = Case(
    name="robust_agg",
    fn=robust_agg,
    make_args=make_args,
    oracle=oracle,
    grad_argnums=(0, 1),
    loss=lambda out: jnp.sum(out["median"] * out["trimmed"]) + jnp.sum(jnp.square(out["mean"])),
)
