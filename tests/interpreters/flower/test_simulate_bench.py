"""bench/simulate.py --smoke runs end to end with every system it finds (fcir with and
without clients_per_step, DrJAX, pfl when its virtualenv is there, the hand-written
Flower app and ``fcir flower simulate`` of the exported round on Flower's Simulation
Engine), so the simulate benchmark cannot rot. Here because it starts Flower
simulations (Ray): leg 2 only, and slow."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import benchrun
import pytest

pytestmark = pytest.mark.slow  # docs/contributing.md: left out of the fast tier

KEYS = ("fcir/pfl", "fcir/drjax", "fcir-flower/hand-flower")


def test_simulate_benchmark_smoke_mode(tmp_path):
    out, data = benchrun.run_smoke("simulate", tmp_path, timeout=1200)
    assert data["smoke"] and data["cores"] == os.cpu_count() and len(data["load_average"]) == 2
    assert set(data["versions"]) >= {"jax", "jaxlib", "numpy", "drjax", "flwr"}
    ran, skipped = set(data["systems"]), data["skipped"]
    # pfl runs where .venv-pfl holds it (bench/README.md), else it says why it did not.
    assert ran | set(skipped) == {"fcir", "fcir-k", "drjax", "pfl", "hand-flower", "fcir-flower"}
    assert ran >= {"fcir", "fcir-k", "drjax", "hand-flower", "fcir-flower"}, skipped
    assert "pfl" in ran or "pfl-python" in skipped["pfl"] or "venv-pfl" in skipped["pfl"]
    reps, rounds = data["config"]["reps"], data["config"]["rounds"]
    for name in ran:
        assert len(data["seconds"][name]) == reps and all(s > 0 for s in data["seconds"][name])
        assert data["rounds_per_s"][name] == [rounds / s for s in data["seconds"][name]]
    rps = data["rounds_per_s"]
    assert data["fcir/drjax"] == pytest.approx(rps["fcir"][0] / rps["drjax"][0])
    assert data["fcir-flower/hand-flower"] == pytest.approx(
        rps["fcir-flower"][0] / rps["hand-flower"][0]
    )
    for key in KEYS:
        if data[key] is not None:
            assert f"{key}: " in out and "(goal >= " in out
    assert "rounds/hour" in out and "load average:" in out


def test_simulate_benchmark_json_and_refusals(tmp_path):
    """--json writes the medians under the issue's keys; bad sizes and unknown systems
    are refused before anything is built."""
    script = str(benchrun.ROOT / "bench" / "simulate.py")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}

    def run(*args):
        return subprocess.run([sys.executable, script, *args], capture_output=True, text=True,
                              timeout=600, check=False, env=env)  # fmt: skip

    bad = run("--smoke", "--cohort", "50", "--clients", "10")
    assert bad.returncode == 2 and "at most the population" in bad.stderr
    bad = run("--smoke", "--systems", "fcir,tff")
    assert bad.returncode == 2 and "unknown systems ['tff']" in bad.stderr
    path = tmp_path / "medians.json"
    ok = run("--smoke", "--systems", "fcir,drjax", "--json", str(path), "--out-dir", str(tmp_path))
    assert ok.returncode == 0, ok.stderr[-3000:]
    data = json.loads(path.read_text())
    assert data["fcir/drjax"] > 0 and data["fcir/pfl"] is None
    assert data["fcir-flower/hand-flower"] is None
    assert data["fcir/drjax"] == data["ratios"]["fcir/drjax"]["median"]
