"""fcir inside a Flower user's own app: ``flower.Strategy`` in the ServerApp and
``flower.Client`` in the ClientApp, against Flower's JAX template
(tests/flowerlib/jax_template.py), run in this process on a grid that hands each
message to the ClientApp (tests/flowerlib/inprocess.py)."""

from __future__ import annotations

import logging
import types

import numpy as np
import pytest
from flowerlib import inprocess, jax_template

pytest.importorskip("flwr", reason="the Flower tests need flwr (pip install 'fcir[flower]')")

from fcir.interpreters import flower, reference, xla  # noqa: E402
from flwr.app import Context, RecordDict  # noqa: E402


def run_app(server, client, run_config=None):
    """The ServerApp's main on NODES in-process nodes; (its context, the nodes' grid)."""
    nodes = {101 + i: {"partition-id": i, "num-partitions": jax_template.NODES}
             for i in range(jax_template.NODES)}
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 0  # as flwr-serverapp
    grid = inprocess.Grid(types.SimpleNamespace(client=types.SimpleNamespace(app=client)), nodes)
    config = {**jax_template.RUN_CONFIG, **(run_config or {})}
    for c in grid.contexts.values():
        c.run_config = config
    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=config)
    server(grid, context)
    return context, grid


@pytest.fixture(scope="module")
def captured():
    return jax_template.capture(), jax_template.capture(split=2)


@pytest.fixture(scope="module")
def template_run():
    seen = {}
    server = jax_template.template_server(rounds_seen=seen)
    run_app(server, jax_template.template_client())
    return seen, server.result


def ulps(a, b) -> int:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return int(np.max(np.abs(a.view(np.int32).astype(np.int64) - b.view(np.int32).astype(np.int64))))


def test_the_template_switched_to_fcir_gives_its_parameters_within_one_ulp_each_round(
    captured, template_run, caplog
):
    module, _ = captured
    seen, result = template_run
    ours = {}
    server = jax_template.template_server(
        lambda **kw: flower.Strategy(module, **kw), rounds_seen=ours
    )
    with caplog.at_level(logging.INFO, logger="flwr"):
        context, _ = run_app(server, jax_template.fcir_client(module))
    assert sorted(ours) == sorted(seen) == [0, 1, 2, 3]
    assert ulps(seen[1][1], seen[0][1]) > 1000  # it trains
    for rnd in seen:
        assert [x.shape for x in ours[rnd]] == [x.shape for x in seen[rnd]]
        # One float32 ulp of the model's largest parameter. Element by element it is up
        # to 2 ulps (b, near -0.2, at round 1): the template trains eagerly, op by op,
        # fcir's client work is one compiled function (1-2 ulps apart per client after
        # 10 epochs), and the mean of clients' b of both signs cancels digits.
        scale = max(float(np.max(np.abs(x))) for x in seen[rnd])
        for a, b in zip(ours[rnd], seen[rnd]):
            assert np.all(np.abs(a - b) <= np.spacing(np.float32(scale))), (rnd, a, b)
            assert ulps(a, b) <= 4, (rnd, a, b)
    assert list(context.state["final_model"].keys()) == list(result.arrays.keys())
    # Flower's own lines: the rounds, its sampling, the named metrics, "Final results".
    text = caplog.text
    assert "[ROUND 3/3]" in text and "Final results:" in text
    assert "fcir round @fedavg_round" in text
    assert "configure_train: Sampled 3 nodes (out of 3)" in text
    mine, theirs = server.result.train_metrics_clientapp, result.train_metrics_clientapp
    assert sorted(mine) == sorted(theirs) == [1, 2, 3]
    for rnd in mine:
        assert list(mine[rnd]) == ["train_loss"] == list(theirs[rnd])
        assert np.isclose(mine[rnd]["train_loss"], theirs[rnd]["train_loss"], rtol=1e-6)
    # Without an fcir evaluation, the evaluate stage is Flower's: the template's own
    # @app.evaluate, averaged by num-examples.
    mine, theirs = server.result.evaluate_metrics_clientapp, result.evaluate_metrics_clientapp
    assert sorted(mine) == sorted(theirs) == [1, 2, 3]
    for rnd in mine:
        assert list(mine[rnd]) == ["test_loss"]
        assert np.isclose(mine[rnd]["test_loss"], theirs[rnd]["test_loss"], rtol=1e-6)


def test_the_program_s_evaluation_runs_in_flower_s_evaluate_stage_as_on_every_backend(
    captured, template_run
):
    module, evaluation = captured
    seen, result = template_run
    server = jax_template.template_server(
        lambda **kw: flower.Strategy(module, evaluation=evaluation, **kw)
    )
    run_app(server, jax_template.fcir_client(module, evaluation))
    got = server.result.evaluate_metrics_clientapp
    assert sorted(got) == [1, 2, 3]
    tests = [jax_template.load_data(i)[2:] for i in range(jax_template.NODES)]
    xs = np.stack([x for x, _ in tests]).astype(np.float32)
    ys = np.stack([y for _, y in tests]).astype(np.float32)
    for rnd in got:
        # The same metric, by the program's name: Flower's weighted mean of the
        # template's @app.evaluate, and the evaluation program on the reference and
        # XLA backends for the same members and global model.
        assert list(got[rnd]) == ["test_loss"]
        params = dict(zip(["b", "w"], seen[rnd]))
        want = result.evaluate_metrics_clientapp[rnd]["test_loss"]
        ref = float(reference.run(evaluation, params, xs, ys)["test_loss"])
        compiled = float(xla.compile(evaluation)(params, xs, ys)["test_loss"])
        assert np.isclose(got[rnd]["test_loss"], want, rtol=1e-5)
        assert np.isclose(ref, want, rtol=1e-5) and np.isclose(compiled, want, rtol=1e-5)


def test_a_round_with_several_exchanges_is_refused_by_name():
    import jax.numpy as jnp

    import fcir

    @fcir.program(placements={"clients": 2})
    def two(w, x):
        mean = fcir.reduce_mean(fcir.map_fn(lambda w, x: w * x, (fcir.broadcast(w), x)))
        return fcir.reduce_mean(fcir.map_fn(lambda m, x: (x - m) ** 2, (fcir.broadcast(mean), x)))

    module = fcir.capture(two, jnp.ones(3), jnp.ones((2, 3)))
    with pytest.raises(fcir.ExportError, match=r"flower.Strategy: @two .* has 2 exchanges"):
        flower.Strategy(module)


def test_a_sampled_fraction_aggregates_the_replies_that_came(captured):
    """fraction_train=0.5 of 3 nodes with FedAvg's minimum of 2: the round (captured for
    3 clients) aggregates the 2 replies, as the template's FedAvg would."""
    import jax

    module, _ = captured
    seen = {}
    server = jax_template.template_server(
        lambda **kw: flower.Strategy(module, fraction_train=0.5, **kw), rounds_seen=seen
    )
    _, grid = run_app(server, jax_template.fcir_client(module), {"num-server-rounds": 1})
    sampled = grid.sent[:2]  # round 1's train messages go first
    assert len(set(sampled)) == 2
    start = jax_template.load_model((3,))
    trained = []
    for node in sampled:
        x, y, _, _ = jax_template.load_data(node - 101)
        trained.append(jax_template.train(dict(start), jax.grad(jax_template.loss_fn), x, y)[0])
    for got, key in zip(seen[1], ["b", "w"]):
        want = np.mean([np.asarray(p[key]) for p in trained], axis=0)  # equal num-examples
        assert np.allclose(got, want, rtol=1e-5, atol=1e-6)
