"""The Flower-named algorithms compute what Flower 1.42's strategy of that name
computes: Flower's own strategy class runs in this process (its ``start``: sampling,
the records, its aggregation) on a grid whose nodes reply with the same client work as
the fcir round's members (the algorithm's own local SGD, jitted), and after 3 rounds
its global arrays equal ``reference.run``'s of the fcir round to float32 ulps (the XLA
backend's are the reference's: tests/interpreters/xla/test_xla_learning.py).

The clients differ in their numbers of examples (``num-examples`` = count * batch, the
round's ``counts``), so the weighting is checked too; the robust strategies weigh
alike, as fcir's robust reductions do."""

from __future__ import annotations

import logging
import random
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fcir.interpreters import reference
from learning_cases import ALGORITHMS, BATCH, COUNTS, LR, STEPS, N, init, make_data

import fcir
from fcir.learning.algorithm import DataSpec

pytest.importorskip("flwr", reason="the Flower comparison needs flwr (pip install -e '.[flower]')")

from flowerlib import inprocess  # noqa: E402
from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict  # noqa: E402
from flwr.serverapp import strategy as flwr_strategy  # noqa: E402

ROUNDS = 3
ALIKE = dict(fraction_evaluate=0.0, min_train_nodes=N, min_available_nodes=N)

# fcir algorithm -> (Flower's strategy with the same hyperparameters, weighted by counts)
STRATEGIES = {
    "fedavg": (lambda: flwr_strategy.FedAvg(**ALIKE), True),
    "fedavgm": (
        lambda: flwr_strategy.FedAvgM(server_learning_rate=0.7, server_momentum=0.9, **ALIKE),
        True,
    ),  # fmt: skip
    "fedprox": (lambda: flwr_strategy.FedProx(proximal_mu=0.5, **ALIKE), True),
    "fedadam": (lambda: flwr_strategy.FedAdam(eta=0.05, **ALIKE), True),
    "fedyogi": (lambda: flwr_strategy.FedYogi(eta=0.05, **ALIKE), True),
    "fedadagrad": (lambda: flwr_strategy.FedAdagrad(eta=0.05, **ALIKE), True),
    "qfedavg": (lambda: flwr_strategy.QFedAvg(client_learning_rate=LR, q=0.5, **ALIKE), True),
    "median": (lambda: flwr_strategy.FedMedian(**ALIKE), False),
    "trimmed_mean": (lambda: flwr_strategy.FedTrimmedAvg(beta=0.2, **ALIKE), False),
    "krum": (lambda: flwr_strategy.Krum(num_malicious_nodes=1, **ALIKE), False),
    "multi_krum": (
        lambda: flwr_strategy.MultiKrum(num_malicious_nodes=1, num_nodes_to_select=3, **ALIKE),
        False,
    ),  # fmt: skip
}
# Measured (jax 0.10.2, CPU): at most 17 ulps (FedAdam, whose Flower state turns
# float64 in round 1: its eta_norm is a NumPy float64), 10 for the others (FedAvg's b,
# whose sum of products differs from fcir's sum(w x) / sum(w) in the last bits), 0
# for the median, Krum and the trimmed mean; a formula off anywhere (FedAdam's
# eta_norm at server_round instead of server_round + 1) is millions of ulps away.
MAX_ULPS = 32


def ulps(a, b) -> int:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return int(
        np.max(np.abs(a.view(np.int32).astype(np.int64) - b.view(np.int32).astype(np.int64)))
    )


def flower_client(algo, data, counts):
    """A ClientApp function: the member's own work on the arrays Flower sent, replied
    as Flower's strategies expect (the model, num-examples, train_loss)."""
    spec = DataSpec(STEPS, BATCH)

    @jax.jit
    def work(params, data, count):
        if algo.name == "qfedavg":  # it replies its model and its loss at the model sent
            trained, _, _ = algo.train(params, data, count)
            return trained, algo.measure(params, data, count)["loss"]
        out = algo.client(params, None, data, count, spec)
        return out["value"], out["metrics"]["loss"]

    def app(msg: Message, context) -> Message:
        i = context.node_config["partition-id"]
        params = {k: np.asarray(v.numpy(), np.float32) for k, v in msg.content["arrays"].items()}
        count = None if counts is None else jnp.float32(counts[i])
        trained, loss = work(params, jax.tree.map(lambda x: x[i], data), count)
        examples = STEPS * BATCH if counts is None else int(counts[i]) * BATCH
        reply = RecordDict({
            "arrays": ArrayRecord({k: Array(np.asarray(v)) for k, v in trained.items()}),
            "metrics": MetricRecord({"num-examples": examples, "train_loss": float(loss)}),
        })  # fmt: skip
        return Message(reply, reply_to=msg)

    return app


def flower_rounds(strategy, app, params) -> dict:
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 0  # as flwr-serverapp
    random.seed(0)  # Flower samples the nodes, and orders their replies, at random
    nodes = {101 + i: {"partition-id": i} for i in range(N)}
    grid = inprocess.Grid(types.SimpleNamespace(client=types.SimpleNamespace(app=app)), nodes)
    arrays = ArrayRecord({k: Array(v) for k, v in params.items()})
    with inprocess.own_garbage_only():
        result = strategy.start(grid=grid, initial_arrays=arrays, num_rounds=ROUNDS)
    return {k: v.numpy() for k, v in result.arrays.items()}


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_three_rounds_equal_flower_s_strategy_of_that_name(name, caplog):
    make_strategy, weighted = STRATEGIES[name]
    algo = ALGORITHMS[name]()
    data = make_data()
    counts = COUNTS if weighted else None
    state = init(algo)
    params = jax.tree.map(np.asarray, algo.params(state))
    with caplog.at_level(logging.WARNING, logger="flwr"):
        want = flower_rounds(make_strategy(), flower_client(algo, data, counts), params)
    extra = () if counts is None else (counts,)
    module = fcir.capture(algo.round(clients=N), state, data, *extra)
    for _ in range(ROUNDS):
        state, _ = reference.run(module, state, data, *extra)
    got = algo.params(state)
    assert sorted(got) == sorted(want)
    for k in want:
        assert np.max(np.abs(want[k] - params[k])) > 0.02, "the rounds train"
        assert ulps(got[k], want[k]) <= MAX_ULPS, (name, k, got[k], want[k])
