"""Two-level FedAvg: server -> silos -> clients.

The server broadcasts the model to 2 silos; inside each silo's map body the silo
broadcasts it on to its 3 clients, maps local SGD over them and averages their
deltas (and losses) to the silo; the server then averages the silo results.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import fcir

from . import loops, mlp
from .case import Case, sum_of_squares
from .oracle_jit import oracle_jit

NUM_SILOS = 2
CLIENTS_PER_SILO = 3
STEPS = 2
BATCH = 4
D_IN, HIDDEN, D_OUT = 4, 8, 1
LR = 0.05


def client_update(params, x, y):
    trained, loss = mlp.sgd_steps(mlp.mse, params, (x, y), LR)
    return jax.tree.map(lambda new, old: new - old, trained, params), loss


def silo_round(params, x, y):
    deltas, losses = fcir.map_fn(client_update, (fcir.broadcast(params), x, y))
    return fcir.reduce_mean(deltas), fcir.reduce_mean(losses)


@fcir.program(placements={"silos": NUM_SILOS, "clients": CLIENTS_PER_SILO})
def hierarchical_fedavg(params, x, y):
    deltas, losses = fcir.map_fn(silo_round, (fcir.broadcast(params), x, y))
    new_params = jax.tree.map(lambda p, d: p + d, params, fcir.reduce_mean(deltas))
    return new_params, fcir.reduce_mean(losses)


def make_args():
    rng = np.random.default_rng(14)
    params = mlp.init_params(rng, D_IN, HIDDEN, D_OUT)
    shape = (NUM_SILOS, CLIENTS_PER_SILO, STEPS, BATCH)
    x, y = mlp.regression_data(rng, shape, D_IN, D_OUT)
    return params, x, y


@oracle_jit
def _oracle_client(params, x, y, s, c):
    local, losses = params, []
    for t in range(STEPS):
        local, loss = mlp.sgd_step(mlp.mse, local, (x[s, c, t], y[s, c, t]), LR)
        losses.append(loss)
    return jax.tree.map(jnp.subtract, local, params), loops.total(losses) / STEPS


@oracle_jit
def _oracle_aggregate(params, deltas, losses):
    """deltas[s][c], losses[s][c] -> the server's new model and mean loss."""
    silo_deltas = [loops.mean(per_client) for per_client in deltas]
    silo_losses = [loops.mean(per_client) for per_client in losses]
    mean_delta = loops.mean(silo_deltas)
    return jax.tree.map(jnp.add, params, mean_delta), loops.mean(silo_losses)


def oracle(params, x, y):
    deltas, losses = [], []
    for s in range(NUM_SILOS):
        results = [_oracle_client(params, x, y, s, c) for c in range(CLIENTS_PER_SILO)]
        deltas.append([d for d, _ in results])
        losses.append([loss for _, loss in results])
    return _oracle_aggregate(params, deltas, losses)


CASE = Case(
    name="hierarchical_fedavg",
    fn=hierarchical_fedavg,
    make_args=make_args,
    oracle=oracle,
    grad_argnums=(0,),
    loss=sum_of_squares,
    hierarchical=True,
    exportable=False,
)
