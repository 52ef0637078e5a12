"""FedProx: FedAvg whose clients add a proximal term ``mu/2 * ||w - w_global||^2``.

The broadcast global model is both the client's starting point and the anchor of
the proximal term, so it is used twice inside the map body (and inside its scan).
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
STEPS = 3
BATCH = 4
D_IN, HIDDEN, D_OUT = 6, 8, 1
LR = 0.05
MU = 0.5
DRJAX_EXPRESSIBLE = True


def prox_loss(params, anchor, x, y):
    prox = sum(
        jnp.sum(jnp.square(p - a)) for p, a in zip(jax.tree.leaves(params), jax.tree.leaves(anchor))
    )
    return mlp.mse(params, x, y) + 0.5 * MU * prox


def local_update(global_params, x, y):
    def step(p, batch):
        grads = jax.grad(prox_loss)(p, global_params, *batch)
        return jax.tree.map(lambda w, g: w - LR * g, p, grads), None

    trained, _ = jax.lax.scan(step, global_params, (x, y))
    return jax.tree.map(lambda new, old: new - old, trained, global_params)


def build(api=fcir):
    @api.program(placements={"clients": NUM_CLIENTS})
    def fedprox(params, x, y):
        deltas = api.map_fn(local_update, (api.broadcast(params), x, y))
        return jax.tree.map(lambda p, d: p + d, params, api.reduce_mean(deltas))

    return fedprox


def make_args():
    rng = np.random.default_rng(5)
    params = mlp.init_params(rng, D_IN, HIDDEN, D_OUT)
    x, y = mlp.regression_data(rng, (NUM_CLIENTS, STEPS, BATCH), D_IN, D_OUT)
    return params, x, y


@oracle_jit
def _oracle_client(params, x, y, i):
    local = params
    for s in range(STEPS):
        mse_grads = jax.grad(mlp.mse)(local, x[i, s], y[i, s])
        # d/dw of mu/2 ||w - w_global||^2 is mu (w - w_global), written out by hand.
        local = jax.tree.map(lambda w, g, a: w - LR * (g + MU * (w - a)), local, mse_grads, params)
    return jax.tree.map(jnp.subtract, local, params)


@oracle_jit
def _oracle_server(params, deltas):
    return jax.tree.map(jnp.add, params, loops.mean(deltas))


def oracle(params, x, y):
    deltas = [_oracle_client(params, x, y, i) for i in range(NUM_CLIENTS)]
    return _oracle_server(params, deltas)


CASE = Case(
    name="fedprox",
    fn=build(),
    make_args=make_args,
    oracle=oracle,
    grad_argnums=(0,),
    loss=sum_of_squares,
)
