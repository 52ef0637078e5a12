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
from flowerlib import inprocess, rounds

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


def _outputs(path) -> list:
    with np.load(path) as f:
        return [f[f"arr_{i}"] for i in range(len(f.files))]


def test_silent_and_failing_clients_are_left_out_down_to_the_minimum(fedavg, tmp_path):
    r, app, nodes = fedavg
    out = tmp_path / "out.npz"
    # One node never answers: the mean is over the two that did.
    inprocess.run(app, nodes, {"output": str(out), "timeout": 1.0}, silent={103})
    two = rounds.first_clients(r, 2)
    assert [g.tobytes() for g in _outputs(out)] == [
        e.tobytes() for e in rounds.bundle_outputs(two, tmp_path / "b")
    ]
    assert_trees_match(_outputs(out), rounds.reference_outputs(two), rtol=1e-5, atol=1e-5)
    # Below min-clients the round fails, names each failure, and writes nothing.
    bad = dict(nodes)
    bad[103] = {**nodes[103], "data-path": str(tmp_path / "nowhere.npz")}
    out2 = tmp_path / "out2.npz"
    with pytest.raises(RuntimeError, match=r"2 of 3 sampled clients replied, min-clients=3.*"
                       r"node 103 data-path: no such file"):
        inprocess.run(app, bad, {"output": str(out2), "min-clients": 3})
    assert not out2.exists()


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
            inprocess.run(app, bad, {"output": str(tmp_path / "o.npz")})
        assert why in str(e.value), name


def test_sampling_takes_a_count_or_a_fraction_with_a_minimum(fedavg, tmp_path):
    _, app, nodes = fedavg
    for config, want in (({"clients": 2}, 2), ({"fraction": 0.3}, 1), ({"fraction": 0.3, "min-clients": 2}, 2)):
        grid = inprocess.run(app, nodes, {"rounds": 2, **config})
        assert len(grid.sent) == 2 * want, config
        assert set(grid.sent) <= set(nodes)


def test_training_maps_state_and_resumes_from_its_checkpoint(fedavg, tmp_path):
    r, app, nodes = fedavg
    n = len(r.server_leaves)
    state = ",".join(f"{i}={i}" for i in range(n))
    ckpt = tmp_path / "ckpt"
    base = {"state": state, "checkpoint-dir": str(ckpt), "output": str(tmp_path / "o.npz")}
    inprocess.run(app, nodes, {**base, "rounds": 2})
    assert sorted(p.name for p in ckpt.iterdir() if p.name.isdigit()) == ["1", "2"]
    grid = inprocess.run(app, nodes, {**base, "rounds": 3})  # resumes: one round more
    assert len(grid.sent) == rounds.NODES
    leaves = list(r.leaves)
    server = [i for i, c in enumerate(r.is_client) if not c]
    for k in range(3):
        outs = rounds.bundle_outputs(rounds.dataclasses.replace(r, leaves=leaves), tmp_path / f"b{k}")
        for j, i in enumerate(server):
            leaves[i] = outs[j]
    assert [g.tobytes() for g in _outputs(tmp_path / "o.npz")] == [o.tobytes() for o in outs]
    with pytest.raises(RuntimeError, match="state='0=9'"):
        inprocess.run(app, nodes, {"state": "0=9"})


def test_app_directory_layout_and_cli(fedavg, tmp_path):
    from fcir.cli import main

    r, app, _ = fedavg
    files = sorted(p.relative_to(app).as_posix() for p in app.rglob("*") if p.is_file())
    assert files == [
        "fcir_app/__init__.py", "fcir_app/artifacts.json", "fcir_app/client_app.py",
        "fcir_app/inputs.json", "fcir_app/plan.json", "fcir_app/runtime.py",
        "fcir_app/server_app.py", "pyproject.toml",
    ]
    # The ClientApp side never imports fcir: a device installs jax and flwr only.
    for name in ("client_app.py", "runtime.py"):
        assert "fcir." not in (app / "fcir_app" / name).read_text().replace("fcir.raw", "")
    np.savez(tmp_path / "in.npz", *r.server_leaves)
    src = tmp_path / "round.fcir"
    src.write_text(r.module.to_text(full_constants=True))
    code = main(["export", "--target", "flower", str(src), "-o", str(tmp_path / "cli_app"),
                 "--inputs", str(tmp_path / "in.npz")])
    assert code == 0
    assert json.loads((tmp_path / "cli_app/fcir_app/plan.json").read_text()) == rounds.plan_of(app)


@fcir.program(placements={"clients": rounds.NODES})
def mean_then_variance(scale, x):
    """Two exchanges: the mean is broadcast back to compute the variance around it."""
    mean = fcir.reduce_mean(
        fcir.map_fn(lambda s, x: s * jnp.mean(x, axis=0), (fcir.broadcast(scale), x))
    )
    var = fcir.reduce_mean(
        fcir.map_fn(lambda m, x: jnp.mean(jnp.square(x - m), axis=0), (fcir.broadcast(mean), x))
    )
    return {"mean": mean, "spread": jnp.sqrt(var) * scale, "var": var}


def test_a_multi_exchange_round_runs_as_phases_and_matches_the_reference(tmp_path):
    scale = jnp.float32(2.0)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(rounds.NODES, 5, 4)), jnp.float32)
    module = fcir.capture(mean_then_variance, scale, x)
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
    assert_trees_match(_outputs(tmp_path / "o.npz"), expected, rtol=1e-5, atol=1e-6)


def test_not_exportable_rounds_fail_and_write_nothing(tmp_path):
    hier = rounds.corpus_module("hierarchical_fedavg")
    with pytest.raises(flower.ExportError, match="hierarch"):
        flower.export(hier, tmp_path / "app")
    r = rounds.corpus_round("fedavg_mlp")
    with pytest.raises(flower.ExportError, match="server input"):
        flower.export(r.module, tmp_path / "app", inputs=r.server_leaves[:-1])
    assert list(tmp_path.iterdir()) == []
