"""fcir inside a Flower user's own app: docs/flower_app.md's app, shipped as
examples/flower_app (pyproject.toml, flower_app/server_app.py with ``flower.Strategy``,
flower_app/client_app.py with ``flower.Client``), alone and inside Flower's DP wrappers:
in this process on a grid that hands each message to the ClientApp
(tests/flowerlib/inprocess.py), and by the page's own ``fcir flower simulate`` command on
Flower's Simulation Engine (slow)."""

from __future__ import annotations

import itertools
import pathlib
import re
import shlex
import sys
import textwrap
import tomllib
import types

import numpy as np
import pytest
from flowerlib import inprocess

pytest.importorskip("flwr", reason="the Flower tests need flwr (pip install 'fcir[flower]')")

from flwr.app import Context, RecordDict  # noqa: E402

ROOT = pathlib.Path(__file__).parents[3]
APP = ROOT / "examples" / "flower_app"
DOCS = ROOT / "docs" / "flower_app.md"
NODES = 3


@pytest.fixture(scope="module")
def user_app():
    """The app's modules, imported as Flower imports them (the app folder on sys.path)."""
    sys.path.insert(0, str(APP))
    try:
        from flower_app import client_app, server_app, task

        yield types.SimpleNamespace(client=client_app, server=server_app, task=task)
    finally:
        sys.path.remove(str(APP))


def run_config(**given) -> dict:
    with open(APP / "pyproject.toml", "rb") as f:
        declared = tomllib.load(f)["tool"]["flwr"]["app"]["config"]
    return {**declared, **{k.replace("_", "-"): v for k, v in given.items()}}


def run_inprocess(app, client_app, tmp_path, node_ids=(101, 102, 103), **config) -> dict:
    """The ServerApp's main on NODES in-process nodes (node_ids[i] holds partition i);
    the final arrays it saved, by "stage.key"."""
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 0  # as flwr-serverapp
    nodes = {nid: {"partition-id": i, "num-partitions": NODES} for i, nid in enumerate(node_ids)}
    grid = inprocess.Grid(
        types.SimpleNamespace(client=types.SimpleNamespace(app=client_app)), nodes
    )
    out = tmp_path / f"final-{'-'.join(map(str, node_ids))}.npz"
    cfg = run_config(output=str(out), **config)
    for c in grid.contexts.values():
        c.run_config = cfg
    app.server.app(
        grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=cfg)
    )
    with np.load(out) as f:
        return {k: f[k] for k in f.files}


def oracle(task, stage: str, *, clip: float, noise: float, seed=None):
    """The global model after each round as Flower's FedAvg with fixed clipping
    computes it, in numpy on the template's own training (jax, eager): each client's
    update ``trained - global`` scaled by ``min(1, clip / ||update||)`` (one norm over
    all arrays), the mean weighted by num-examples, plus Gaussian noise of standard
    deviation ``noise * clip / NODES`` drawn by numpy's global generator, as
    ``add_gaussian_noise_inplace`` draws it, for the run config's rounds. Returns
    (rounds' globals, clipped?)."""
    import jax

    if seed is not None:
        np.random.seed(seed)
    start = task.load_model((3,))
    g = [np.asarray(start["b"], np.float32), np.asarray(start["w"], np.float32)]
    out, clipped = [], []
    for _ in range(run_config()["num-server-rounds"]):
        models, weights = [], []
        for i in range(NODES):
            x, y, _, _ = task.load_data(i)
            params = {"b": g[0], "w": g[1]}
            trained, _, n = task.train(
                params, jax.grad(task.loss_fn), x.astype(np.float32), y.astype(np.float32)
            )
            update = [np.asarray(trained["b"]) - g[0], np.asarray(trained["w"]) - g[1]]
            if stage != "fedavg":
                norm = np.sqrt(sum(float(np.sum(u.astype(np.float64) ** 2)) for u in update))
                clipped.append(norm > clip)
                # Flower 1.42's clip_inputs_inplace does `array *= factor` on each
                # update, and the update of a 0-d array (the template's b) is a NumPy
                # scalar (np.subtract's result), so only its name is rebound: Flower
                # clips every array but the 0-d ones.
                update = [u * min(1.0, clip / norm) if u.ndim else u for u in update]
            models.append([a + u for a, u in zip(g, update)])
            weights.append(n)
        g = [
            np.float32(
                sum(w * m[k].astype(np.float64) for w, m in zip(weights, models)) / sum(weights)
            )
            for k in range(2)
        ]
        g = [np.asarray(a, np.float32) for a in g]
        if stage != "fedavg":
            std = noise * clip / NODES
            g = [a + np.random.normal(0, std, a.shape).astype(np.float32) for a in g]
        out.append(g)
    return out, clipped


