"""The exported Flower app's semantics without a network: its ServerApp ``main`` runs in
this process on a grid that hands each message to the app's ClientApp function
(tests/flowerlib/inprocess.py). What needs real processes is in test_flower.py."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from corpus.compare import assert_trees_match
from fcir.interpreters import flower, production, reference
from flowerlib import files, inprocess, programs, rounds, secure

import fcir

pytest.importorskip("flwr", reason="the Flower tests need flwr (pip install 'fcir[flower]')")


@pytest.fixture(scope="module")
def fedavg(tmp_path_factory):
    """fedavg_mlp on 3 clients, exported once, with each node's data file."""
    root = tmp_path_factory.mktemp("fedavg")
    r = rounds.corpus_round("fedavg_mlp")
    app = rounds.export(r, root / "app")
    plan = rounds.plan_of(app)
    nodes = {}
    for i in range(rounds.NODES):
        path = root / f"node{i}.npz"
        np.savez(path, *r.node_leaves(plan, i))
        nodes[101 + i] = {"partition-id": i, "data-path": str(path)}
    return r, app, nodes


def test_silent_and_failing_clients_are_left_out_down_to_the_minimum(fedavg, tmp_path):
    r, app, nodes = fedavg
    out = tmp_path / "out.npz"
    # One node never answers: the mean is over the two that did.
    inprocess.run(app, nodes, {"output": str(out), "timeout": 1.0}, silent={103})
    two = rounds.first_clients(r, 2)
    assert [g.tobytes() for g in files.read_outputs(out)] == [
        e.tobytes() for e in rounds.bundle_outputs(two, tmp_path / "b")
    ]
    assert_trees_match(files.read_outputs(out), rounds.reference_outputs(two), rtol=1e-5, atol=1e-5)
    # Below min-train-nodes the round fails, names each failure, and writes nothing.
    bad = dict(nodes)
    bad[103] = {**nodes[103], "data-path": str(tmp_path / "nowhere.npz")}
    out2 = tmp_path / "out2.npz"
    with pytest.raises(RuntimeError, match=r"2 of 3 sampled clients replied, min-train-nodes=3.*"
                       r"node 103 data-path: no such file"):
        inprocess.run(app, bad, {"output": str(out2), "min-train-nodes": 3})
    assert not out2.exists()


# Flower's defaults wait for 2 nodes: a run on one node says it wants one.
ONE_NODE = {"min-train-nodes": 1, "min-available-nodes": 1}


def test_bad_client_data_is_a_clear_error(fedavg, tmp_path):
    r, app, nodes = fedavg
    plan = rounds.plan_of(app)
    leaves = r.node_leaves(plan, 0)
    cases = {
        "short": (leaves[:-1], "holds 1 array(s); the round takes 2"),
        "shape": ([leaves[0][:-1], *leaves[1:]], "arr_0: needs an array of float32[3,4,8], got float32[2,4,8]"),
        "dtype": ([leaves[0].astype(np.float64), *leaves[1:]], "needs an array of float32"),
    }
    for name, (data, why) in cases.items():
        path = tmp_path / f"{name}.npz"
        np.savez(path, *data)
        bad = {101: {"partition-id": 0, "data-path": str(path)}}
        with pytest.raises(RuntimeError, match="0 of 1 sampled") as e:
            inprocess.run(app, bad, {"output": str(tmp_path / "o.npz"), **ONE_NODE})
        assert why in str(e.value), name


def test_sampling_takes_a_count_or_a_fraction_with_a_minimum(fedavg, tmp_path):
    _, app, nodes = fedavg
    # Flower's FedAvg: max(int(fraction-train * online), min-train-nodes), the minimum 2
    # by default; int() rounds 0.7 * 3 down to 2.
    cases = (
        ({"clients": 2}, 2),
        ({"fraction-train": 0.3}, 2),
        ({"fraction-train": 0.3, "min-train-nodes": 1}, 1),
        ({"fraction-train": 0.7, "min-train-nodes": 1}, 2),
    )
    for config, want in cases:
        grid = inprocess.run(app, nodes, {"num-server-rounds": 2, **config})
        assert len(grid.sent) == 2 * want, config
        assert set(grid.sent) <= set(nodes)


