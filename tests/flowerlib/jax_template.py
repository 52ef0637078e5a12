"""Flower's JAX app template (``flwr new``, framework JAX, flwr 1.42: task.py,
client_app.py, server_app.py) in one module, seeded, and the same app switched to fcir
as docs/flower_app.md shows it: the ServerApp's ``FedAvg()`` becomes
``flower.Strategy(module)``, the ClientApp's training becomes ``work.train(msg, x, y)``
with ``work = flower.Client(module, jit=False)`` (the template does not jit its training).

Each node's data differ by partition (the template's ``make_regression`` with the
partition as its seed, written with numpy here), so the clients' models differ and the
weighted mean matters.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

import fcir

NODES = 3
RUN_CONFIG = {"num-server-rounds": 3, "input-dim": 3, "fraction-evaluate": 1.0}
EPOCHS = 10  # the template's 50, fewer for the tests' time; the same in both apps

key = jax.random.PRNGKey(0)


# --- task.py ------------------------------------------------------------------------


def load_data(partition_id: int, n: int = 40):
    rng = np.random.RandomState(partition_id)
    X = rng.randn(n, 3)
    y = X @ rng.uniform(1, 10, 3) + 0.1 * rng.randn(n)
    split = 3 * n // 4
    return X[:split], y[:split], X[split:], y[split:]


def load_model(model_shape):
    return {"b": jax.random.uniform(key), "w": jax.random.uniform(key, model_shape)}


def loss_fn(params, X, y):
    err = jnp.dot(X, params["w"]) + params["b"] - y
    return jnp.mean(jnp.square(err))


def train(params, grad_fn, X, y):
    loss = 1_000_000
    num_examples = X.shape[0]
    for _ in range(EPOCHS):
        grads = grad_fn(params, X, y)
        params = jax.tree.map(lambda p, g: p - 0.05 * g, params, grads)
        loss = loss_fn(params, X, y)
    return params, loss, num_examples


def evaluation(params, grad_fn, X_test, y_test):
    num_examples = X_test.shape[0]
    loss_test = loss_fn(params, X_test, y_test)
    return loss_test, num_examples


def get_params(params):
    return [np.array(v) for v in params.values()]


def set_params(local_params, global_params):
    for k, value in list(zip(local_params.keys(), global_params)):
        local_params[k] = value


# --- the template's ClientApp and ServerApp ------------------------------------------


def template_client() -> ClientApp:
    app = ClientApp()

    @app.train()
    def train_(msg: Message, context: Context):
        params = load_model((context.run_config["input-dim"],))
        set_params(params, msg.content["arrays"].to_numpy_ndarrays())
        X, y, _, _ = load_data(context.node_config["partition-id"])
        params, loss, n = train(params, jax.grad(loss_fn), X, y)
        content = RecordDict({
            "arrays": ArrayRecord(get_params(params)),
            "metrics": MetricRecord({"train_loss": float(loss), "num-examples": n}),
        })
        return Message(content=content, reply_to=msg)

    app.evaluate()(template_evaluate)
    return app


def template_evaluate(msg: Message, context: Context):
    params = load_model((context.run_config["input-dim"],))
    set_params(params, msg.content["arrays"].to_numpy_ndarrays())
    _, _, X_test, y_test = load_data(context.node_config["partition-id"])
    loss, n = evaluation(params, jax.grad(loss_fn), X_test, y_test)
    content = RecordDict({"metrics": MetricRecord({"test_loss": float(loss), "num-examples": n})})
    return Message(content=content, reply_to=msg)


def template_server(strategy_fn=FedAvg, rounds_seen=None) -> ServerApp:
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        num_rounds = context.run_config["num-server-rounds"]
        arrays = ArrayRecord(get_params(load_model((context.run_config["input-dim"],))))
        strategy = strategy_fn(fraction_evaluate=context.run_config["fraction-evaluate"])

        def global_evaluate(server_round: int, arrays: ArrayRecord):
            if rounds_seen is not None:  # the tests' record of each round's global model
                rounds_seen[server_round] = arrays.to_numpy_ndarrays()
            return MetricRecord({"round": server_round})

        result = strategy.start(
            grid=grid, initial_arrays=arrays, num_rounds=num_rounds, evaluate_fn=global_evaluate
        )
        context.state["final_model"] = result.arrays  # the template: np.savez("final_model.npz")
        app.result = result

    return app


# --- the same app switched to fcir (docs/flower_app.md) --------------------------------


def evaluate_member(params, x, y):
    return {"test_loss": evaluation(params, None, x, y)[0]}


@fcir.program(placements={"clients": NODES}, client_data=("x", "y"), evaluate=evaluate_member)
def fedavg_round(params, x, y):
    def local(params, x, y):
        params, loss, n = train(params, jax.grad(loss_fn), x, y)
        return params, loss, jnp.float32(n)

    new, loss, n = fcir.map_fn(local, (fcir.broadcast(params), x, y))
    return {"params": fcir.reduce_weighted_mean(new, n), "train_loss": fcir.reduce_weighted_mean(loss, n)}


def capture(split: int = 0):
    """The round and its evaluation, captured on the shapes of one partition's
    training (``split=0``) or test (``split=2``) data."""
    x, y = load_data(0)[split:split + 2]
    params = load_model((RUN_CONFIG["input-dim"],))
    xs = jax.ShapeDtypeStruct((NODES, *x.shape), jnp.float32)
    ys = jax.ShapeDtypeStruct((NODES, *y.shape), jnp.float32)
    if split:
        return fcir.capture(fcir.evaluation(fedavg_round), params, xs, ys)
    return fcir.capture(fedavg_round, params, xs, ys)


def fcir_client(module, evaluation=None, jit=False) -> ClientApp:
    """The template's ClientApp with fcir's client work; ``jit=False`` as the
    template trains (op by op, no ``jax.jit``)."""
    from fcir.interpreters import flower

    app = ClientApp()
    work = flower.Client(module, evaluation=evaluation, jit=jit)

    @app.train()
    def train_(msg: Message, context: Context):
        X, y, _, _ = load_data(context.node_config["partition-id"])
        return work.train(msg, X, y)

    if evaluation is None:  # the template's own evaluate stays
        app.evaluate()(template_evaluate)
        return app

    @app.evaluate()
    def evaluate_(msg: Message, context: Context):
        _, _, X_test, y_test = load_data(context.node_config["partition-id"])
        return work.evaluate(msg, X_test, y_test)

    return app