def final(arrays: dict, stage: str) -> list[np.ndarray]:
    return [arrays[f"{stage}.0"], arrays[f"{stage}.1"]]


@pytest.mark.parametrize(
    "stage,noise", [("server-dp", 0.0), ("client-dp", 0.0), ("server-dp", 1.0)]
)
def test_flower_s_dp_wrappers_clip_and_noise_fcir_s_round_as_flower_says(
    user_app, tmp_path, caplog, stage, noise
):
    """DifferentialPrivacy{Server,Client}SideFixedClipping around flower.Strategy (the
    client side with Flower's fixedclipping_mod): the global model is the numpy
    oracle's, every client's update was clipped, and Flower's wrapper says so."""
    import logging

    client = user_app.client.dp_app if stage == "client-dp" else user_app.client.app
    clip = 0.5
    np.random.seed(7)
    with caplog.at_level(logging.INFO, logger="flwr"):
        got = run_inprocess(
            user_app, client, tmp_path, stages=stage, clipping_norm=clip, noise_multiplier=noise
        )
    want, clipped = oracle(user_app.task, stage, clip=clip, noise=noise, seed=7)
    rounds = run_config()["num-server-rounds"]
    assert all(clipped) and len(clipped) == rounds * NODES  # it binds for every update
    for a, b in zip(final(got, stage), want[-1]):
        assert a.dtype == np.float32 and a.shape == b.shape
        np.testing.assert_allclose(a, b, rtol=2e-6, atol=2e-6)
    plain, _ = oracle(user_app.task, "fedavg", clip=clip, noise=0.0)
    assert not np.allclose(final(got, stage)[1], plain[-1][1], atol=1e-3)  # not FedAvg's
    text = caplog.text
    where = "fixedclipping_mod" if stage == "client-dp" else "aggregate_fit"
    assert f"{where}: parameters are clipped by value: 0.5000" in text
    assert f"central DP noise with {noise * clip / NODES:.4f} stdev added" in text
    assert "Aggregated MetricRecord: {'train_loss'" in text and "Final results:" in text
    assert text.count("Aggregated MetricRecord: {'test_loss'") == rounds  # evaluated too
    assert "Received error" not in text


def test_the_reply_is_flower_s_layout_the_model_under_the_sent_keys(user_app):
    """flower.Client's train reply: one ArrayRecord of Flower's numpy arrays under the
    keys the server sent (what fixedclipping_mod and the DP wrappers require), the
    round's other client outputs beside it; flower.Strategy reads both back."""
    from fcir.interpreters import flower
    from flwr.app import Message
    from flwr.serverapp.strategy.strategy_utils import validate_message_reply_consistency

    module, _ = user_app.task.capture()
    strategy = flower.Strategy(module)
    start = user_app.task.load_model((3,))
    sent = strategy.parts.send([np.asarray(start["b"]), np.asarray(start["w"])])
    from fcir.interpreters.flower.parts import record_of
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 0  # as flwr-serverapp
    msg = Message(RecordDict({"arrays": record_of(sent)}), dst_node_id=5, message_type="train")
    x, y, _, _ = user_app.task.load_data(0)
    reply = user_app.client.work().train(msg, x, y)
    arrays = reply.content["arrays"]
    assert list(arrays.keys()) == list(sent.keys())
    assert all(a.stype == "numpy.ndarray" for a in arrays.values())
    import jax

    task = user_app.task
    trained, loss, _ = task.train(
        start, jax.grad(task.loss_fn), x.astype(np.float32), y.astype(np.float32)
    )
    np.testing.assert_allclose(arrays.to_numpy_ndarrays()[1], trained["w"], rtol=1e-6)
    validate_message_reply_consistency([reply.content], "num-examples", check_arrayrecord=True)
    assert sorted(reply.content.config_records) == [
        "fcir"
    ]  # Flower's checks read only arrays, metrics
    # Read back: every client output the round's aggregations take, the model from the
    # ArrayRecord (by the reply's own list), the rest from the ConfigRecord.
    outs = strategy._client_outputs(reply)
    assert sorted(outs) == sorted(
        f"{g}/{n}" for g, n in strategy.parts.exchange["client"]["results"]
    )
    model = user_app.client.work().model
    assert list(model) == list(sent)
    # The pairing follows flower.Strategy's state= (which output is which global array).
    agg = [a["output"] for a in strategy.parts.exchange["aggregations"]]
    assert list(model.values()) == [f"client_output/{agg[0]}", f"client_output/{agg[1]}"]
    swapped = flower.Client(module, state={0: 2, 1: 1}).model  # b from train_loss's output
    assert list(swapped.values()) == [f"client_output/{agg[2]}", f"client_output/{agg[1]}"]
    for k, o in model.items():
        assert outs[o].tobytes() == arrays[k].numpy().tobytes()
    (b, wb), (w, ww), (loss_, lw) = [a["inputs"] for a in strategy.parts.exchange["aggregations"]]
    assert [float(outs[f"client_output/{n}"]) for n in (wb, ww, lw)] == [30.0] * 3  # num-examples
    assert np.isclose(float(outs[f"client_output/{loss_}"]), float(loss), rtol=1e-6)


