"""Example-count-weighted FedAvg with ``reduce_weighted_mean``.

Clients hold different numbers of examples, padded to a common length; each trains
on its valid examples only and reports its example count as a float weight, so the
map body returns a (delta, weight) pair and the weight is a placed scalar ``f32[n]``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import fcir

from . import loops, mlp
from .case import Case, sum_of_squares
from .oracle_jit import oracle_jit

NUM_CLIENTS = 6
MAX_EXAMPLES = 8
STEPS = 2
D_IN, HIDDEN, D_OUT = 5, 8, 1
LR = 0.1
DRJAX_EXPRESSIBLE = True


def masked_mse(params, x, y, mask):
    sq = jnp.sum(jnp.square(mlp.apply(params, x) - y), axis=-1)
    return jnp.sum(jnp.where(mask, sq, 0.0)) / (jnp.sum(mask) * D_OUT)


def local_update(params, x, y, count):
    mask = jnp.arange(MAX_EXAMPLES) < count

    def step(p, _):
        grads = jax.grad(masked_mse)(p, x, y, mask)
        return jax.tree.map(lambda w, g: w - LR * g, p, grads), None

    trained, _ = jax.lax.scan(step, params, None, length=STEPS)
    delta = jax.tree.map(lambda new, old: new - old, trained, params)
    return delta, count.astype(jnp.float32)


def build(api=fcir, *, tree_weights: bool = False):
    """``tree_weights``: pass one weight per leaf (DrJAX's ``reduce_weighted_mean``
    needs weights with the structure of the values); fcir takes a placed scalar."""

    @api.program(placements={"clients": NUM_CLIENTS})
    def fedavg_weighted(params, x, y, counts):
        deltas, weights = api.map_fn(local_update, (api.broadcast(params), x, y, counts))
        if tree_weights:
            weights = jax.tree.map(lambda _: weights, deltas)
        mean_delta = api.reduce_weighted_mean(deltas, weights)
        return jax.tree.map(lambda p, d: p + d, params, mean_delta)

    return fedavg_weighted


def build_drjax(api):
    return build(api, tree_weights=True)


def make_args():
    rng = np.random.default_rng(8)
    params = mlp.init_params(rng, D_IN, HIDDEN, D_OUT)
    x, y = mlp.regression_data(rng, (NUM_CLIENTS, MAX_EXAMPLES), D_IN, D_OUT)
    counts = jnp.asarray([8, 2, 5, 3, 8, 6], jnp.int32)
    return params, x, y, counts


def example_weighted_mse(params, x, y, example_weight):
    return jnp.sum(example_weight[:, None] * jnp.square(mlp.apply(params, x) - y)) / D_OUT


@oracle_jit
def _oracle_client(params, x, y, counts, i):
    # Each of the first counts[i] examples weighs 1/counts[i]; the padding weighs 0.
    n_i = counts[i].astype(jnp.float32)
    example_weight = jnp.where(jnp.arange(MAX_EXAMPLES) < counts[i], 1.0 / n_i, 0.0)
    local = params
    for _ in range(STEPS):
        local, _ = mlp.sgd_step(example_weighted_mse, local, (x[i], y[i], example_weight), LR)
    return jax.tree.map(jnp.subtract, local, params), n_i


@oracle_jit
def _oracle_server(params, deltas, weights):
    return jax.tree.map(jnp.add, params, loops.weighted_mean(deltas, weights))


def oracle(params, x, y, counts):
    deltas, weights = zip(*[_oracle_client(params, x, y, counts, i) for i in range(NUM_CLIENTS)])
    return _oracle_server(params, list(deltas), list(weights))


CASE = Case(
    name="fedavg_weighted",
    fn=build(),
    make_args=make_args,
    oracle=oracle,
    grad_argnums=(0,),
    loss=sum_of_squares,
)