def test_training_maps_state_and_resumes_from_its_checkpoint(fedavg, tmp_path):
    r, app, nodes = fedavg
    n = len(r.server_leaves)
    state = ",".join(f"{i}={i}" for i in range(n))
    ckpt = tmp_path / "ckpt"
    base = {"state": state, "checkpoint-dir": str(ckpt), "output": str(tmp_path / "o.npz")}
    inprocess.run(app, nodes, {**base, "num-server-rounds": 2})
    assert sorted(p.name for p in ckpt.iterdir() if p.name.isdigit()) == ["1", "2"]
    grid = inprocess.run(app, nodes, {**base, "num-server-rounds": 3})  # resumes: one round more
    assert len(grid.sent) == rounds.NODES
    outs = rounds.bundle_rounds(r, tmp_path / "b", 3)
    got = files.read_outputs(tmp_path / "o.npz")
    assert [g.tobytes() for g in got] == [o.tobytes() for o in outs]
    with pytest.raises(RuntimeError, match="state='0=9'"):
        inprocess.run(app, nodes, {"state": "0=9"})


def test_app_directory_layout_and_cli(fedavg, tmp_path):
    from fcir.cli import main

    r, app, _ = fedavg
    files = sorted(p.relative_to(app).as_posix() for p in app.rglob("*") if p.is_file())
    assert files == [
        "fcir_app/__init__.py", "fcir_app/artifacts.json", "fcir_app/client_app.py",
        "fcir_app/evaluation.py", "fcir_app/inputs.json", "fcir_app/intrinsics.py",
        "fcir_app/partitions.py", "fcir_app/plan.json", "fcir_app/program.py", "fcir_app/runtime.py", "fcir_app/secagg.py",
        "fcir_app/server_app.py", "fcir_app/training.py", "pyproject.toml",
    ]
    # The ClientApp side never imports fcir: a device installs jax and flwr only. (The
    # runtime imports production's table from fcir only where the app's copy is absent,
    # inside fcir itself.)
    inside_fcir = "from fcir.interpreters.production import intrinsics"
    for name in ("client_app.py", "runtime.py", "secagg.py", "training.py", "program.py",
                 "evaluation.py", "partitions.py", "intrinsics.py"):
        text = (app / "fcir_app" / name).read_text().replace(inside_fcir, "")
        assert "fcir." not in text.replace("fcir.raw", ""), name
    np.savez(tmp_path / "in.npz", *r.server_leaves)
    src = tmp_path / "round.fcir"
    src.write_text(r.module.to_text(full_constants=True))
    code = main(["export", "--target", "flower", str(src), "-o", str(tmp_path / "cli_app"),
                 "--inputs", str(tmp_path / "in.npz")])
    assert code == 0
    assert json.loads((tmp_path / "cli_app/fcir_app/plan.json").read_text()) == rounds.plan_of(app)


def test_a_multi_exchange_round_runs_as_phases_and_matches_the_reference(tmp_path):
    scale = jnp.float32(2.0)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(rounds.NODES, 5, 4)), jnp.float32)
    module = fcir.capture(programs.mean_then_variance, scale, x)
    with pytest.raises(production.ExportError, match="more than one broadcast/aggregate"):
        production.export(module)
    app = flower.export(module, tmp_path / "app", inputs=[np.asarray(scale)])
    plan = rounds.plan_of(app)
    assert [s["kind"] for s in plan["steps"]] == ["server", "exchange", "server"] * 2
    nodes = {}
    for i in range(rounds.NODES):
        np.savez(tmp_path / f"n{i}.npz", np.asarray(x[i]))
        nodes[10 + i] = {"partition-id": i, "data-path": str(tmp_path / f"n{i}.npz")}
    grid = inprocess.run(app, nodes, {"output": str(tmp_path / "o.npz")})
    assert len(grid.sent) == 2 * rounds.NODES  # one message per node and exchange
    expected = [np.asarray(v) for v in jax.tree.leaves(reference.run(module, scale, x))]
    assert_trees_match(files.read_outputs(tmp_path / "o.npz"), expected, rtol=1e-5, atol=1e-6)


