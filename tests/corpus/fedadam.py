"""FedAdam: FedAvg clients with ``optax.adam`` as the server optimizer.

The server treats the negated mean client delta as a gradient. Server state (model and
Adam state, which holds an int32 step count) is passed in and returned.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

import fcir

from . import loops, mlp
from .case import Case, sum_of_squares
from .oracle_jit import oracle_jit

NUM_CLIENTS = 5
STEPS = 2
BATCH = 4
D_IN, HIDDEN, D_OUT = 6, 8, 2
CLIENT_LR = 0.05
# eps_root > 0 keeps the gradient of Adam's sqrt(nu) finite when differentiating
# through the server step (optax documents this for meta-learning).
SERVER_OPT = optax.adam(learning_rate=0.01, eps_root=1e-12)
DRJAX_EXPRESSIBLE = True


def local_update(params, x, y):
    trained, _ = mlp.sgd_steps(mlp.mse, params, (x, y), CLIENT_LR)
    return jax.tree.map(lambda new, old: new - old, trained, params)


def server_update(params, opt_state, mean_delta):
    pseudo_grad = jax.tree.map(lambda d: -d, mean_delta)
    updates, opt_state = SERVER_OPT.update(pseudo_grad, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


def build(api=fcir):
    @api.program(placements={"clients": NUM_CLIENTS})
    def fedadam(params, opt_state, x, y):
        deltas = api.map_fn(local_update, (api.broadcast(params), x, y))
        return server_update(params, opt_state, api.reduce_mean(deltas))

    return fedadam


def make_args():
    rng = np.random.default_rng(6)
    params = mlp.init_params(rng, D_IN, HIDDEN, D_OUT)
    adam_state, *rest = SERVER_OPT.init(params)
    # State as after a few earlier rounds: moments and bias corrections not at their start.
    adam_state = adam_state._replace(
        count=jnp.int32(3),
        mu=jax.tree.map(lambda p: jnp.asarray(0.01 * rng.normal(size=p.shape), p.dtype), params),
        nu=jax.tree.map(lambda p: jnp.asarray(1e-4 * rng.random(p.shape), p.dtype), params),
    )
    opt_state = (adam_state, *rest)
    x, y = mlp.regression_data(rng, (NUM_CLIENTS, STEPS, BATCH), D_IN, D_OUT)
    return params, opt_state, x, y


@oracle_jit
def _oracle_client(params, x, y, i):
    local = params
    for s in range(STEPS):
        local, _ = mlp.sgd_step(mlp.mse, local, (x[i, s], y[i, s]), CLIENT_LR)
    return jax.tree.map(jnp.subtract, local, params)


@oracle_jit
def _oracle_server(params, opt_state, deltas):
    return server_update(params, opt_state, loops.mean(deltas))


def oracle(params, opt_state, x, y):
    deltas = [_oracle_client(params, x, y, i) for i in range(NUM_CLIENTS)]
    return _oracle_server(params, opt_state, deltas)


CASE = Case(
    name="fedadam",
    fn=build(),
    make_args=make_args,
    oracle=oracle,
    grad_argnums=(0,),
    loss=sum_of_squares,
)
