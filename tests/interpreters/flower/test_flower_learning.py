"""fcir.learning's rounds on Flower: inside a user's own app (``flower.Strategy`` in the
ServerApp, ``flower.Client`` in the ClientApp, with the algorithm's evaluation in
Flower's evaluate stage), as an exported app (in process), and one exported app on
Flower's Simulation Engine (``fcir flower simulate``); each gives ``reference.run``'s
rounds. SCAFFOLD's clients' controls stay on the nodes in the app exported from
examples/scaffold.py (test_flower_program.py)."""

from __future__ import annotations

import logging
import random
import subprocess
import types

import jax
import numpy as np
import pytest
from corpus.compare import assert_trees_match
from fcir.interpreters import flower, reference
from flowerlib import files, inprocess, simulation
from learning_cases import ALGORITHMS, COUNTS, init, make_data, round_args

import fcir

pytest.importorskip("flwr", reason="the Flower tests need flwr (pip install 'fcir[flower]')")

from flwr.app import Array, ArrayRecord  # noqa: E402

NODES = 3
ROUNDS = 3


def _case(name: str, n: int = NODES):
    algo = ALGORITHMS[name]()
    data = jax.tree.map(lambda x: x[:n], make_data())
    args = round_args(algo, init(algo, n=n), data, COUNTS[:n], n=n)
    return algo, args, fcir.capture(algo.round(clients=n), *args)


def _row(data, i: int) -> list:
    """Client ``i``'s data leaves, in the order the round takes them."""
    return [np.asarray(x)[i] for x in jax.tree.leaves(data)]


def _reference_rounds(module, args, rounds=ROUNDS):
    state = args[0]
    for _ in range(rounds):
        state, metrics = reference.run(module, state, *args[1:])
    return state, metrics


def test_a_user_app_with_flower_strategy_runs_fedadam_and_its_evaluation(caplog):
    """flower.Strategy(round, evaluation=...) over 3 in-process nodes whose ClientApp
    calls flower.Client(...).train / .evaluate on its own data and count: after 3
    rounds the global arrays (the whole state: model, Adam's moments, the round) are
    reference.run's, and Flower logs the round's loss and the evaluation's."""
    algo, args, module = _case("fedadam")
    state, data, counts = args
    evaluation = fcir.capture(algo.evaluate(clients=NODES), state, data, counts)
    work = flower.Client(module, evaluation=evaluation)

    def client_app(msg, context):
        i = context.node_config["partition-id"]
        mine = (jax.tree.map(lambda x: x[i], data), counts[i])
        if msg.metadata.message_type.startswith("train"):
            return work.train(msg, *mine)
        return work.evaluate(msg, *mine)

    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 0
    random.seed(0)
    nodes = {101 + i: {"partition-id": i} for i in range(NODES)}
    grid = inprocess.Grid(
        types.SimpleNamespace(client=types.SimpleNamespace(app=client_app)), nodes
    )
    strategy = flower.Strategy(module, evaluation=evaluation, min_train_nodes=NODES,
                               min_evaluate_nodes=NODES, min_available_nodes=NODES)  # fmt: skip
    initial = ArrayRecord(
        {str(i): Array(np.asarray(x)) for i, x in enumerate(jax.tree.leaves(state))}
    )
    with caplog.at_level(logging.INFO, logger="flwr"):
        result = strategy.start(grid=grid, initial_arrays=initial, num_rounds=ROUNDS)
    want, metrics = _reference_rounds(module, args)
    got = [a.numpy() for a in result.arrays.values()]
    assert_trees_match(got, [np.asarray(x) for x in jax.tree.leaves(want)], rtol=1e-5, atol=1e-6)
    paths = [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_flatten_with_path(want)[0]]
    assert int(got[paths.index("['round']")]) == ROUNDS
    assert np.isclose(result.train_metrics_clientapp[ROUNDS]["loss"], metrics["loss"], rtol=1e-5)
    ev = reference.run(evaluation, want, data, counts)
    assert np.isclose(result.evaluate_metrics_clientapp[ROUNDS]["loss"], ev["loss"], rtol=1e-5)
    assert "fcir round @fedadam_round" in caplog.text


def test_an_exported_qfedavg_app_runs_its_rounds_in_process(tmp_path, capsys):
    """flower.export of the q-FedAvg round (its own sums, not a mean) with counts as
    node data: 3 rounds in process write reference.run's state and metrics."""
    algo, args, module = _case("qfedavg")
    state, data, counts = args
    app = flower.export(module, tmp_path / "app",
                        inputs=[np.asarray(x) for x in jax.tree.leaves(state)])  # fmt: skip
    rows = [[*_row(data, i), counts[i]] for i in range(NODES)]
    nodes = files.write_nodes(tmp_path, rows, 40)
    out = tmp_path / "out.npz"
    inprocess.run(app, nodes, {"output": str(out), "num-server-rounds": ROUNDS})
    assert f"round {ROUNDS}/{ROUNDS}: 3/3 clients replied" in capsys.readouterr().out
    want = jax.tree.leaves(_reference_rounds(module, args))
    assert_trees_match(files.read_outputs(out), [np.asarray(x) for x in want], rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # a Simulation Engine run: Ray and a SuperLink, ~45 CPU s
def test_an_exported_fedavg_round_with_a_median_on_the_simulation_engine(tmp_path):
    """fcir flower simulate of FedAvg with the median aggregator (counts as node data,
    3 virtual nodes, 2 rounds): the output file is reference.run's 2 rounds."""
    pytest.importorskip(
        "ray", reason="the Simulation Engine needs ray (pip install 'fcir[flower]')"
    )
    _, args, module = _case("median")
    state, data, counts = args
    app = flower.export(module, tmp_path / "app",
                        inputs=[np.asarray(x) for x in jax.tree.leaves(state)])  # fmt: skip
    root = tmp_path / "data"
    root.mkdir()
    for i in range(NODES):
        np.savez(root / f"node{i}.npz", *_row(data, i), counts[i])
    out = tmp_path / "out.npz"
    cmd = simulation.command(app, root, f'output="{out}" num-server-rounds=2', tmp_path / "sim")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    want = jax.tree.leaves(_reference_rounds(module, args, rounds=2))
    assert_trees_match(files.read_outputs(out), [np.asarray(x) for x in want], rtol=1e-5, atol=1e-6)