@fcir.program(placements={"clients": rounds.NODES})
def robust_round(w, x):
    upd = fcir.map_fn(lambda w, x: w * jnp.mean(x, axis=0), (fcir.broadcast(w), x))
    return {"median": fcir.reduce_median(upd), "trimmed": fcir.reduce_trimmed_mean(upd, trim=1)}


def test_median_and_trimmed_mean_are_aggregated_by_the_server_app(tmp_path):
    w = jnp.asarray([1.0, -2.0, 0.5, 3.0], jnp.float32)
    x = jnp.asarray(np.random.default_rng(1).normal(size=(rounds.NODES, 5, 4)), jnp.float32)
    module = fcir.capture(robust_round, w, x)
    app = flower.export(module, tmp_path / "app", inputs=[np.asarray(w)])
    (step,) = [s for s in rounds.plan_of(app)["steps"] if s["kind"] == "exchange"]
    ops = sorted((a["fed_op"], a.get("attrs", {})) for a in step["aggregations"])
    assert ops == [("fed.median", {}), ("fed.trimmed_mean", {"trim": 1})]
    nodes = {}
    for i in range(rounds.NODES):
        np.savez(tmp_path / f"n{i}.npz", np.asarray(x[i]))
        nodes[10 + i] = {"partition-id": i, "data-path": str(tmp_path / f"n{i}.npz")}
    inprocess.run(app, nodes, {"output": str(tmp_path / "o.npz")})
    expected = [np.asarray(v) for v in jax.tree.leaves(reference.run(module, w, x))]
    assert_trees_match(files.read_outputs(tmp_path / "o.npz"), expected, rtol=1e-6, atol=1e-6)


def test_not_exportable_rounds_fail_and_write_nothing(tmp_path):
    hier = rounds.corpus_module("hierarchical_fedavg")
    with pytest.raises(flower.ExportError, match="hierarch"):
        flower.export(hier, tmp_path / "app")
    r = rounds.corpus_round("fedavg_mlp")
    with pytest.raises(flower.ExportError, match="server input"):
        flower.export(r.module, tmp_path / "app", inputs=r.server_leaves[:-1])
    assert list(tmp_path.iterdir()) == []


@pytest.fixture(scope="module")
def secure_app(tmp_path_factory):
    """secure_mix exported for 3 clients, and data for 4 nodes."""
    root = tmp_path_factory.mktemp("secure")
    args = secure.make_args(rounds.NODES + 1)
    scale, *clients = args
    module = fcir.capture(secure.secure_mix, scale, *(a[: rounds.NODES] for a in clients))
    app = flower.export(module, root / "app", inputs=[scale])
    nodes = {}
    for i in range(rounds.NODES + 1):
        np.savez(root / f"n{i}.npz", *(a[i] for a in clients))
        nodes[20 + i] = {"partition-id": i, "data-path": str(root / f"n{i}.npz")}
    return args, app, nodes


def _reference_secure_mix(args, rows):
    scale, *clients = args
    module = fcir.capture(secure.secure_mix, scale, *(a[: rounds.NODES] for a in clients))
    module = rounds.rebind(module, len(rows))
    return [np.asarray(v) for v in jax.tree.leaves(reference.run(module, scale, *(a[rows] for a in clients)))]


