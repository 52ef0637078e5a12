"""FedAvg on a two-layer MLP.

Each client starts from the broadcast model and runs several SGD steps, one per
batch, with ``lax.scan``; the server adds the mean client delta to its model.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import fcir

from . import loops, mlp
from .case import Case, sum_of_squares
from .oracle_jit import oracle_jit

NUM_CLIENTS = 8
STEPS = 3
BATCH = 4
D_IN, HIDDEN, D_OUT = 8, 16, 2
LR = 0.05
DRJAX_EXPRESSIBLE = True


def local_update(params, x, y):
    """Client: SGD over its batches; returns (delta to the received model, mean loss)."""
    trained, loss = mlp.sgd_steps(mlp.mse, params, (x, y), LR)
    return jax.tree.map(lambda new, old: new - old, trained, params), loss


def build(api=fcir, clients: int = NUM_CLIENTS):
    @api.program(placements={"clients": clients})
    def fedavg_mlp(params, x, y):
        deltas, losses = api.map_fn(local_update, (api.broadcast(params), x, y))
        mean_delta = api.reduce_mean(deltas)
        new_params = jax.tree.map(lambda p, d: p + d, params, mean_delta)
        return new_params, api.reduce_mean(losses)

    return fedavg_mlp


def make_args(clients: int = NUM_CLIENTS, seed: int = 3):
    rng = np.random.default_rng(seed)
    params = mlp.init_params(rng, D_IN, HIDDEN, D_OUT)
    x, y = mlp.regression_data(rng, (clients, STEPS, BATCH), D_IN, D_OUT)
    return params, x, y


@oracle_jit
def _oracle_client(params, x, y, i):
    local, losses = params, []
    for s in range(STEPS):
        local, loss = mlp.sgd_step(mlp.mse, local, (x[i, s], y[i, s]), LR)
        losses.append(loss)
    return jax.tree.map(jnp.subtract, local, params), loops.total(losses) / STEPS


@oracle_jit
def _oracle_server(params, deltas, losses):
    mean_delta = loops.mean(deltas)
    return jax.tree.map(jnp.add, params, mean_delta), loops.mean(losses)


def oracle(params, x, y):
    deltas, losses = zip(*[_oracle_client(params, x, y, i) for i in range(NUM_CLIENTS)])
    return _oracle_server(params, list(deltas), list(losses))


CASE = Case(
    name="fedavg_mlp",
    fn=build(),
    make_args=make_args,
    oracle=oracle,
    grad_argnums=(0, 1, 2),
    loss=sum_of_squares,
)
