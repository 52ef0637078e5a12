"""task.py: Flower's JAX template's data, model and training (shortened), and the round
fcir runs with them."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

import fcir

key = jax.random.PRNGKey(0)


def load_data(partition_id, n=40):
    rng = np.random.RandomState(partition_id)
    X = rng.randn(n, 3)
    y = X @ rng.uniform(1, 10, 3) + 0.1 * rng.randn(n)
    return X[:30], y[:30], X[30:], y[30:]


def load_model(model_shape):
    return {"b": jax.random.uniform(key), "w": jax.random.uniform(key, model_shape)}


def loss_fn(params, X, y):
    err = jnp.dot(X, params["w"]) + params["b"] - y
    return jnp.mean(jnp.square(err))


def train(params, grad_fn, X, y, epochs=10):
    for _ in range(epochs):
        grads = grad_fn(params, X, y)
        params = jax.tree.map(lambda p, g: p - 0.05 * g, params, grads)
    return params, loss_fn(params, X, y), X.shape[0]


def evaluate_member(params, x, y):  # one client: the server's params, its test data
    return {"test_loss": loss_fn(params, x, y)}


@fcir.program(placements={"clients": 3}, client_data=("x", "y"), evaluate=evaluate_member)
def fedavg_round(params, x, y):
    def local(params, x, y):
        params, loss, n = train(params, jax.grad(loss_fn), x, y)
        return params, loss, jnp.float32(n)

    new, loss, n = fcir.map_fn(local, (fcir.broadcast(params), x, y))
    return {
        "params": fcir.reduce_weighted_mean(new, n),
        "train_loss": fcir.reduce_weighted_mean(loss, n),
    }


@functools.cache  # once per process: a Ray actor serves many messages
def capture():
    """The round and its evaluation, on one client's training and test shapes."""
    x, y, x_test, y_test = load_data(0)
    spec = lambda a: jax.ShapeDtypeStruct((3, *a.shape), jnp.float32)  # noqa: E731
    params = load_model((3,))
    return (
        fcir.capture(fedavg_round, params, spec(x), spec(y)),
        fcir.capture(fcir.evaluation(fedavg_round), params, spec(x_test), spec(y_test)),
    )