def test_secure_sums_go_through_secagg_plus_exactly(secure_app, tmp_path):
    """Through SecAgg+ (4 stages) the secure sums equal the reference bit for bit, the
    mean too; with secagg=false one plain exchange gives the same outputs. A client
    that raises is left out (the sum of the survivors); a node that never answers
    makes Flower's SecAgg+ halt, and the exchange starts again without it."""
    args, app, all_nodes = secure_app
    nodes = {n: c for n, c in all_nodes.items() if c["partition-id"] < rounds.NODES}
    expected = _reference_secure_mix(args, [0, 1, 2])
    grid = inprocess.run(app, nodes, {"output": str(tmp_path / "a.npz")})
    assert len(grid.sent) == 4 * rounds.NODES  # setup, share keys, masked vectors, unmask
    secure.assert_matches(files.read_outputs(tmp_path / "a.npz"), expected)

    grid = inprocess.run(app, nodes, {"output": str(tmp_path / "b.npz"), "secagg": False})
    assert len(grid.sent) == rounds.NODES
    secure.assert_matches(files.read_outputs(tmp_path / "b.npz"), expected)

    bad = {**nodes, 21: {**nodes[21], "data-path": str(tmp_path / "nowhere.npz")}}
    inprocess.run(app, bad, {"output": str(tmp_path / "c.npz")})
    want = _reference_secure_mix(args, [0, 2])
    secure.assert_matches(files.read_outputs(tmp_path / "c.npz"), want)

    grid = inprocess.run(app, all_nodes, {"output": str(tmp_path / "d.npz"), "timeout": 1.0}, silent={21})
    assert grid.sent.count(21) == 1 and grid.sent.count(20) == 8  # 4 stages, twice
    want = _reference_secure_mix(args, [0, 2, 3])
    secure.assert_matches(files.read_outputs(tmp_path / "d.npz"), want)


def test_secagg_plus_needs_three_sampled_clients(secure_app, tmp_path):
    _, app, nodes = secure_app
    with pytest.raises(RuntimeError, match=r"SecAgg\+ needs 3\.\.\d+ sampled clients, got 2.*secagg=false"):
        inprocess.run(app, nodes, {"output": str(tmp_path / "o.npz"), "clients": 2})
    assert not (tmp_path / "o.npz").exists()


@pytest.mark.parametrize("dtype", ["int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64"])
def test_secure_sum_chunks_are_exact_for_every_bitwidth(dtype):
    """What SecAgg+ returns for 16-bit chunks (their mean, as floats) gives back the sum
    modulo 2**b for every b in [1, bits], negative values included, and k up to 1000."""
    from fcir.interpreters.flower.app import runtime

    info, bits = np.iinfo(dtype), np.dtype(dtype).itemsize * 8
    rng = np.random.default_rng(bits)
    for k in (3, 1000):
        xs = rng.integers(info.min, info.max, (k, 7), dtype=dtype, endpoint=True)
        xs[:, 0] = info.max
        xs[:, 1] = info.min
        total = [sum(int(v) for v in xs[:, i]) for i in range(xs.shape[1])]
        for b in range(1, bits + 1):
            mean = sum(runtime.to_chunks(x, b) for x in xs) / k
            got = runtime.from_chunk_sums(runtime.chunk_sums(mean, k), b, dtype)
            want = [t % 2**b for t in total]
            if b == bits and info.min < 0:  # a full-width signed sum wraps to signed
                want = [w - 2**b if w >= 2 ** (b - 1) else w for w in want]
            assert got.dtype == np.dtype(dtype) and [int(g) for g in got] == want, (k, b)


def test_rounds_without_state_map_outputs_of_the_same_pytree_path_and_say_so(fedavg, tmp_path, capsys):
    """fedavg_mlp's (params, x, y) -> (params, loss): without ``state`` two rounds feed
    the new params (same paths [0]['...'], same types) into round 2, exactly as the
    explicit mapping does, and the mapping used is printed."""
    r, app, nodes = fedavg
    n = len(r.server_leaves)
    inprocess.run(app, nodes, {"num-server-rounds": 2, "output": str(tmp_path / "inferred.npz")})
    said = capsys.readouterr().out
    explicit = ",".join(f"{i}={i}" for i in range(n))
    assert f"state {explicit} inferred from pytree paths: 0=0 ([0]" in said, said
    inprocess.run(app, nodes, {"num-server-rounds": 2, "state": explicit, "output": str(tmp_path / "explicit.npz")})
    inferred = files.read_outputs(tmp_path / "inferred.npz")
    given = files.read_outputs(tmp_path / "explicit.npz")
    assert [g.tobytes() for g in inferred] == [g.tobytes() for g in given]
    once = rounds.bundle_outputs(r, tmp_path / "b")
    assert inferred[0].tobytes() != once[0].tobytes()  # round 2 did not repeat round 1


