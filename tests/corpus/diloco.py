"""DiLoCo: local AdamW on every client, Nesterov momentum on the server.

Each client runs ``optax.adamw`` for a few steps via ``lax.scan``, starting from the
broadcast model and a fresh inner optimizer state created inside the map body. The
server treats ``model - mean(local models)`` as the outer gradient and applies
``optax.sgd(momentum=0.9, nesterov=True)``; model and momentum are passed in and out.
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

NUM_CLIENTS = 4
INNER_STEPS = 3
BATCH = 4
D_IN, HIDDEN, D_OUT = 6, 8, 2
# eps_root > 0 keeps gradients through Adam's sqrt(nu) finite (see optax docs).
INNER_OPT = optax.adamw(learning_rate=1e-2, weight_decay=1e-2, eps_root=1e-8)
OUTER_OPT = optax.sgd(learning_rate=0.7, momentum=0.9, nesterov=True)
DRJAX_EXPRESSIBLE = True


def inner_step(carry, batch):
    params, state = carry
    value, grads = jax.value_and_grad(mlp.mse)(params, *batch)
    updates, state = INNER_OPT.update(grads, state, params)
    return (optax.apply_updates(params, updates), state), value


def local_update(params, x, y):
    (trained, _), _ = jax.lax.scan(inner_step, (params, INNER_OPT.init(params)), (x, y))
    return jax.tree.map(lambda new, old: new - old, trained, params)


def server_update(params, opt_state, mean_delta):
    outer_grad = jax.tree.map(lambda d: -d, mean_delta)
    updates, opt_state = OUTER_OPT.update(outer_grad, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


def build(api=fcir):
    @api.program(placements={"clients": NUM_CLIENTS})
    def diloco(params, opt_state, x, y):
        deltas = api.map_fn(local_update, (api.broadcast(params), x, y))
        return server_update(params, opt_state, api.reduce_mean(deltas))

    return diloco


def make_args():
    rng = np.random.default_rng(7)
    params = mlp.init_params(rng, D_IN, HIDDEN, D_OUT)
    trace_state, *rest = OUTER_OPT.init(params)
    # Momentum as after earlier rounds, not zero.
    trace_state = trace_state._replace(
        trace=jax.tree.map(lambda p: jnp.asarray(0.05 * rng.normal(size=p.shape), p.dtype), params)
    )
    opt_state = (trace_state, *rest)
    x, y = mlp.regression_data(rng, (NUM_CLIENTS, INNER_STEPS, BATCH), D_IN, D_OUT)
    return params, opt_state, x, y


@oracle_jit
def _oracle_client(params, x, y, i):
    local, state = params, INNER_OPT.init(params)
    for s in range(INNER_STEPS):
        grads = jax.grad(mlp.mse)(local, x[i, s], y[i, s])
        updates, state = INNER_OPT.update(grads, state, local)
        local = optax.apply_updates(local, updates)
    return jax.tree.map(jnp.subtract, local, params)


@oracle_jit
def _oracle_server(params, opt_state, deltas):
    return server_update(params, opt_state, loops.mean(deltas))


def oracle(params, opt_state, x, y):
    deltas = [_oracle_client(params, x, y, i) for i in range(NUM_CLIENTS)]
    return _oracle_server(params, opt_state, deltas)


CASE = Case(
    name="diloco",
    fn=build(),
    make_args=make_args,
    oracle=oracle,
    grad_argnums=(0,),
    loss=sum_of_squares,
)
