"""A two-layer MLP classifier and label-skewed synthetic client data for the examples."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

FEATURES, HIDDEN, CLASSES = 8, 32, 4
_CENTERS = np.random.default_rng(1234).normal(0.0, 1.0, (CLASSES, FEATURES))


def init_params(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "w1": jnp.asarray(rng.normal(0, FEATURES**-0.5, (FEATURES, HIDDEN)), jnp.float32),
        "b1": jnp.zeros(HIDDEN),
        "w2": jnp.asarray(rng.normal(0, HIDDEN**-0.5, (HIDDEN, CLASSES)), jnp.float32),
        "b2": jnp.zeros(CLASSES),
    }


def loss(params, x, y):
    """Softmax cross-entropy of ``x[batch, FEATURES]`` against int32 labels ``y[batch]``."""
    h = jax.nn.relu(x @ params["w1"] + params["b1"])
    logp = jax.nn.log_softmax(h @ params["w2"] + params["b2"])
    return -jnp.take_along_axis(logp, y[:, None], axis=-1).mean()


def sgd(params, x, y, lr: float):
    """SGD steps over ``x[steps, batch, FEATURES]``; returns (params, mean loss)."""

    def step(p, batch):
        value, grads = jax.value_and_grad(loss)(p, *batch)
        return jax.tree.map(lambda w, g: w - lr * g, p, grads), value

    params, losses = jax.lax.scan(step, params, (x, y))
    return params, losses.mean()


def client_data(rng: np.random.Generator, clients: tuple[int, ...], *shape: int):
    """(x f32[*clients, *shape, FEATURES], y i32[*clients, *shape]). Label skew: most of
    a client's examples come from two of the classes, which two depends on the client."""
    n = int(np.prod(clients))
    favourite = (np.arange(n) % CLASSES).reshape(n, *(1,) * len(shape))
    y = np.where(rng.random((n, *shape)) < 0.8,
                 (favourite + rng.integers(0, 2, (n, *shape))) % CLASSES,
                 rng.integers(0, CLASSES, (n, *shape)))  # fmt: skip
    x = _CENTERS[y] + rng.normal(0.0, 0.8, (*y.shape, FEATURES))
    return (x.reshape(*clients, *shape, FEATURES).astype(np.float32),
            y.reshape(*clients, *shape).astype(np.int32))  # fmt: skip
