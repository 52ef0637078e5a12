"""Exported rounds on a real Flower deployment: one SuperLink and 3 SuperNodes on
localhost (separate processes, free ports, own FLWR_HOME each), started once for the
module and stopped by PID.

Flower polls every 3 s and every message starts a fresh ClientApp process (jax import,
artifact compile), so a run costs 15-30 s here however small the round. The SuperLink
of flwr 1.42 does not run two apps side by side reliably (concurrent runs fail with
"task-token authentication failed"), so runs go one after another; the deployment is
shared (each node's data-path is a template, ``node<i>/{round}.npz``), and semantics
that need no network (minimum participation, bad data shapes, state mapping) are
tested in-process by test_flower_app.py.
"""

from __future__ import annotations

import dataclasses
import pathlib

import numpy as np
import pytest
from corpus.compare import assert_trees_match
from flowerlib import deployment, rounds
from flowerlib.rounds import NODES

pytest.importorskip("flwr", reason="the Flower tests need flwr (pip install 'fcir[flower]')")

CORPUS = ("fedavg_mlp", "fedavg_weighted", "minmax_agg", "bf16_client", "secure_histogram")


@pytest.fixture(scope="module")
def dep(tmp_path_factory):
    d = deployment.start(tmp_path_factory.mktemp("flower"))
    try:
        yield d
    finally:
        d.stop()


def _outputs(path) -> list:
    with np.load(path) as f:
        return [f[f"arr_{i}"] for i in range(len(f.files))]


def _renamed(r: rounds.Round, name: str) -> rounds.Round:
    return dataclasses.replace(r, name=name, module=dataclasses.replace(r.module, name=name))


def _stage(r: rounds.Round, root, dep) -> pathlib.Path:
    app = rounds.export(r, pathlib.Path(root) / "apps" / r.name)
    plan = rounds.plan_of(app)
    for i in range(NODES):
        np.savez(deployment.node_data(dep.root.parent, i, r.name), *r.node_leaves(plan, i))
    return app


def test_corpus_rounds_and_failing_clients(dep, tmp_path):
    """Corpus rounds equal run_bundle bit for bit and the reference within 1e-5; a
    round whose third client raises (its data file is missing) completes with the
    other two, equal to both on those two clients only."""
    runs = {}
    for name in CORPUS:
        r = rounds.corpus_round(name)
        runs[name] = (r, _stage(r, tmp_path, dep), "")
    base = rounds.corpus_round("fedavg_mlp")
    missing = _renamed(base, "fedavg_missing")
    runs[missing.name] = (missing, _stage(missing, tmp_path, dep), "min-clients=2")
    deployment.node_data(dep.root.parent, 2, missing.name).unlink()

    results = {}
    for key, (_, app, config) in runs.items():
        out = tmp_path / f"{key}.out.npz"
        results[key] = deployment.finish(deployment.launch(dep, app, f'output="{out}" {config}'))

    for name in CORPUS:
        code, log = results[name]
        assert code == 0, log[-3000:]
        assert "3/3 clients replied" in log, log[-3000:]
        r = runs[name][0]
        got = _outputs(tmp_path / f"{name}.out.npz")
        bundle = rounds.bundle_outputs(r, tmp_path / "bundles" / name)
        assert len(got) == len(bundle)
        for g, b in zip(got, bundle):
            assert g.dtype == b.dtype and g.shape == b.shape, name
            assert g.tobytes() == b.tobytes(), f"{name}: not bit-for-bit run_bundle"
        assert_trees_match(got, rounds.reference_outputs(r), rtol=1e-5, atol=1e-5)

    two = rounds.first_clients(base, 2)
    expected = rounds.bundle_outputs(two, tmp_path / "bundles" / "two")
    code, log = results[missing.name]
    assert code == 0, log[-3000:]
    assert "2/3 clients replied" in log and "data-path: no such file" in log, log[-3000:]
    got = _outputs(tmp_path / f"{missing.name}.out.npz")
    assert [g.tobytes() for g in got] == [e.tobytes() for e in expected]
    assert_trees_match(got, rounds.reference_outputs(two), rtol=1e-5, atol=1e-5)


def test_training_resumes_after_the_superlink_is_killed(dep, tmp_path):
    """3 rounds of FedAvg with state mapping and checkpoints: the SuperLink is killed
    (SIGKILL) after round 1 is checkpointed, restarted, and the run started again
    finishes from round 2 with the result of 3 uninterrupted rounds."""
    r = _renamed(rounds.corpus_round("fedavg_mlp"), "fedavg_train")
    app = _stage(r, tmp_path, dep)
    n_state = len(r.server_leaves)
    state = ",".join(f"{i}={i}" for i in range(n_state))
    ckpt = tmp_path / "ckpt"
    config = f'rounds=3 state="{state}" checkpoint-dir="{ckpt}" output="{tmp_path}/out.npz"'
    proc = deployment.launch(dep, app, config)
    try:
        deployment.wait_for(
            lambda: (ckpt / "1").is_dir() or proc.poll() is not None,
            timeout=240,
            what="round 1's checkpoint",
        )
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        dep.kill_one("superlink")
    finally:
        proc.kill()
        proc.communicate()
    assert not (tmp_path / "out.npz").exists()
    dep.restart()
    code, log = deployment.finish(deployment.launch(dep, app, config))
    assert code == 0, log[-3000:]
    assert "resuming after round" in log and "round 3/3" in log, log[-3000:]
    assert "round 1/3" not in log, log[-3000:]

    leaves = list(r.leaves)
    server = [i for i, c in enumerate(r.is_client) if not c]
    for _ in range(3):
        outs = rounds.bundle_outputs(dataclasses.replace(r, leaves=leaves), tmp_path / "b")
        for k, i in enumerate(server):
            leaves[i] = outs[k]
    got = _outputs(tmp_path / "out.npz")
    assert [g.tobytes() for g in got] == [o.tobytes() for o in outs]
