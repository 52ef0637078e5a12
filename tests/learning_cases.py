"""fcir.learning's algorithms on one small problem, for the library's tests and the
backends' (tests/learning/, tests/interpreters/*/test_*_learning.py).

Linear regression with two parameter arrays, ``N`` clients of different data (each its
own offset: the members disagree), ``STEPS`` local steps of ``BATCH`` examples, and
``COUNTS`` real steps per client (fcir.Population's padding: client 1 and 4 took one
step of two).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fcir import learning

N, STEPS, BATCH, LR = 7, 2, 4, 0.1
COUNTS = np.array([2, 1, 2, 2, 1, 2, 2], np.float32)


def loss_fn(p, batch):
    return jnp.mean(jnp.square(batch["x"] @ p["w"] + p["b"] - batch["y"]))


def numpy_grad(p, batch):
    """The gradient of ``loss_fn`` in numpy (float64 in, float64 out): the oracles'."""
    err = batch["x"] @ p["w"] + p["b"] - batch["y"]
    scale = 2.0 / err.size
    return {"b": scale * err.sum(0), "w": scale * batch["x"].T @ err}


def loss_with_metrics(p, batch):
    err = batch["x"] @ p["w"] + p["b"] - batch["y"]
    return jnp.mean(jnp.square(err)), {"mae": jnp.mean(jnp.abs(err))}


def make_data(n: int = N, steps: int = STEPS, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, steps, BATCH, 3)).astype(np.float32)
    y = x @ rng.normal(size=(3, 2)) + rng.normal(size=(n, 1, 1, 2))
    return {"x": x, "y": y.astype(np.float32)}


def init_params(seed: int = 1) -> dict:
    rng = np.random.default_rng(seed)
    return {"b": np.zeros(2, np.float32), "w": (0.1 * rng.normal(size=(3, 2))).astype(np.float32)}


SGD = optax.sgd(LR)

# name -> the algorithm on loss_fn; the Flower-named ones with Flower's hyperparameter
# names, at values where each rule matters (momentum, a proximal term, adaptivity).
ALGORITHMS = {
    "fedavg": lambda: learning.fedavg(loss_fn, client_optimizer=SGD),
    "fedavgm": lambda: learning.fedavgm(
        loss_fn, client_optimizer=SGD, server_learning_rate=0.7, server_momentum=0.9
    ),
    "fedprox": lambda: learning.fedprox(loss_fn, client_optimizer=SGD, mu=0.5),
    "fedadam": lambda: learning.fedadam(loss_fn, client_optimizer=SGD, eta=0.05),
    "fedyogi": lambda: learning.fedyogi(loss_fn, client_optimizer=SGD, eta=0.05),
    "fedadagrad": lambda: learning.fedadagrad(loss_fn, client_optimizer=SGD, eta=0.05),
    "qfedavg": lambda: learning.qfedavg(
        loss_fn, client_optimizer=SGD, q=0.5, client_learning_rate=LR
    ),
    "fedopt": lambda: learning.fedopt(
        loss_fn, client_optimizer=SGD, server_optimizer=optax.adam(0.05)
    ),
    "scaffold": lambda: learning.scaffold(loss_fn, client_optimizer=SGD),
    "diloco": lambda: learning.diloco(loss_fn, client_optimizer=optax.adamw(0.05)),
    "fedsgd": lambda: learning.fedsgd(loss_fn),
    "median": lambda: learning.fedavg(loss_fn, client_optimizer=SGD, aggregator=learning.median()),
    "trimmed_mean": lambda: learning.fedavg(
        loss_fn, client_optimizer=SGD, aggregator=learning.trimmed_mean(0.2)
    ),
    "krum": lambda: learning.fedavg(loss_fn, client_optimizer=SGD, aggregator=learning.krum(1)),
    "multi_krum": lambda: learning.fedavg(
        loss_fn, client_optimizer=SGD, aggregator=learning.multi_krum(1, 3)
    ),
    "bulyan": lambda: learning.fedavg(loss_fn, client_optimizer=SGD, aggregator=learning.bulyan(1)),
    "geometric_median": lambda: learning.fedavg(
        loss_fn, client_optimizer=SGD, aggregator=learning.geometric_median()
    ),
    "dp": lambda: learning.fedavg(loss_fn, client_optimizer=SGD, aggregator=learning.dp(1.0, 1.0)),
    "dp_adaptive": lambda: learning.fedavg(
        loss_fn, client_optimizer=SGD, aggregator=learning.dp_adaptive(1.0, 0.3)
    ),
    "ddp": lambda: learning.fedavg(
        loss_fn, client_optimizer=SGD, aggregator=learning.ddp(1.0, 1.0, bits=16)
    ),
}


def init(algo, params=None, n: int = N) -> dict:
    params = init_params() if params is None else params
    return algo.init(params, clients=n) if algo.name == "scaffold" else algo.init(params)


def round_args(algo, state, data, counts=None, n: int = N, seed: int = 0) -> tuple:
    """The round's arguments: ``(state, data[, counts][, key])``; a DP round's key as
    raw uint32 key data (what exports carry), one per client for ``ddp``."""
    agg = algo.aggregator
    if not agg.private:
        return (state, data) if counts is None else (state, data, counts)
    key = jax.random.key(seed)
    key = jax.random.split(key, n) if agg.client_keys else key
    return (state, data, counts, jax.random.key_data(key))