@fcir.program(placements={"clients": rounds.NODES})
def renamed_round(w, x):
    """Returns the new model under a key of its own: no output has the path [0]."""
    mean = fcir.reduce_mean(fcir.map_fn(lambda w, x: w + jnp.mean(x, axis=0), (fcir.broadcast(w), x)))
    return {"model": mean}


def test_rounds_without_state_and_no_path_match_are_refused_naming_the_candidates(tmp_path):
    w = jnp.zeros(4, jnp.float32)
    x = jnp.asarray(np.random.default_rng(1).normal(size=(rounds.NODES, 5, 4)), jnp.float32)
    module = fcir.capture(renamed_round, w, x)
    app = flower.export(module, tmp_path / "app", inputs=[np.asarray(w)])
    nodes = {}
    for i in range(rounds.NODES):
        np.savez(tmp_path / f"n{i}.npz", np.asarray(x[i]))
        nodes[10 + i] = {"partition-id": i, "data-path": str(tmp_path / f"n{i}.npz")}
    with pytest.raises(RuntimeError, match=r"num-server-rounds=2 without a state mapping would run round 1 2 times") as e:
        inprocess.run(app, nodes, {"num-server-rounds": 2, "output": str(tmp_path / "o.npz")})
    assert "output arr_0 ['model'] (f32[4]) could feed server input arr_0 [0]" in str(e.value)
    assert 'state="0=0"' in str(e.value) and 'state="none"' in str(e.value)
    assert not (tmp_path / "o.npz").exists()
    # One round needs no mapping; state="none" repeats the round on purpose.
    inprocess.run(app, nodes, {"num-server-rounds": 1})
    grid = inprocess.run(app, nodes, {"num-server-rounds": 2, "state": "none"})
    assert len(grid.sent) == 2 * rounds.NODES


def test_export_hint_names_the_inferred_state(fedavg, tmp_path, capsys):
    from fcir.cli import main

    r, _, _ = fedavg
    np.savez(tmp_path / "in.npz", *r.server_leaves)
    src = tmp_path / "round.fcir"
    src.write_text(r.module.to_text(full_constants=True))
    assert main(["export", "--target", "flower", str(src), "-o", str(tmp_path / "app"),
                 "--inputs", str(tmp_path / "in.npz")]) == 0
    state = ",".join(f"{i}={i}" for i in range(len(r.server_leaves)))
    hint = capsys.readouterr().out
    assert f"local --stream --run-config 'num-server-rounds=3 state=\"{state}\"'" in hint
    assert "final_model.npz" in hint


def test_a_resumed_run_with_no_round_left_writes_outputs_in_their_declared_shapes(fedavg, tmp_path):
    r, app, nodes = fedavg
    base = {"checkpoint-dir": str(tmp_path / "ckpt"), "num-server-rounds": 2}
    inprocess.run(app, nodes, {**base, "output": str(tmp_path / "a.npz")})
    grid = inprocess.run(app, nodes, {**base, "output": str(tmp_path / "b.npz")})
    assert grid.sent == []  # nothing left to run
    first, resumed = files.read_outputs(tmp_path / "a.npz"), files.read_outputs(tmp_path / "b.npz")
    assert [(x.dtype, x.shape) for x in resumed] == [(x.dtype, x.shape) for x in first]
    assert any(x.shape == () for x in resumed)  # the loss
    assert [x.tobytes() for x in resumed] == [x.tobytes() for x in first]