def test_secaggplus_takes_only_the_legacy_strategy_api_in_flwr_1_42_and_dp_accounting_only_fedavg(
    user_app,
):
    """What docs/flower_app.md says: Flower 1.42's SecAgg+ (SecAggPlusWorkflow) runs
    only in a LegacyContext, calling the legacy configure_fit / aggregate_fit, which a
    Message-API strategy (flwr.serverapp.strategy.Strategy, so flower.Strategy) lacks;
    and flwr.serverapp.strategy offers no SecAgg wrapper; the DP wrappers' privacy
    accountant takes only FedAvg's own aggregate_train. When a later flwr changes
    this, this test fails and the page must change with it."""
    import flwr
    import flwr.serverapp.strategy as message_strategies
    from fcir.interpreters import flower
    from flwr.server.workflow import SecAggPlusWorkflow

    assert flwr.__version__ == "1.42.0"
    assert not [n for n in dir(message_strategies) if "secagg" in n.lower()]
    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={})
    with pytest.raises(TypeError, match="Expect a LegacyContext"):
        SecAggPlusWorkflow(num_shares=3, reconstruction_threshold=2)(None, context)
    strategy = flower.Strategy(user_app.task.capture()[0])
    assert not hasattr(strategy, "configure_fit") and not hasattr(strategy, "aggregate_fit")
    src = (
        pathlib.Path(flwr.__file__).parent
        / "server/workflow/secure_aggregation/secaggplus_workflow.py"
    )
    lines = src.read_text().splitlines()
    page = DOCS.read_text()
    assert "secaggplus_workflow.py" in page
    for line, code in [
        (185, "isinstance(context, LegacyContext)"),
        (286, "context.strategy.configure_fit("),
        (665, "context.strategy.aggregate_fit("),
    ]:
        assert code in lines[line - 1] and f"line {line}" in page  # the page's references
    mod = pathlib.Path(flwr.__file__).parent / "client/mod/secure_aggregation/secaggplus_mod.py"
    assert "compat.recorddict_to_fitres(" in mod.read_text()
    # The DP wrappers' accountant= takes only FedAvg's own aggregate_train (a stand-in
    # accountant with the one setting the wrapper reads first).
    from flwr.serverapp.strategy import DifferentialPrivacyServerSideFixedClipping
    from flwr.supercore.privacy_accounting import SamplingMethod

    accountant = types.SimpleNamespace(
        config=types.SimpleNamespace(sampling_method=SamplingMethod.NO_AMPLIFICATION)
    )
    with pytest.raises(ValueError, match="FedAvg.aggregate_train"):
        DifferentialPrivacyServerSideFixedClipping(strategy, 1.0, 0.5, 3, accountant=accountant)


def test_the_docs_page_shows_the_app_s_own_code():
    """docs/flower_app.md shows examples/flower_app as it is: every ``python excerpt``
    block (lines of the app at their place in it, which tests/examples/test_docs.py does
    not run on their own) and every block of its task.py section (which it runs) is a
    verbatim excerpt of the app's files, and its commands run that folder."""
    page = DOCS.read_text()
    task = page.split("## task.py", 1)[1].split("\n## ", 1)[0]
    snippets = re.findall(r"```python excerpt\n(.*?)```", page, re.S)
    snippets += re.findall(
        r"```python\n(.*?)```", task.split("```python\nfrom fcir.interpreters")[0], re.S
    )
    assert len(snippets) >= 7
    sources = "\n".join(p.read_text() for p in sorted((APP / "flower_app").glob("*.py")))
    for s in snippets:  # at the indentation the code has there
        assert any(textwrap.indent(textwrap.dedent(s), " " * k) in sources for k in (0, 4, 8)), s
    commands = _simulate_commands()
    assert [c[:6] for c in commands] == [
        ["fcir", "flower", "simulate", "examples/flower_app", "--nodes", "3"]
    ] * 2


