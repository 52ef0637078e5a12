"""Per-client randomness: a DP-style clipped and noised mean of client updates.

The orchestrator turns a seed into a threefry key (``jax.random.key``) and splits it
into one key per client; the keys are client data (``{key<fry>[]}@clients``), mapped
with the rest of each client's data. Each client clips its gradient step to norm
``CLIP`` and adds Gaussian noise drawn from its own key. (Splitting inside the round at
the server and mapping over the result would hand each client a different server
value, which no federated op does: fcir rejects it with ``fed.map/C2``.)
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
EXAMPLES = 12
DIM = 8
LR = 0.5
CLIP = 0.2
NOISE = 0.05
DRJAX_EXPRESSIBLE = True


def mse(w, x, y):
    return jnp.mean(jnp.square(x @ w - y))


def noised_update(w, key, x, y):
    update = -LR * jax.grad(mse)(w, x, y)
    norm = jnp.sqrt(jnp.sum(jnp.square(update)))
    clipped = update * jnp.minimum(1.0, CLIP / norm)
    return clipped + NOISE * jax.random.normal(key, update.shape)


def build(api=fcir):
    @api.program(placements={"clients": NUM_CLIENTS})
    def client_rng(w, keys, x, y):
        updates = api.map_fn(noised_update, (api.broadcast(w), keys, x, y))
        return w + api.reduce_mean(updates)

    return client_rng


def make_args():
    rng = np.random.default_rng(12)
    w = rng.normal(size=(DIM,))
    x = rng.normal(size=(NUM_CLIENTS, EXAMPLES, DIM))
    y = x @ rng.normal(size=(DIM,)) + 0.1 * rng.normal(size=(NUM_CLIENTS, EXAMPLES))
    return (
        jnp.asarray(w, jnp.float32),
        jax.random.split(jax.random.key(20240601), NUM_CLIENTS),
        jnp.asarray(x, jnp.float32),
        jnp.asarray(y, jnp.float32),
    )


@oracle_jit
def _oracle_client(w, keys, x, y, i):
    # Closed-form gradient of the mean squared error.
    update = -LR * 2.0 * x[i].T @ (x[i] @ w - y[i]) / EXAMPLES
    clipped = update * jnp.minimum(1.0, CLIP / jnp.linalg.norm(update))
    return clipped + NOISE * jax.random.normal(keys[i], (DIM,))


@oracle_jit
def _oracle_server(w, updates):
    return w + loops.mean(updates)


def oracle(w, keys, x, y):
    updates = [_oracle_client(w, keys, x, y, i) for i in range(NUM_CLIENTS)]
    return _oracle_server(w, updates)


CASE = Case(
    name="client_rng",
    fn=build(),
    make_args=make_args,
    oracle=oracle,
    grad_argnums=(0, 2, 3),
    loss=sum_of_squares,
    # Client keys are PRNG-key-typed client data; federated_language has no key dtype.
    exportable=False,
)
