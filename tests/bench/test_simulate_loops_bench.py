"""bench/simulate_loops.py --smoke runs end to end (xla.simulate's two loops, the
compiled round back to back and DrJAX's hand loop, one cohort's gather and transfer),
so the benchmark that says where simulate's time goes cannot rot; its ratios are the
samples'."""

from __future__ import annotations

import benchrun
import pytest

pytestmark = pytest.mark.slow  # docs/contributing.md: left out of the fast tier


def test_simulate_loops_benchmark_smoke_mode(tmp_path):
    out, data = benchrun.run_smoke("simulate_loops", tmp_path)
    cfg, seconds = data["config"], data["seconds"]
    assert set(seconds) == {"compiled", "host", "device", "drjax"}
    assert all(len(v) == cfg["reps"] and min(v) > 0 for v in seconds.values())
    ratios = data["ratios"]
    assert ratios["host/compiled"]["median"] == pytest.approx(
        seconds["host"][0] / seconds["compiled"][0]
    )
    rps = data["rounds_per_s"]
    assert ratios["device/drjax"]["median"] == pytest.approx(rps["device"][0] / rps["drjax"][0])
    parts = data["parts"]
    assert len(parts["gather_s"]) == len(parts["put_s"]) == 10 and parts["cohort_bytes"] > 0
    assert len(parts["population_put_s"]) == 10
    assert parts["population_bytes"] >= 12 * 20 * 32 * 32 * 3 * 4  # 12 clients' images
    assert "host/compiled (seconds)" in out and "gather" in out and "transfer" in out
    assert "as the device loop does at its first call" in out
