"""Private rounds (fcir.dp_mean / dp_sum) exported to Flower and run in-process
(tests/flowerlib/inprocess.py): clients clip on the device, the ServerApp sums and adds
the noise in server_result, plan.json states the privacy parameters, and the numbers are
the production bundle's and the reference interpreter's."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from corpus.compare import assert_trees_match
from fcir.interpreters import flower, production, reference
from flowerlib import files, inprocess, rounds
from flowerlib.programs import CLIP, Z, private_fedavg, private_fedavg_rounds

import fcir

pytest.importorskip("flwr", reason="the Flower tests need flwr (pip install 'fcir[flower]')")

N = rounds.NODES
KEY = jax.random.key_data(jax.random.key(3))  # production wire types carry raw key bits
R0 = jnp.int32(0)  # private_fedavg_rounds' round counter, folded into KEY each round


def _data():
    rng = np.random.default_rng(0)
    w, b = jnp.zeros((4, 2), jnp.float32), jnp.full((2,), 0.1, jnp.float32)
    x = jnp.asarray(rng.normal(size=(N, 5, 4)), jnp.float32)
    y = jnp.asarray(rng.normal(size=(N, 5, 2)) * 3, jnp.float32)
    y = y.at[0].multiply(0.01)  # client 0's update stays inside the clip ball
    return w, b, x, y


class RecordingGrid(inprocess.Grid):
    """The in-process grid, keeping every message sent and every reply's values."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.messages, self.replies = [], []

    def send_and_receive(self, messages, *, timeout=None):
        self.messages += list(messages)
        replies = super().send_and_receive(messages, timeout=timeout)
        self.replies += [r for r in replies if not r.has_error()]
        return replies


@pytest.fixture
def recording(monkeypatch):
    """inprocess.run hands its messages to a RecordingGrid."""
    monkeypatch.setattr(inprocess, "Grid", RecordingGrid)


def _payload(msg) -> int:
    return sum(len(a.data) for a in msg.content["arrays"].values())


def _nodes(tmp_path, *client_arrays) -> dict:
    """Nodes 10, 11, 12, each reading its row of every one of ``client_arrays``."""
    return files.write_nodes(tmp_path, [[a[i] for a in client_arrays] for i in range(N)], 10)


def test_private_fedavg_clips_on_the_device_and_noises_in_server_result(tmp_path, recording):
    w, b, x, y = _data()
    module = fcir.capture(private_fedavg(fcir.dp_mean), w, b, KEY, x, y)
    app = flower.export(module, tmp_path / "app", inputs=[np.asarray(w), np.asarray(b), KEY])
    plan = rounds.plan_of(app)

    # plan.json states what the production manifest states, and the dropout rule.
    bundle = production.export(module).write(tmp_path / "bundle")
    manifest = production.Bundle(bundle).manifest
    privacy = plan["privacy"]
    for k in ("releases", "delta", "epsilon_per_round", "accountant", "private_program_checked"):
        assert privacy[k] == manifest["privacy"][k], k
    assert privacy["releases"] == [
        {"op": "fed.dp_mean", "clip_norm": CLIP, "noise_multiplier": Z, "count": 1}
    ]
    assert privacy["epsilon_per_round"] == fcir.privacy.epsilon(module, 1, 1e-5)
    assert privacy["private_program_checked"] is True and privacy["dp_mean_divisor"] == N
    # The exchange only sums; the key stays at the server (the server sends the model).
    (exchange,) = [s for s in plan["steps"] if s["kind"] == "exchange"]
    assert [a["fed_op"] for a in exchange["aggregations"]] == ["fed.sum", "fed.sum"]

    nodes = _nodes(tmp_path, x, y)
    grid = inprocess.run(app, nodes, {"output": str(tmp_path / "o.npz")})
    model_bytes = w.nbytes + b.nbytes
    for msg in grid.messages:
        assert _payload(msg) == model_bytes
    # Only clipped updates leave a device: client 0's as computed, the others scaled to
    # the clip norm exactly (up to rounding).
    norms = {}
    for reply in grid.replies:
        leaves = grid.app.server.runtime.from_record(reply.content["arrays"])  # the app's decoder
        sq = sum(float(np.sum(np.square(a.astype(np.float64)))) for a in leaves.values())
        norms[reply.metadata.src_node_id] = np.sqrt(sq)
    assert sorted(norms) == sorted(nodes)
    assert norms[10] < 0.5 * CLIP
    for node in (11, 12):
        assert norms[node] == pytest.approx(CLIP, rel=1e-5)

    got = files.read_outputs(tmp_path / "o.npz")
    want = production.run_bundle(bundle, w, b, KEY, x, y)
    assert [g.tobytes() for g in got] == [np.asarray(v).tobytes() for v in want]
    ref = reference.run(module, w, b, KEY, x, y)
    assert_trees_match(got, [np.asarray(v) for v in ref], rtol=1e-5, atol=1e-5)

    # A client drops out: the two replies' clipped sum gets the same noise and is divided
    # by the declared cardinality (3), not by the 2 that replied.
    inprocess.run(app, nodes, {"output": str(tmp_path / "o2.npz"), "timeout": 1.0}, silent={12})
    got2 = files.read_outputs(tmp_path / "o2.npz")
    two = [w, b, KEY, x[:2], y[:2]]
    sum_round = rounds.rebind(fcir.capture(private_fedavg(fcir.dp_sum), w, b, KEY, x, y), 2)
    noised_sum = [np.asarray(v) - np.asarray(p) for v, p in zip(reference.run(sum_round, *two), (w, b))]
    expected = [np.asarray(p) + s / N for p, s in zip((w, b), noised_sum)]
    assert_trees_match(got2, expected, rtol=1e-5, atol=1e-5)
    per_replier = np.asarray(w) + noised_sum[0] / 2  # the reference dp_mean on the 2 alone
    assert not np.allclose(got2[0], per_replier, rtol=1e-3, atol=1e-3)


