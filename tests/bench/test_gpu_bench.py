"""bench/gpu.sh --smoke runs on the CPU at tiny sizes (the CIFAR-10 FedAvg table against
DrJAX, and the FAX-scale round's at a tiny model), so the GPU script is ready for the
day a GPU is lent."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import benchrun
import pytest

pytestmark = pytest.mark.slow  # docs/contributing.md: left out of the fast tier


def test_gpu_script_smoke_mode(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["OUT_DIR"] = str(tmp_path)
    env["PYTHON"] = sys.executable  # this test's Python, whatever python is on PATH (CI's leg 1)
    result = subprocess.run(["bash", str(benchrun.ROOT / "bench" / "gpu.sh"), "--smoke"],
                            capture_output=True, text=True, timeout=1200, check=False,
                            env=env)  # fmt: skip
    out = result.stdout
    assert result.returncode == 0, out[-3000:] + result.stderr[-3000:]
    assert "failed" not in out and "cut short" not in out
    assert out.count("fcir/drjax") >= 2 and "rounds/hour" in out and "fcir k=2" in out
    (sim,) = tmp_path.glob("simulate-smoke-*.json")
    (fax,) = tmp_path.glob("fax_round-smoke-*.json")
    assert json.loads(sim.read_text())["systems"] == ["fcir", "fcir-k", "drjax"]
    assert json.loads(fax.read_text())["fcir/drjax"]["median"] > 0
