"""fcir inside a Flower user's own app: ``flower.Strategy`` in the ServerApp and
``flower.Client`` in the ClientApp, against Flower's JAX template
(tests/flowerlib/jax_template.py), run in this process on a grid that hands each
message to the ClientApp (tests/flowerlib/inprocess.py)."""

from __future__ import annotations

import logging
import random
import types

import numpy as np
import pytest
from flowerlib import inprocess, jax_template

pytest.importorskip("flwr", reason="the Flower tests need flwr (pip install 'fcir[flower]')")

from fcir.interpreters import flower, reference, xla  # noqa: E402
from flwr.app import Context, RecordDict  # noqa: E402


def run_app(server, client, run_config=None, seed=0):
    """The ServerApp's main on NODES in-process nodes; (its context, the nodes' grid).
    ``seed``: Python's ``random``, which FedAvg's sampling draws from, so two runs
    sample (and FedAvg adds its replies) in the same order."""
    random.seed(seed)
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


def test_the_template_switched_to_fcir_gives_its_parameters_bit_for_bit_each_round(
    captured, template_run, caplog
):
    """The global model after every round is the template's, bit for bit (one ulp
    per round would be enough). Two things make it so, and the test fails without either:
    the ClientApp runs the client work op by op (``flower.Client(module, jit=False)``),
    as the template trains (it does not jit its train step; one compiled function puts
    its client parameters 1-2 ulps away after 10 epochs: XLA compiles the step as a
    whole); and flower.Strategy computes the weighted mean as FedAvg does, in the
    order FedAvg adds the replies (fcir's ``sum(w * x) / sum(w)`` is 1-2 ulps from
    FedAvg's ``sum(x * (w / total))``). Both runs seed ``random`` alike: FedAvg samples
    the nodes, and so orders their replies, at random. Before, the per-element
    distance was up to 2, 1, 1 ulps after rounds 1, 2, 3 (b, near -0.2, is a mean of
    clients' b of both signs)."""
    module, _ = captured
    seen, result = template_run
    ours = {}
    server = jax_template.template_server(
        lambda **kw: flower.Strategy(module, **kw), rounds_seen=ours
    )
    with caplog.at_level(logging.INFO, logger="flwr"):
        context, _ = run_app(server, jax_template.fcir_client(module, jit=False))
    assert sorted(ours) == sorted(seen) == [0, 1, 2, 3]
    assert ulps(seen[1][1], seen[0][1]) > 1000  # it trains
    for rnd in seen:
        assert [x.shape for x in ours[rnd]] == [x.shape for x in seen[rnd]]
        for a, b in zip(ours[rnd], seen[rnd]):
            assert a.dtype == b.dtype == np.float32
            assert ulps(a, b) == 0, (rnd, a, b)
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


def test_the_client_work_runs_compiled_or_op_by_op_as_jax_would(captured):
    """flower.Client's client work: ``jit=False`` op by op, the bits of the round's
    local training run eagerly (the template's); by default one compiled function, 1-2
    ulps from them here (the bits of ``jax.jit``, which the export's own tests check)."""
    import jax
    from fcir.interpreters.flower.app import runtime
    from flwr.app import ConfigRecord, Message
    from flwr.supercore.task_identity import TaskIdentity

    module, _ = captured
    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 0  # as flwr-serverapp
    start = jax_template.load_model((3,))
    works = {jit: flower.Client(module, jit=jit) for jit in (True, False)}
    sent = works[True].parts.send(list(start.values()))
    msg = Message(RecordDict({"arrays": runtime.to_record(sent), "config": ConfigRecord()}),
                  dst_node_id=101, message_type="train")
    x, y, _, _ = jax_template.load_data(2)

    def local(params, x, y):
        return jax_template.train(params, jax.grad(jax_template.loss_fn), x, y)[0]

    want = local(dict(start), x, y)
    got = {}
    for jit, work in works.items():
        reply = work.train(msg, x, y)
        assert reply.content["metrics"]["num-examples"] == len(x)
        arrays = list(runtime.from_record(reply.content["arrays"]).values())
        got[jit] = [a for a in arrays if a.shape == ()][0], [a for a in arrays if a.shape == (3,)][0]
    assert ulps(got[False][0], want["b"]) == 0 and ulps(got[False][1], want["w"]) == 0
    assert ulps(got[True][0], want["b"]) > 0  # the two ways differ: the test can tell