@fcir.program(placements={"clients": N}, private=True)
def private_mean_then_spread(scale, key, x):
    """Two exchanges, each released through a DP mean: the second broadcasts the first."""
    mean = fcir.dp_mean(
        fcir.map_fn(lambda s, x: s * jnp.mean(x, axis=0), (fcir.broadcast(scale), x)),
        1.0, 1.0, jax.random.fold_in(key, 0),
    )
    spread = fcir.dp_mean(
        fcir.map_fn(lambda m, x: jnp.mean(jnp.square(x - m), axis=0), (fcir.broadcast(mean), x)),
        2.0, 1.5, jax.random.fold_in(key, 1),
    )
    return mean, spread


def test_dp_aggregates_end_phases_and_their_costs_compose(tmp_path):
    scale = jnp.float32(2.0)
    x = jnp.asarray(np.random.default_rng(1).normal(size=(N, 5, 4)), jnp.float32)
    module = fcir.capture(private_mean_then_spread, scale, KEY, x)
    app = flower.export(module, tmp_path / "app", inputs=[np.asarray(scale), KEY])
    plan = rounds.plan_of(app)
    assert [s["kind"] for s in plan["steps"]] == ["server", "exchange", "server"] * 2
    for step in plan["steps"]:
        if step["kind"] == "exchange":
            assert [a["fed_op"] for a in step["aggregations"]] == ["fed.sum"]
    privacy = plan["privacy"]
    assert [(r["clip_norm"], r["noise_multiplier"]) for r in privacy["releases"]] == [
        (1.0, 1.0), (2.0, 1.5)
    ]
    assert privacy["epsilon_per_round"] == fcir.privacy.epsilon(module, 1, 1e-5)
    inprocess.run(app, _nodes(tmp_path, x), {"output": str(tmp_path / "o.npz")})
    expected = [np.asarray(v) for v in reference.run(module, scale, KEY, x)]
    assert_trees_match(files.read_outputs(tmp_path / "o.npz"), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # 7 s (docs/contributing.md)
def test_progress_lines_state_cumulative_epsilon_for_the_sampling_used(tmp_path, capsys):
    """fraction < 1 on a private app: each round Poisson-samples the online nodes with
    secret randomness (once per round) and its line states epsilon after r rounds with
    amplification at q=fraction, as fcir.privacy.epsilon computes it; a fixed-size
    sample (clients=K) claims no amplification; every client: q=1."""
    import re

    w, b, x, y = _data()
    module = fcir.capture(private_fedavg_rounds(fcir.dp_mean), w, b, R0, KEY, x, y)
    app = flower.export(
        module, tmp_path / "app", inputs=[np.asarray(w), np.asarray(b), np.asarray(R0), KEY]
    )
    nodes = {}
    for i in range(16):  # P(a round samples no node) = 2**-16
        np.savez(tmp_path / f"m{i}.npz", np.asarray(x[i % N]), np.asarray(y[i % N]))
        nodes[100 + i] = {"partition-id": i, "data-path": str(tmp_path / f"m{i}.npz")}

    def lines(config):
        capsys.readouterr()
        grid = inprocess.run(app, nodes, {"num-server-rounds": 3, **config})
        out = capsys.readouterr().out
        return grid, re.findall(r"epsilon=(\S+) after (\d) round\(s\) \(delta=1e-05, ([^)]*)\)", out)

    grid, got = lines({"fraction-train": 0.5})
    assert [(e, int(r)) for e, r, _ in got] == [
        (f"{fcir.privacy.epsilon(module, r, 1e-5, sampling_rate=0.5):.4g}", r) for r in (1, 2, 3)
    ]
    assert {how for _, _, how in got} == {"Poisson sampling q=0.5"}
    assert 0 < len(grid.sent) < 3 * 16
    full = [f"{fcir.privacy.epsilon(module, r, 1e-5):.4g}" for r in (1, 2, 3)]
    assert float(got[2][0]) < float(full[2])  # amplification by sampling
    _, fixed = lines({"clients": 8})
    assert [e for e, _, _ in fixed] == full
    assert {how for _, _, how in fixed} == {"no amplification claimed: fixed-size sampling"}
    _, every = lines({})
    assert [e for e, _, _ in every] == full and {h for _, _, h in every} == {"every client"}


def _budget_app(tmp_path):
    """The private FedAvg round that folds its state-fed round number into its key,
    exported with its server inputs, its nodes, its module."""
    w, b, x, y = _data()
    module = fcir.capture(private_fedavg_rounds(fcir.dp_mean), w, b, R0, KEY, x, y)
    app = flower.export(
        module, tmp_path / "app", inputs=[np.asarray(w), np.asarray(b), np.asarray(R0), KEY]
    )
    return app, _nodes(tmp_path, x, y), module


def _between(module, k: int) -> float:
    """A max-epsilon that k rounds stay within and k + 1 pass (fcir.privacy.epsilon,
    every client sampled, the plan's delta)."""
    lo, hi = (fcir.privacy.epsilon(module, r, 1e-5) for r in (k, k + 1))
    assert lo < hi
    return (lo + hi) / 2


@pytest.mark.slow  # 5 s (docs/contributing.md)
def test_max_epsilon_stops_before_the_round_that_would_pass_it(tmp_path, capsys):
    """num-server-rounds=6 max-epsilon between epsilon(3 rounds) and epsilon(4 rounds): the app runs
    3 rounds, says why it stops before round 4, and writes the 3 rounds' outputs."""
    import re

    app, nodes, module = _budget_app(tmp_path)
    cap = _between(module, 3)
    inprocess.run(app, nodes, {"num-server-rounds": 3, "output": str(tmp_path / "three.npz")})
    capsys.readouterr()
    out = str(tmp_path / "budget.npz")
    inprocess.run(app, nodes, {"num-server-rounds": 6, "max-epsilon": cap, "output": out})
    text = capsys.readouterr().out
    assert re.findall(r"round (\d)/6:", text) == ["1", "2", "3"]
    eps3, eps4 = (fcir.privacy.epsilon(module, r, 1e-5) for r in (3, 4))
    assert (
        f"stopping before round 4: it would bring epsilon to {eps4:.4g}, past max-epsilon="
        f"{cap:g} (delta=1e-05, every client); ran 3 round(s), epsilon={eps3:.4g} spent"
    ) in text
    assert [a.tobytes() for a in files.read_outputs(out)] == [
        a.tobytes() for a in files.read_outputs(tmp_path / "three.npz")
    ]
    # A budget that round 1 already passes: nothing to write, a clear error.
    with pytest.raises(Exception, match="stopping before round 1.*raise max-epsilon") as e:
        inprocess.run(app, nodes, {"num-server-rounds": 2, "max-epsilon": eps3 / 1e3})
    assert type(e.value).__name__ == "AppError"


@pytest.mark.slow  # 7 s (docs/contributing.md)
def test_a_resumed_run_keeps_spending_the_checkpointed_budget(tmp_path, capsys):
    """Two rounds checkpointed with their budget, then num-server-rounds=6 again: the resumed run
    counts the 2 rounds spent, so it runs round 3 only (from zero it would run 3 more),
    and its outputs are the uninterrupted 3-round run's."""
    import json
    import re

    from fcir.checkpoint import CheckpointManager

    app, nodes, module = _budget_app(tmp_path)
    cap = _between(module, 3)
    ckpt = tmp_path / "ckpt"
    base = {"max-epsilon": cap, "checkpoint-dir": str(ckpt)}
    inprocess.run(app, nodes, {**base, "num-server-rounds": 2})
    manager = CheckpointManager(ckpt)
    saved = json.loads(str(manager.restore(manager.latest_step())["meta"]["budget"]))
    assert saved["rounds"] == 2 and saved["max_epsilon"] == cap
    assert saved["epsilon"] == pytest.approx(fcir.privacy.epsilon(module, 2, 1e-5))
    capsys.readouterr()
    out = str(tmp_path / "resumed.npz")
    inprocess.run(app, nodes, {**base, "num-server-rounds": 6, "output": out})
    text = capsys.readouterr().out
    assert "resuming after round 2" in text
    assert re.findall(r"round (\d)/6:", text) == ["3"]
    assert "stopping before round 4" in text and "ran 3 round(s)" in text
    inprocess.run(app, nodes, {"num-server-rounds": 3, "output": str(tmp_path / "three.npz")})
    assert [a.tobytes() for a in files.read_outputs(out)] == [
        a.tobytes() for a in files.read_outputs(tmp_path / "three.npz")
    ]
    # Resumed at another sampling rate, the saved rounds' epsilon would not compose.
    with pytest.raises(Exception, match="resume with the same fraction") as e:
        inprocess.run(app, nodes, {**base, "num-server-rounds": 6, "fraction-train": 0.5})
    assert type(e.value).__name__ == "AppError"


def test_max_epsilon_on_an_app_without_dp_ops_is_a_clear_error(tmp_path):
    r = rounds.corpus_round("fedavg_mlp")
    app = rounds.export(r, tmp_path / "app")
    plan = rounds.plan_of(app)
    nodes = {}
    for i in range(rounds.NODES):
        np.savez(tmp_path / f"p{i}.npz", *r.node_leaves(plan, i))
        nodes[101 + i] = {"partition-id": i, "data-path": str(tmp_path / f"p{i}.npz")}
    # The app's own AppError (its runtime module is loaded from the app directory).
    with pytest.raises(Exception, match="max-epsilon=8: .* no DP ops .*drop max-epsilon") as e:
        inprocess.run(app, nodes, {"num-server-rounds": 2, "max-epsilon": 8.0})
    assert type(e.value).__name__ == "AppError"
    with pytest.raises(Exception, match="max-epsilon='lots': expected a finite number > 0"):
        inprocess.run(app, nodes, {"num-server-rounds": 2, "max-epsilon": "lots"})


def test_max_epsilon_on_a_training_program_loop_is_a_clear_error(tmp_path):
    """A private program running its rounds in a lax.scan exports as one app whose loop
    the budget cannot cut short: max-epsilon is refused, naming what to do."""

    @fcir.program(placements={"clients": N}, private=True)
    def train(w, key, x):
        def body(w, i):
            upd = fcir.map_fn(lambda w, x: jnp.mean(x, axis=0) - w, (fcir.broadcast(w), x))
            d = fcir.dp_mean(upd, 1.0, 1.0, jax.random.fold_in(key, i))
            return w + d, jnp.sum(d)

        return jax.lax.scan(body, w, jnp.arange(3))

    w, x = jnp.zeros((2,), jnp.float32), jnp.ones((N, 4, 2), jnp.float32)
    module = fcir.capture(train, w, KEY, x)
    app = flower.export(module, tmp_path / "app", inputs=[np.asarray(w), KEY])
    nodes = _nodes(tmp_path, x)
    with pytest.raises(Exception, match="runs its own scan of rounds.*rounds=N max-epsilon") as e:
        inprocess.run(app, nodes, {"max-epsilon": 5.0})
    assert type(e.value).__name__ == "AppError"


@pytest.mark.slow  # 5 s (docs/contributing.md)
def test_exact_mode_sends_grid_integers_and_releases_the_reference_s_lattice_points(tmp_path):
    """dp_mean(exact=True) (fcir.mechanisms.lattice): each node sends its clipped update
    rounded to the grid as int32, the ServerApp sums integers and releases k * gamma,
    bit for bit the reference interpreter's."""
    w, b, x, y = _data()

    def exact(*a):
        return fcir.dp_mean(*a, exact=True, gamma=2.0**-10)

    module = fcir.capture(private_fedavg(exact), w, b, KEY, x, y)
    app = flower.export(module, tmp_path / "app", inputs=[np.asarray(w), np.asarray(b), KEY])
    (release,) = rounds.plan_of(app)["privacy"]["releases"]
    assert release["gamma"] == 2.0**-10
    nodes = _nodes(tmp_path, x, y)
    inprocess.run(app, nodes, {"output": str(tmp_path / "o.npz")})
    got = files.read_outputs(tmp_path / "o.npz")
    want = reference.run(module, w, b, KEY, x, y)
    for g, v in zip(got, want):
        assert np.array_equal(g, np.asarray(v))
    k = got[0].astype(np.float64) / 2.0**-10  # w starts at zero: its output is the release
    assert np.array_equal(k, np.round(k)) and np.any(k != 0)
