"""A two-layer ReLU MLP regressor and local SGD, shared by the FedAvg-family programs.

Parameters are a dict ``{"w1", "b1", "w2", "b2"}`` so pytree names reach the IR.
``jax.nn.relu`` is a ``custom_jvp`` function, so every program using it carries a
``custom_jvp_call`` region.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np


def init_params(rng: np.random.Generator, d_in: int, hidden: int, d_out: int) -> dict:
    return {
        "w1": jnp.asarray(rng.normal(0, 1 / np.sqrt(d_in), (d_in, hidden)), jnp.float32),
        "b1": jnp.asarray(rng.normal(0, 0.1, (hidden,)), jnp.float32),
        "w2": jnp.asarray(rng.normal(0, 1 / np.sqrt(hidden), (hidden, d_out)), jnp.float32),
        "b2": jnp.zeros((d_out,), jnp.float32),
    }


def apply(params: dict, x: jax.Array) -> jax.Array:
    h = jax.nn.relu(x @ params["w1"] + params["b1"])
    return h @ params["w2"] + params["b2"]


def mse(params: dict, x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean(jnp.square(apply(params, x) - y))


def sgd_steps(loss: Callable, params, batches, lr: float):
    """Runs one SGD step per leading-axis slice of ``batches`` (a tuple of loss args).

    Returns the final parameters and the mean of the per-step losses.
    """

    def step(p, batch):
        value, grads = jax.value_and_grad(loss)(p, *batch)
        return jax.tree.map(lambda w, g: w - lr * g, p, grads), value

    params, losses = jax.lax.scan(step, params, batches)
    return params, jnp.mean(losses)


def regression_data(
    rng: np.random.Generator, shape: tuple[int, ...], d_in: int, d_out: int
) -> tuple[jax.Array, jax.Array]:
    """Features of shape ``shape + (d_in,)`` and noisy targets of a random linear teacher."""
    teacher = rng.normal(size=(d_in, d_out))
    x = rng.normal(size=(*shape, d_in))
    y = np.tanh(x @ teacher) + 0.1 * rng.normal(size=(*shape, d_out))
    return jnp.asarray(x, jnp.float32), jnp.asarray(y, jnp.float32)


def sgd_step(loss: Callable, params, batch: tuple, lr: float):
    """One SGD step ``(params, loss value)``, for the oracles' explicit loops."""
    value, grads = jax.value_and_grad(loss)(params, *batch)
    return jax.tree.map(lambda w, g: w - lr * g, params, grads), value