def _simulate_commands() -> list[list[str]]:
    """The page's ``fcir flower simulate`` command lines, split as a shell splits them."""
    blocks = re.findall(r"```bash\n(.*?)```", DOCS.read_text(), re.S)
    return [
        shlex.split(line)
        for b in blocks
        for line in b.splitlines()
        if line.startswith("fcir flower simulate")
    ]


def _page_log() -> list[str]:
    """The log lines docs/flower_app.md shows (after Flower's level), as patterns: its
    ``...`` are the digits a float's last bits may change."""
    (block,) = re.findall(r"```text\n(INFO .*?)```", DOCS.read_text(), re.S)
    lines = [line.split("INFO :      ", 1)[1] for line in block.splitlines()]
    return [re.escape(line).replace(re.escape("..."), r"\d*") for line in lines]


def _shows_in_order(patterns: list[str], log: str) -> bool:
    return re.search("\n.*".join(patterns), log) is not None


def test_the_page_s_log_is_the_app_s(user_app, tmp_path, caplog):
    """The first round's log lines on docs/flower_app.md are the app's (in this process;
    the slow test below checks the page's command prints them too)."""
    import logging

    with caplog.at_level(logging.INFO, logger="flwr"):
        run_inprocess(user_app, user_app.client.app, tmp_path, stages="fedavg")
    assert _shows_in_order(_page_log(), "\n".join(r.getMessage() for r in caplog.records)), (
        caplog.text[-3000:]
    )


# --- the page's command: a real flwr run -----------------------------------------------


@pytest.mark.slow
def test_the_page_s_command_runs_the_app_on_the_simulation_engine(
    user_app, tmp_path, monkeypatch, capsys
):
    """The page's ``fcir flower simulate examples/flower_app ...`` (3 virtual nodes,
    flower.Strategy then the same inside DifferentialPrivacyServerSideFixedClipping, 3
    rounds each, in one run), started in a folder of the user's: the final models land
    there, within one ulp per round of the same app run in this process (FedAvg's mean
    adds the replies in the order they arrive, which a real run does not fix), the DP
    one the oracle's. Flower's log shows its strategy lines, the page's log and "Final
    results", and no traceback or warning: every node evaluates (its ClientApp has an
    evaluate handler), no fork warning, no half-read compilation cache entry. Nothing of
    the run is left behind."""
    pytest.importorskip(
        "ray", reason="the Simulation Engine needs ray (pip install 'fcir[flower]')"
    )
    import tempfile
    import time

    from fcir.interpreters.flower.simulation import _pids_with_home_under

    from fcir import cli

    work, tmp = tmp_path / "work", tmp_path / "tmp"
    work.mkdir()
    tmp.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))  # where the run's own folder goes
    (command,) = [c for c in _simulate_commands() if "--run-config" in c]
    t0 = time.monotonic()
    code = cli.main([str(ROOT / a) if a == "examples/flower_app" else a for a in command[1:]])
    seconds = time.monotonic() - t0
    log, err = capsys.readouterr()
    assert code == 0, (log + err)[-3000:]
    print(f"fcir flower simulate (3 nodes, 3+3 rounds): {seconds:.1f} s")
    assert re.search(r"\[fcir\] simulated run \d+ finished: completed\n", log), log[-2000:]
    assert not [p.name for p in tmp.iterdir() if p.name.startswith("fcir-simulate-")]
    assert _pids_with_home_under(tmp.resolve()) == []  # nothing left running
    with np.load(work / "final_model.npz") as f:  # run config output, relative: here
        got = {k: f[k] for k in f.files}
    # Flower's own lines: its summary with fcir's round, sampling, named metrics, the
    # evaluate stage, the DP wrapper's clipping and noise, and the final summary (twice).
    assert log.count("[ROUND 3/3]") == 2 and log.count("Final results:") == 2, log[-3000:]
    assert "fcir round @fedavg_round" in log
    assert _shows_in_order(_page_log(), log), log[-3000:]
    assert "aggregate_fit: parameters are clipped by value: 0.5000" in log
    assert "central DP noise with 0.0000 stdev added" in log
    for noise in (
        "Traceback",
        "No evaluate function registered",
        "os.fork()",
        "Warning",
        "Error reading persistent compilation cache",
    ):
        assert noise not in log + err, (log + err)[-3000:]
    # In-process, for every order of the partitions' node ids: the run is one of them.
    refs = [
        run_inprocess(
            user_app, user_app.client.app, tmp_path, node_ids=ids, stages="fedavg,server-dp"
        )
        for ids in itertools.permutations((101, 102, 103))
    ]
    assert sorted(got) == sorted(refs[0]) == ["fedavg.0", "fedavg.1", "server-dp.0", "server-dp.1"]

    # FedAvg's weighted mean adds the replies in the order they arrive, which a real run
    # does not fix: each round's mean may differ from an in-process order in its last
    # bit, so the run is within one float32 ulp per round of one of them.
    def ulps(a, b):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        return int(
            np.max(np.abs(a.view(np.int32).astype(np.int64) - b.view(np.int32).astype(np.int64)))
        )

    closest = min(max(ulps(got[k], r[k]) for k in got) for r in refs)
    assert closest <= run_config()["num-server-rounds"], {k: (got[k], refs[0][k]) for k in got}
    plain, _ = oracle(user_app.task, "fedavg", clip=0.5, noise=0.0)
    dp, _ = oracle(user_app.task, "server-dp", clip=0.5, noise=0.0)
    np.testing.assert_allclose(final(got, "fedavg")[1], plain[-1][1], rtol=2e-6)
    np.testing.assert_allclose(final(got, "server-dp")[1], dp[-1][1], rtol=2e-6)