def test_per_round_metrics_go_to_the_progress_line_a_metric_record_and_a_file(fedavg, tmp_path, capsys):
    """The loss (fedavg_mlp's output 4) of every round: on the progress line, in the
    ServerApp context's MetricRecord, and in run config metrics-file, which a resumed
    run extends; fcir flower plot draws it."""
    import re

    from fcir.cli import main

    r, app, nodes = fedavg
    metrics = tmp_path / "metrics.json"
    base = {"metrics-file": str(metrics), "checkpoint-dir": str(tmp_path / "ckpt")}
    inprocess.run(app, nodes, {**base, "num-server-rounds": 2})
    grid = inprocess.run(app, nodes, {**base, "num-server-rounds": 3})
    printed = [float(x) for x in re.findall(r"arr_4=([0-9.]+)", capsys.readouterr().out)]
    saved = json.loads(metrics.read_text())
    assert saved["round"] == [1, 2, 3] and len(saved["arr_4"]) == 3
    assert np.allclose(saved["arr_4"], printed, rtol=1e-5)
    assert saved["arr_4"][2] < saved["arr_4"][0]  # it trains
    record = grid.context.state["fcir.metrics"]
    assert list(record["round"]) == [1, 2, 3] and np.allclose(record["arr_4"], saved["arr_4"])
    assert main(["flower", "plot", str(metrics), "-o", str(tmp_path / "loss.png")]) == 0
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_messages_follow_flowers_layout(fedavg, tmp_path):
    """What a Flower user's own code reads: the server sends ``arrays`` and ``config``
    (``server-round``), a client replies with ``arrays`` and ``metrics``
    (``num-examples``: its rows); fcir's own keys sit in the ``fcir`` records."""
    r, app, nodes = fedavg
    grid = inprocess.run(app, nodes, {"num-server-rounds": 2, "output": str(tmp_path / "o.npz")})
    assert len(grid.exchanged) == 2 * rounds.NODES
    rows = r.node_leaves(rounds.plan_of(app), 0)[0].shape[0]
    for k, (msg, reply) in enumerate(grid.exchanged):
        assert set(msg.content.keys()) == {"arrays", "config", "fcir"}
        assert msg.content["config"]["server-round"] == 1 + k // rounds.NODES
        assert msg.content["fcir"]["step"] == 1  # the exchange between the two server parts
        assert set(reply.content.keys()) == {"arrays", "metrics", "fcir"}
        assert dict(reply.content["metrics"]) == {"num-examples": rows}
        assert reply.content["fcir"]["partition-id"] == nodes[msg.metadata.dst_node_id]["partition-id"]
        assert len(reply.content["arrays"]) > 0


def test_old_run_config_names_are_refused_naming_flowers(fedavg, tmp_path, capsys):
    from fcir.cli import main

    _, app, nodes = fedavg
    for old, new in (("rounds", "num-server-rounds"), ("fraction", "fraction-train"),
                     ("min-clients", "min-train-nodes")):
        with pytest.raises(RuntimeError, match=f"run config {old} is now {new}"):
            inprocess.run(app, nodes, {old: 1})
    # The commands refuse them before flwr run does (as a key pyproject.toml lacks).
    argv = ["flower", "simulate", str(app), "--nodes", "3", "--run-config", 'rounds=3 output="x"']
    assert main(argv) == 1
    assert "run config rounds is now num-server-rounds" in capsys.readouterr().err


def test_the_final_outputs_go_to_final_model_npz_unless_output_says_otherwise(fedavg, tmp_path):
    r, app, nodes = fedavg
    grid = inprocess.run(app, nodes, {})  # in the ServerApp's working directory
    assert grid.cwd_files == ["final_model.npz"]
    want = rounds.bundle_outputs(r, tmp_path / "b")
    assert [x.tobytes() for x in grid.final_model] == [x.tobytes() for x in want]
    grid = inprocess.run(app, nodes, {"output": str(tmp_path / "o.npz")})
    assert grid.final_model is None and (tmp_path / "o.npz").exists()
    grid = inprocess.run(app, nodes, {"output": "none"})
    assert grid.final_model is None and grid.cwd_files == []
