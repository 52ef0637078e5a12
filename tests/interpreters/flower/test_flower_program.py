"""Whole training programs on Flower: a main that runs its rounds in a server
``lax.scan``, ``fori_loop`` or ``while_loop`` exports as an app running one Flower round
per iteration (in-process grid, as test_flower_app.py), and writes what reference.run
returns for the whole program."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from corpus.compare import assert_trees_match
from fcir.interpreters import flower
from flowerlib import files, inprocess, programs, rounds

import fcir

pytest.importorskip("flwr", reason="the Flower tests need flwr (pip install 'fcir[flower]')")

N = rounds.NODES


def _nodes(root, client_leaves) -> dict:
    """Nodes 40, 41, 42, each reading its row of every leaf of ``client_leaves``."""
    return files.write_nodes(
        root, [[np.asarray(x)[i] for x in client_leaves] for i in range(N)], 40
    )


def _assert_same(got, want):
    assert [(g.dtype, g.shape) for g in got] == [(w.dtype, w.shape) for w in want]
    assert_trees_match(got, want, rtol=1e-5, atol=1e-6)


def test_a_scan_of_rounds_runs_one_flower_round_per_iteration_and_resumes(tmp_path, capsys):
    """scan_rounds (FedAvg with server momentum in a lax.scan over 3 rounds): one Flower
    round (one message per node) per iteration, the carry kept at the server, the losses
    stacked; the output file is reference.run's results. Checkpointed each round: a run
    started again after round 2 runs round 3 only and writes the same bytes."""
    r = rounds.corpus_round("scan_rounds")
    with pytest.raises(fcir.FcirError, match="one round per iteration"):
        from fcir.interpreters import production

        production.export(r.module)
    app = rounds.export(r, tmp_path / "app")
    plan = rounds.plan_of(app)
    assert plan["loop"]["kind"] == "scan" and plan["loop"]["length"] == 3
    nodes = _nodes(tmp_path, [x for x, c in zip(r.leaves, r.is_client) if c])
    ckpt = tmp_path / "ckpt"
    grid = inprocess.run(
        app, nodes, {"output": str(tmp_path / "o.npz"), "checkpoint-dir": str(ckpt)}
    )
    assert len(grid.sent) == 3 * N
    said = capsys.readouterr().out
    assert "round 3/3: 3/3 clients replied" in said and "ys_0=" in said, said
    got = files.read_outputs(tmp_path / "o.npz")
    _assert_same(got, rounds.reference_outputs(r))
    assert sorted(p.name for p in ckpt.iterdir() if p.name.isdigit()) == ["2", "3"]
    import shutil

    shutil.rmtree(ckpt / "3")
    grid = inprocess.run(
        app, nodes, {"output": str(tmp_path / "p.npz"), "checkpoint-dir": str(ckpt)}
    )
    assert len(grid.sent) == N  # round 3 only
    assert "resuming after round 2" in capsys.readouterr().out
    assert [g.tobytes() for g in files.read_outputs(tmp_path / "p.npz")] == [
        g.tobytes() for g in got
    ]
    with pytest.raises(RuntimeError, match="runs its own scan of rounds"):
        inprocess.run(app, nodes, {"num-server-rounds": 3})
    from fcir.interpreters.flower.cli import run_hint

    assert run_hint(app).endswith("local --stream")  # no num-server-rounds/state


def test_a_reverse_scan_with_server_xs_and_two_exchanges_per_iteration(tmp_path):
    w = jnp.zeros(4, jnp.float32)
    lrs = jnp.asarray([0.5, 0.25, 0.125, 0.0625], jnp.float32)
    x = jnp.asarray(np.random.default_rng(2).normal(size=(N, 6, 4)), jnp.float32)
    module = fcir.capture(programs.reverse_scan_two_exchanges, w, lrs, x)
    app = flower.export(module, tmp_path / "app", inputs=[np.asarray(w), np.asarray(lrs)])
    grid = inprocess.run(app, _nodes(tmp_path, [x]), {"output": str(tmp_path / "o.npz")})
    assert len(grid.sent) == 4 * 2 * N  # 4 rounds, 2 exchanges each
    _assert_same(
        files.read_outputs(tmp_path / "o.npz"), rounds.module_reference_outputs(module, (w, lrs, x))
    )


def test_a_while_loop_of_rounds_evaluates_its_condition_at_the_server(tmp_path):
    w = jnp.zeros(3, jnp.float32)
    x = jnp.asarray(1.0 + 0.1 * np.random.default_rng(3).normal(size=(N, 5, 3)), jnp.float32)
    target = jnp.float32(0.3)
    module = fcir.capture(programs.train_until, w, target, x)
    want = rounds.module_reference_outputs(module, (w, target, x))
    app = flower.export(module, tmp_path / "app", inputs=[np.asarray(w), np.asarray(target)])
    assert rounds.plan_of(app)["loop"]["kind"] == "while"
    grid = inprocess.run(app, _nodes(tmp_path, [x]), {"output": str(tmp_path / "o.npz")})
    rounds_run = int(want[2])
    assert 1 < rounds_run < 10 and len(grid.sent) == rounds_run * N
    _assert_same(files.read_outputs(tmp_path / "o.npz"), want)


@fcir.program(placements={"clients": N})
def client_code_before_the_loop(w, x):
    x2 = fcir.map_fn(lambda x: 2.0 * x, x)

    def one_round(w, _):
        return fcir.reduce_mean(
            fcir.map_fn(lambda w, x: w + jnp.mean(x), (fcir.broadcast(w), x2))
        ), None

    return jax.lax.scan(one_round, w, None, length=2)[0]


def test_programs_that_are_not_a_server_loop_of_rounds_are_refused(tmp_path):
    w, x = jnp.zeros(2, jnp.float32), jnp.ones((N, 4), jnp.float32)
    module = fcir.capture(client_code_before_the_loop, w, x)
    with pytest.raises(flower.ExportError, match="before the loop"):
        flower.export(module, tmp_path / "app")
    assert not (tmp_path / "app").exists()


# --- per-client state: a carry placed at the clients (examples/scaffold.py) -------------


def _scaffold():
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[3] / "examples" / "scaffold.py"
    spec = importlib.util.spec_from_file_location("example_scaffold", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    args = example.make_example_args(N)
    return example, args, fcir.capture(example.make_program(N), *args)


def _state_nodes(root, args) -> dict:
    nodes = _nodes(root, args[2:])  # the clients' controls (initial state), x, y
    for cfg in nodes.values():
        cfg["state-dir"] = str(root / "state")
    return nodes


def _kept(root, partition: int) -> dict[int, np.ndarray]:
    """Round -> the control node ``partition`` keeps after it."""
    (folder,) = (root / "state").glob(f"*/partition-{partition}")
    out = {}
    for p in folder.glob("round-*.npz"):
        with np.load(p) as f:
            out[int(p.stem.removeprefix("round-"))] = f["arr_0"]
    return out


def test_per_client_state_stays_on_the_nodes_equals_the_reference_and_resumes(tmp_path, capsys):
    """SCAFFOLD in a lax.scan of 4 rounds, its carry holding each client's control
    (placed at the clients): the app's outputs are reference.run's; each node keeps its
    control after every round on disk (the plain-JAX loop's, by round) and never sends
    it; a run started again from the checkpoint after round 3 (another run id) reads
    the nodes' round-3 controls and writes the same bytes."""
    example, args, module = _scaffold()
    app = flower.export(module, tmp_path / "app", inputs=[np.asarray(a) for a in args[:2]])
    plan = rounds.plan_of(app)
    assert [s["leaf"] for s in plan["loop"]["client_state"]] == [2]
    (step,) = [s for s in plan["steps"] if s["kind"] == "exchange"]
    sent_back = {n for a in step["aggregations"] for n in a["inputs"]}
    assert step["state"] and step["state"][0]["output"].partition("/")[2] not in sent_back
    nodes = _state_nodes(tmp_path, args)
    ckpt, out = tmp_path / "ckpt", tmp_path / "o.npz"
    inprocess.run(app, nodes, {"output": str(out), "checkpoint-dir": str(ckpt)}, run_id=7)
    said = capsys.readouterr().out
    assert "round 4/4: 3/3 clients replied" in said and "client state of partition(s) 0,1,2" in said
    # 3 clients x (model delta f32[4], control delta f32[4], loss f32[]): no control.
    assert "received 108 B" in said, said
    got = files.read_outputs(out)
    _assert_same(got, rounds.module_reference_outputs(module, args))
    for i in range(N):
        kept = _kept(tmp_path, i)
        assert sorted(kept) == [1, 2, 3, 4]
        for r in (1, 4):  # the plain-JAX loop stopped after round r
            controls = _controls_after(example, args, r)
            np.testing.assert_allclose(kept[r], controls[i], rtol=1e-5, atol=1e-6)
    import shutil

    shutil.rmtree(ckpt / "4")
    for i in range(N):  # the nodes' round-4 state is gone too: round 4 must read round 3's
        next((tmp_path / "state").glob(f"*/partition-{i}/round-4.npz")).unlink()
    grid = inprocess.run(
        app, nodes, {"output": str(tmp_path / "p.npz"), "checkpoint-dir": str(ckpt)}, run_id=8
    )
    assert len(grid.sent) == N and "resuming after round 3" in capsys.readouterr().out
    assert [g.tobytes() for g in files.read_outputs(tmp_path / "p.npz")] == [
        g.tobytes() for g in got
    ]


def _controls_after(example, args, r: int):
    saved = example.ROUNDS
    example.ROUNDS = r
    try:
        return np.asarray(example.by_hand(*args)[3])
    finally:
        example.ROUNDS = saved


def test_a_node_that_missed_rounds_goes_on_from_the_last_round_it_took_part_in(tmp_path, capsys):
    """Two of three nodes sampled each round (clients=2), and node 0's reply of round 2
    lost after it ran (so it wrote a state of round 2 the server never counted): each
    node enters a round with its state of the last round the server counted for it
    (round 3: node 0's of round 1; node 1, first sampled in round 4: its initial one),
    and the outputs are the plain-JAX SCAFFOLD loop's with the same clients taking part
    each round (means over them, the others' controls unchanged)."""
    import random

    example, args, module = _scaffold()
    app = flower.export(module, tmp_path / "app", inputs=[np.asarray(a) for a in args[:2]])
    nodes = _state_nodes(tmp_path, args)
    config = {"output": str(tmp_path / "o.npz"), "clients": 2, "min-train-nodes": 1}
    inprocess.run(app, nodes, config, lost={40: {2}})
    # The ServerApp's sampling (server_app.sample): seeded by the round number.
    ids = sorted(nodes)
    sampled = [
        sorted(nodes[n]["partition-id"] for n in random.Random(r).sample(ids, 2))
        for r in range(1, example.ROUNDS + 1)
    ]
    assert sampled == [[0, 2], [0, 2], [0, 2], [0, 1]]  # node 1 misses 3 rounds, node 2 one
    counted = [[0, 2], [2], [0, 2], [0, 1]]
    said = capsys.readouterr().out
    lines = [line for line in said.splitlines() if line.startswith("[fcir] round ")]
    for r, who in enumerate(counted, 1):
        assert lines[r - 1].startswith(f"[fcir] round {r}/4: ")
        assert lines[r - 1].endswith(f"client state of partition(s) {','.join(map(str, who))}")
    assert "round 2/4: 1/2 clients replied" in said
    want = example.by_hand(*args, participation=counted)
    _assert_same(files.read_outputs(tmp_path / "o.npz"), [np.asarray(w) for w in want[:3]])
    for i, ran in enumerate(([1, 2, 3, 4], [4], [1, 2, 3])):  # the rounds each node ran
        kept = _kept(tmp_path, i)
        assert sorted(kept) == ran
        np.testing.assert_allclose(kept[ran[-1]], want[3][i], rtol=1e-5, atol=1e-6)


@fcir.program(placements={"clients": N})
def personal_two_exchanges(w, v, x):
    """A while_loop of rounds of two exchanges, each client's personal offset ``v`` a
    carry at the clients: the new ``v`` is computed in the first exchange, the second
    recomputes its client values from the ``v`` the round began with."""

    def body(c):
        w, v, i = c
        b = fcir.broadcast(w)
        mean = fcir.reduce_mean(
            fcir.map_fn(lambda w, v, x: jnp.mean(x, 0) - w + 0.1 * v, (b, v, x))
        )
        w2 = w + 0.5 * mean
        spread = fcir.reduce_mean(
            fcir.map_fn(lambda w, v, x: jnp.mean(jnp.square(x - w - v)), (fcir.broadcast(w2), v, x))
        )
        v = fcir.map_fn(lambda w, v, x: v - 0.3 * (v + w - jnp.mean(x, 0)), (b, v, x))
        return w2 + 0.01 * spread, v, i + 1

    w, v, i = jax.lax.while_loop(lambda c: c[2] < 3, body, (w, v, jnp.int32(0)))
    return w, i


@fcir.program(placements={"clients": N})
def stacks_a_client_value(w, v):
    def one_round(c, _):
        w, v = c
        v = fcir.map_fn(lambda w, v: v + w, (fcir.broadcast(w), v))
        return (w + fcir.reduce_mean(v), v), v

    return jax.lax.scan(one_round, (w, v), None, length=2)[0][0]


@fcir.program(placements={"clients": N}, private=True)
def private_state(w, v, key):
    def one_round(c, k):
        w, v = c
        v = fcir.map_fn(lambda w, v: 0.5 * v - w, (fcir.broadcast(w), v))
        return (w + fcir.dp_mean(v, 1.0, 1.0, k), v), None

    return jax.lax.scan(one_round, (w, v), jax.random.split(key, 2))[0][0]


def test_client_state_in_a_while_loop_of_two_exchange_rounds_and_what_is_refused(tmp_path):
    w, v = jnp.zeros(2, jnp.float32), jnp.zeros((N, 2), jnp.float32)
    x = jnp.asarray(np.random.default_rng(1).normal(size=(N, 4, 2)), jnp.float32)
    module = fcir.capture(personal_two_exchanges, w, v, x)
    app = flower.export(module, tmp_path / "app", inputs=[np.asarray(w)])
    plan = rounds.plan_of(app)
    exchanges = [s for s in plan["steps"] if s["kind"] == "exchange"]
    assert len(exchanges) == 2 and exchanges[0]["state"] and "state" not in exchanges[1]
    nodes = _nodes(tmp_path, [v, x])
    for cfg in nodes.values():
        cfg["state-dir"] = str(tmp_path / "state")
    grid = inprocess.run(app, nodes, {"output": str(tmp_path / "o.npz")})
    assert len(grid.sent) == 3 * 2 * N
    _assert_same(
        files.read_outputs(tmp_path / "o.npz"), rounds.module_reference_outputs(module, (w, v, x))
    )
    module = fcir.capture(stacks_a_client_value, w, v)
    with pytest.raises(flower.ExportError, match="stacked by a scan live at the server"):
        flower.export(module, tmp_path / "refused")
    module = fcir.capture(private_state, w, v, jax.random.key(0))
    with pytest.raises(flower.ExportError, match="per-client state .* in a private program"):
        flower.export(module, tmp_path / "refused")
    assert not (tmp_path / "refused").exists()


@fcir.program(placements={"clients": N})
def counts_at_the_clients(w, counts, x):
    """Each client's uint32 count (a carry at the clients) grows each round; the
    counts' secure sum is the round's ys."""

    def one_round(c, _):
        w, counts = c
        counts = fcir.map_fn(
            lambda w, c, x: c + (x.sum() > w).astype(jnp.uint32), (fcir.broadcast(w), counts, x)
        )
        m = fcir.reduce_mean(fcir.map_fn(lambda w, x: x.mean() - w, (fcir.broadcast(w), x)))
        return (w + m, counts), fcir.secure_sum(counts, bitwidth=32)

    (w, _), totals = jax.lax.scan(one_round, (w, counts), None, length=3)
    return w, totals


def test_client_state_beside_a_secure_sum_on_secagg_plus(tmp_path):
    """The exchange that computes the state runs through SecAgg+ (the ClientApp's
    secure handler keeps the state too): bit for bit the reference."""
    w, counts = jnp.float32(0.0), jnp.zeros((N,), jnp.uint32)
    x = jnp.asarray(np.random.default_rng(1).normal(size=(N, 4)), jnp.float32)
    module = fcir.capture(counts_at_the_clients, w, counts, x)
    app = flower.export(module, tmp_path / "app", inputs=[np.asarray(w)])
    nodes = _nodes(tmp_path, [counts, x])
    for cfg in nodes.values():
        cfg["state-dir"] = str(tmp_path / "state")
    inprocess.run(app, nodes, {"output": str(tmp_path / "o.npz")})
    got, want = (
        files.read_outputs(tmp_path / "o.npz"),
        rounds.module_reference_outputs(module, (w, counts, x)),
    )
    assert [g.tobytes() for g in got] == [v.tobytes() for v in want]
    assert int(want[1][-1]) > 0
