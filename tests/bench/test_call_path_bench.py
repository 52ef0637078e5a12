"""bench/call_path.py --smoke runs end to end (all three programs, rotating blocks, the
JSON record), so the call-path benchmark cannot rot."""

from __future__ import annotations

import os
import subprocess
import sys

import benchrun
import pytest

pytestmark = pytest.mark.slow  # docs/contributing.md: left out of the fast tier


def test_call_path_benchmark_smoke_mode(tmp_path):
    out, data = benchrun.run_smoke("call_path", tmp_path)
    assert "fcir/drjax" in out and "(goal <= 1.05)" in out
    assert data["smoke"] and data["cores"] == os.cpu_count() and len(data["load_average"]) == 2
    assert set(data["versions"]) >= {"jax", "jaxlib", "numpy", "drjax"}
    timing = data["timing"]
    reps = data["config"]["reps"]
    for samples in (timing["samples_s"], timing["cpu_samples_s"]):
        assert set(samples) == {"fcir", "drjax", "fcir_jit"}
        assert all(len(v) == reps and all(s > 0 for s in v) for v in samples.values())
    ratios = timing["fcir/drjax"]["ratios"]
    assert ratios == [a / b for a, b in zip(timing["samples_s"]["fcir"],
                                            timing["samples_s"]["drjax"])]  # fmt: skip


def test_call_path_benchmark_refuses_nonpositive_repetitions():
    result = subprocess.run(
        [sys.executable, str(benchrun.ROOT / "bench" / "call_path.py"), "--reps", "0"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 2 and "--reps and --calls must be positive" in result.stderr
