"""FedSGD on linear regression.

Each client differentiates its mean squared error (``jax.grad`` inside the map body)
at the broadcast model; the server applies the averaged gradient. Returns the new
model and the mean client loss.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import fcir

from . import loops
from .case import Case, sum_of_squares
from .oracle_jit import oracle_jit

NUM_CLIENTS = 8
EXAMPLES = 16
DIM = 4
LR = 0.1
DRJAX_EXPRESSIBLE = True


def mse(params, x, y):
    return jnp.mean(jnp.square(x @ params["w"] + params["b"] - y))


def client_gradient(params, x, y):
    return jax.value_and_grad(mse)(params, x, y)


def build(api=fcir):
    @api.program(placements={"clients": NUM_CLIENTS})
    def fedsgd_linreg(params, x, y):
        losses, grads = api.map_fn(client_gradient, (api.broadcast(params), x, y))
        mean_grad = api.reduce_mean(grads)
        new_params = jax.tree.map(lambda p, g: p - LR * g, params, mean_grad)
        return new_params, api.reduce_mean(losses)

    return fedsgd_linreg


def make_args():
    rng = np.random.default_rng(2)
    params = {
        "w": jnp.asarray(rng.normal(size=(DIM, 1)), jnp.float32),
        "b": jnp.zeros((1,), jnp.float32),
    }
    true_w = rng.normal(size=(DIM, 1))
    x = rng.normal(size=(NUM_CLIENTS, EXAMPLES, DIM))
    y = x @ true_w + 0.5 + 0.1 * rng.normal(size=(NUM_CLIENTS, EXAMPLES, 1))
    return params, jnp.asarray(x, jnp.float32), jnp.asarray(y, jnp.float32)


@oracle_jit
def _oracle_client(params, x, y, i):
    # Closed-form MSE gradient, independent of jax.grad.
    residual = x[i] @ params["w"] + params["b"] - y[i]
    grad = {
        "w": 2.0 * x[i].T @ residual / residual.size,
        "b": 2.0 * jnp.sum(residual, axis=0) / residual.size,
    }
    return jnp.mean(jnp.square(residual)), grad


@oracle_jit
def _oracle_server(params, losses, grads):
    mean_grad = loops.mean(grads)
    return {k: params[k] - LR * mean_grad[k] for k in params}, loops.mean(losses)


def oracle(params, x, y):
    losses, grads = zip(*[_oracle_client(params, x, y, i) for i in range(NUM_CLIENTS)])
    return _oracle_server(params, list(losses), list(grads))


CASE = Case(
    name="fedsgd_linreg",
    fn=build(),
    make_args=make_args,
    oracle=oracle,
    grad_argnums=(0, 1, 2),
    loss=sum_of_squares,
)
