"""bench/round.py --quick runs end to end (both parts), so the benchmark cannot rot."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_slow_round_benchmark_quick_mode(tmp_path):
    """Named "slow" so `-k "not slow"` skips it (about a minute and a half)."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "round.py"), "--quick", "--out-dir", str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "fcir/drjax" in result.stdout and "2x4/1x8" in result.stdout
    (path,) = tmp_path.glob("round-quick-*.json")
    data = json.loads(path.read_text())
    assert data["quick"] and data["devices"] == 8 and data["cores"] == os.cpu_count()
    assert set(data["versions"]) >= {"jax", "jaxlib", "numpy", "drjax"}
    row = data["single_process"]["8"]
    assert set(row["samples_s"]) == {"fcir", "drjax", "limit"}
    assert all(len(v) == 1 for v in row["samples_s"].values())
    # The three programs compute the same round.
    assert max(row["max_abs_diff_from_fcir"].values()) < 1e-5
    assert len(data["processes"]["samples_s"]["2x4"]) == 1
    # The call path: the executable, DrJAX's jit and fcir's jit, as users call them.
    assert "call path" in result.stdout
    calls = data["call_path"]
    assert {"tiny (8 clients, f32[4], 1 device)", "transformer, 8 clients, 8 devices"} <= set(calls)
    assert all(set(row["samples_s"]) == {"fcir", "drjax_jit", "fcir_jit"} for row in calls.values())
