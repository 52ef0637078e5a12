"""Mixed precision: clients train in bfloat16, the server averages in float32.

Each client casts the broadcast float32 model and its data to bfloat16, runs a few
SGD steps in bfloat16, and casts its update back to float32 before ``reduce_mean``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import fcir

from . import loops, mlp
from .case import Case, sum_of_squares

NUM_CLIENTS = 4
STEPS = 2
BATCH = 8
D_IN, HIDDEN, D_OUT = 8, 16, 1
LR = 0.0625  # a power of two: exact in bfloat16
DRJAX_EXPRESSIBLE = True

bf16 = jnp.bfloat16


def local_update(params, x, y):
    p16 = jax.tree.map(lambda p: p.astype(bf16), params)
    trained, _ = mlp.sgd_steps(mlp.mse, p16, (x.astype(bf16), y.astype(bf16)), LR)
    return jax.tree.map(lambda new, old: (new - old).astype(jnp.float32), trained, p16)


def build(api=fcir):
    @api.program(placements={"clients": NUM_CLIENTS})
    def bf16_client(params, x, y):
        deltas = api.map_fn(local_update, (api.broadcast(params), x, y))
        return jax.tree.map(lambda p, d: p + d, params, api.reduce_mean(deltas))

    return bf16_client


def make_args():
    rng = np.random.default_rng(13)
    params = mlp.init_params(rng, D_IN, HIDDEN, D_OUT)
    x, y = mlp.regression_data(rng, (NUM_CLIENTS, STEPS, BATCH), D_IN, D_OUT)
    return params, x, y


# The member computation is compiled as one unit, as it is inside the program: XLA
# keeps bf16 intermediates of a fused computation in float32 (excess precision), so
# op-by-op execution would round differently.
@jax.jit
def _oracle_client(params, x, y, i):
    return local_update(params, x[i], y[i])


@jax.jit
def _oracle_server(params, deltas):
    return jax.tree.map(jnp.add, params, loops.mean(deltas))


def oracle(params, x, y):
    deltas = [_oracle_client(params, x, y, i) for i in range(NUM_CLIENTS)]
    return _oracle_server(params, deltas)


CASE = Case(
    name="bf16_client",
    fn=build(),
    make_args=make_args,
    oracle=oracle,
    grad_argnums=(0,),
    loss=sum_of_squares,
)
