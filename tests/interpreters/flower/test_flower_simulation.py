"""Exported apps on Flower's Simulation Engine (``fcir flower simulate``): a SuperLink in
simulation mode and Ray actors instead of SuperNode processes. One run costs ~20 s here
(Ray's start-up, then jax in each actor). A simulation bit for bit as run_bundle, quiet,
with nothing left running, is docs/flower.md's own command in test_flower_doc_commands.py."""

from __future__ import annotations

import subprocess

import pytest
from flowerlib import files, rounds, simulation

pytestmark = pytest.mark.slow  # docs/contributing.md: left out of the fast tier

pytest.importorskip("flwr", reason="the Flower tests need flwr (pip install 'fcir[flower]')")
pytest.importorskip("ray", reason="the Simulation Engine needs ray (pip install 'fcir[flower]')")


@pytest.fixture(scope="module")
def fedavg(tmp_path_factory):
    root = tmp_path_factory.mktemp("sim")
    return simulation.stage("fedavg_mlp", root / "app", root / "data")


def _simulate(app, data, config, root, cwd=None):
    cmd = simulation.command(app, data, config, root)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=cwd)


def _started_under(root) -> list[int]:
    from fcir.interpreters.flower.simulation import _pids_with_home_under

    return _pids_with_home_under(root.resolve())


def test_a_failing_serverapp_fails_the_simulation_with_its_error(fedavg, tmp_path):
    _, app, data = fedavg
    proc = _simulate(app, data, 'state="0=9"', tmp_path / "sim")
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "finished: failed (" in proc.stderr and "state='0=9'" in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert _started_under(tmp_path / "sim") == []


def test_simulate_usage_errors(fedavg, tmp_path):
    from fcir.cli import main

    _, app, data = fedavg
    assert main(["flower", "simulate", str(app), "--nodes", "4", "--data", str(data)]) == 1
    assert main(["flower", "simulate", str(tmp_path), "--nodes", "1"]) == 1


def test_a_scan_of_rounds_program_on_the_simulation_engine_writes_the_programs_results(tmp_path):
    """scan_rounds exported whole: on virtual nodes (Ray actors) one Flower round per
    iteration, the output file reference.run's results, checkpoints each round."""
    from corpus.compare import assert_trees_match

    r, app, data = simulation.stage("scan_rounds", tmp_path / "app", tmp_path / "data")
    out, ckpt = tmp_path / "out.npz", tmp_path / "ckpt"
    proc = _simulate(app, data, f'output="{out}" checkpoint-dir="{ckpt}"', tmp_path / "sim")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "round 3/3: 3/3 clients replied" in proc.stdout, proc.stdout[-3000:]
    got, want = files.read_outputs(out), rounds.reference_outputs(r)
    assert [(g.dtype, g.shape) for g in got] == [(w.dtype, w.shape) for w in want]
    assert_trees_match(got, want, rtol=1e-5, atol=1e-6)
    assert sorted(p.name for p in ckpt.iterdir() if p.name.isdigit()) == ["2", "3"]
    assert _started_under(tmp_path / "sim") == []


def test_sigterm_stops_the_simulation_and_everything_it_started(fedavg, tmp_path):
    import signal

    _, app, data = fedavg
    root = tmp_path / "sim"
    cmd = simulation.command(app, data, "num-server-rounds=50", root)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in proc.stdout:
            if "round 1/50" in line:
                break
        assert _started_under(root), "the simulation started nothing"
        proc.send_signal(signal.SIGTERM)
        rest = proc.communicate(timeout=60)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 1 and "stopped by signal" in rest, rest[-2000:]
    assert _started_under(root) == []