def test_weighted_means_are_fedavg_s_bits_in_the_replies_order(captured):
    """as_flower.fedavg_means against Flower's own FedAvg aggregation
    (``aggregate_arrayrecords``) in every order of three replies with unequal weights;
    fcir's ``sum(w * x) / sum(w)`` differs from it in some element and order; a zero
    total weight (FedAvg divides by it) is left to fcir's aggregation."""
    import itertools

    from fcir.interpreters.flower import as_flower
    from flwr.app import ArrayRecord, MetricRecord
    from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords

    module, _ = captured
    parts = flower.Strategy(module).parts
    aggs = parts.exchange["aggregations"]
    rng = np.random.RandomState(0)
    weights = [30, 7, 12]
    replies = []
    for w in weights:
        reply = {}
        for a in aggs:
            x_name, w_name = a["inputs"]
            reply[f"client_output/{x_name}"] = rng.randn(64).astype(np.float32) * 10.0 ** rng.randint(-3, 3)
            reply[f"client_output/{w_name}"] = np.float32(w)
        replies.append(reply)
    from fcir.interpreters.flower.app import runtime

    differs = False
    for order in itertools.permutations(range(3)):
        came = [replies[i] for i in order]
        means = as_flower.fedavg_means(aggs, came)
        assert sorted(means) == sorted(a["output"] for a in aggs)
        for a in aggs:
            records = [
                RecordDict({
                    "arrays": ArrayRecord([r[f"client_output/{a['inputs'][0]}"]]),
                    "metrics": MetricRecord({"num-examples": weights[i]}),
                })
                for i, r in zip(order, came)
            ]
            want = aggregate_arrayrecords(records, "num-examples").to_numpy_ndarrays()[0]
            assert means[a["output"]].dtype == want.dtype == np.float32
            assert ulps(means[a["output"]], want) == 0, (order, a["output"])
        fcir_means = runtime.aggregate(aggs, [{k.partition("/")[2]: v for k, v in r.items()} for r in came])
        differs |= any(ulps(fcir_means[a["output"]], means[a["output"]]) > 0 for a in aggs)
    assert differs
    zero = [{k: (np.float32(0) if k.endswith("_weight") else v) for k, v in r.items()} for r in replies]
    assert as_flower.fedavg_means(aggs, zero) == {}


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


# --- robust rounds with missing replies -------------------------------------------------

ROBUST_NODES = 9  # Bulyan with f = 1 needs 4f + 3 = 7 replies


def _robust_round():
    import jax

    import fcir

    @fcir.program(placements={"clients": ROBUST_NODES}, client_data=("x", "y"))
    def robust_round(params, x, y):
        def local(params, x, y):
            return jax_template.train(params, jax.grad(jax_template.loss_fn), x, y)[0]

        new = fcir.map_fn(local, (fcir.broadcast(params), x, y))
        # m = 9: with fewer replies than m, Flower's MultiKrum averages them all
        return {"params": fcir.reduce_bulyan(new, 1), "multi": fcir.reduce_multi_krum(new, 1, 9)}

    x, y = jax_template.load_data(0)[:2]
    params = jax_template.load_model((3,))
    spec = lambda a: jax.ShapeDtypeStruct((ROBUST_NODES, *a.shape), np.float32)  # noqa: E731
    return fcir.capture(robust_round, params, spec(x), spec(y))


def _run_robust(module, client, silent):
    """One round of ``module`` on ROBUST_NODES in-process nodes, ``silent`` never
    replying: (the strategy, the trained model of each node that replied)."""
    import jax
    from flwr.supercore.task_identity import TaskIdentity

    nodes = {101 + i: {"partition-id": i} for i in range(ROBUST_NODES)}
    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 0
    grid = inprocess.Grid(types.SimpleNamespace(client=types.SimpleNamespace(app=client)), nodes,
                          silent=silent)  # fmt: skip
    config = {**jax_template.RUN_CONFIG, "num-server-rounds": 1}
    for c in grid.contexts.values():
        c.run_config = config
    made = {}
    server = jax_template.template_server(
        lambda **kw: made.setdefault("s", flower.Strategy(module, fraction_evaluate=0.0))
    )
    server(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=config))
    start = jax_template.load_model((3,))
    trained = [
        jax_template.train(dict(start), jax.grad(jax_template.loss_fn), *jax_template.load_data(i)[:2])[0]
        for i in range(ROBUST_NODES) if 101 + i not in silent
    ]  # fmt: skip
    return made["s"], trained


def test_bulyan_and_multi_krum_rounds_aggregate_the_replies_that_came(caplog):
    """8 of 9 nodes reply: Bulyan (f = 1) over the 8 is Flower's aggregate_bulyan over
    them, and Multi-Krum with m = 9 averages all 8, as Flower's MultiKrum does with fewer
    replies than m. 6 reply, below Bulyan's 4f + 3: the round is skipped with Flower's
    Bulyan's warning and the global model stays. (Was: JAX's TypeError from the server
    part compiled for 7 chosen members and called with 6.)"""
    flwr_aggregate = pytest.importorskip("flwr.server.strategy.aggregate")
    module = _robust_round()
    client = jax_template.fcir_client(module, jit=True)

    strategy, trained = _run_robust(module, client, silent={109})
    got = strategy.outputs[1]
    results = [([np.asarray(p["b"]), np.asarray(p["w"])], 30) for p in trained]
    want = flwr_aggregate.aggregate_bulyan(results, 1, flwr_aggregate.aggregate_krum, to_keep=0)
    np.testing.assert_allclose(got["params.b"], want[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got["params.w"], want[1], rtol=1e-5, atol=1e-6)
    mean = {k: np.mean([np.asarray(p[k]) for p in trained], axis=0) for k in ("b", "w")}
    np.testing.assert_allclose(got["multi.b"], mean["b"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got["multi.w"], mean["w"], rtol=1e-5, atol=1e-6)

    with caplog.at_level(logging.WARNING, logger="flwr"):
        strategy, _ = _run_robust(module, client, silent={107, 108, 109})
    assert strategy.outputs == {}
    assert "Required at least 7 (fed.bulyan (f=1) is defined over at least 7 clients)" in caplog.text