def test_a_round_whose_model_is_not_a_client_mean_replies_without_one_and_clipping_refuses_it():
    """A server step after the mean (server-side SGD): no client output is the sent
    array's new value, so the reply's ArrayRecord is empty, every client output beside
    it (Flower's
    clipping refuses it, as docs/flower_app.md says), and flower.Strategy still runs
    the round on them; the FedAvg form of the same round is paired, and clipped."""

    from fcir.interpreters import flower, reference
    from fcir.interpreters.flower.parts import record_of
    from flwr.app import Array, ArrayRecord, ConfigRecord, Message
    from flwr.clientapp.mod import fixedclipping_mod
    from flwr.serverapp.strategy import DifferentialPrivacyServerSideFixedClipping
    from flwr.supercore.differential_privacy import KEY_CLIPPING_NORM
    from flwr.supercore.task_identity import TaskIdentity

    import fcir

    @fcir.program(placements={"clients": 2})
    def sgd(w, x):
        grads = fcir.map_fn(lambda w, x: w - x, (fcir.broadcast(w), x))
        return w - 0.5 * fcir.reduce_mean(grads)

    @fcir.program(placements={"clients": 2})
    def avg(w, x):
        return fcir.reduce_mean(fcir.map_fn(lambda w, x: 0.5 * (w + x), (fcir.broadcast(w), x)))

    w, xs = np.ones(3, np.float32), np.arange(6, dtype=np.float32).reshape(2, 3)
    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 0
    for program, paired in [(sgd, False), (avg, True)]:
        module = fcir.capture(program, w, xs)
        client, strategy = flower.Client(module), flower.Strategy(module)
        assert (client.model is not None) == paired
        sent = strategy.parts.send([w])
        replies = []
        for node, x in zip((7, 8), xs):
            msg = Message(
                RecordDict({"arrays": record_of(sent)}), dst_node_id=node, message_type="train"
            )
            reply = client.train(msg, x)
            assert reply.metadata.src_node_id == node
            replies.append(reply)
        arrays = replies[0].content["arrays"]
        assert "fcir" in replies[0].content.config_records
        assert list(arrays.keys()) == (list(sent) if paired else [])
        strategy._keys, strategy._global[1] = ["w"], [w]
        new, _ = strategy.aggregate_train(1, replies)
        want = np.asarray(reference.run(module, w, xs))
        np.testing.assert_allclose(new["w"].numpy(), want, rtol=1e-6)
        # Flower's clipping, as docs/flower_app.md says: it takes the paired reply and
        # refuses the other (the mod: keys that differ; the server side: zip()).
        config = ConfigRecord({KEY_CLIPPING_NORM: 0.1})
        msg = Message(
            RecordDict({"arrays": record_of(sent), "config": config}),
            dst_node_id=7,
            message_type="train",
        )
        clipped = fixedclipping_mod(msg, None, lambda m, _, c=client: c.train(m, xs[0]))
        assert clipped.has_error() != paired
        if not paired:
            assert "expects the keys in the ArrayRecord" in clipped.error.reason
        dp = DifferentialPrivacyServerSideFixedClipping(strategy, 0.0, 0.1, 2)
        dp.current_arrays = ArrayRecord({"w": Array(w)})
        strategy._global[1] = [w]
        if paired:
            assert dp.aggregate_train(1, replies)[0] is not None
        else:
            with pytest.raises(ValueError, match="zip"):
                dp.aggregate_train(1, replies)
