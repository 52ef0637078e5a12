"""bench/scale.py --smoke runs end to end (fresh processes, both sides, both forms of
the layer stack, the cost table), so the FAX-scale benchmark cannot rot."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_scale_benchmark_smoke_mode(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "scale.py"), "--smoke", "--out-dir", str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "fcir/drjax total" in result.stdout and "2NT/1024" in result.stdout
    (path,) = tmp_path.glob("scale-smoke-*.json")
    data = json.loads(path.read_text())
    assert data["smoke"] and data["cores"] == os.cpu_count() and len(data["load_average"]) == 2
    assert set(data["versions"]) >= {"jax", "jaxlib", "numpy", "drjax"}
    # Both forms of the layer stack: a Python loop (unrolled) and a lax.scan.
    assert set(data["lowering"]) == {"unrolled", "scan"}
    assert "layers as a Python loop (unrolled)" in result.stdout
    assert "layers as a lax.scan (scan)" in result.stdout
    for form in data["lowering"].values():
        samples = form["samples"]
        assert len(samples["fcir"]) == len(samples["drjax"]) == 1
        assert all(s["total_s"] > 0 for side in samples.values() for s in side)
    rows = {row["config"]: row for row in data["cost_table"]}
    assert set(rows) == {"350M", "1B", "8B"}
    for row in rows.values():
        # Tokens and 6NT follow from the sizes; XLA's count of the same round is close
        # to 6NT (attention and the optimizer add, the embedding gather has no matmul).
        assert row["tokens"] == row["clients"] * row["tokens_per_client"]
        assert row["flops_6nd"] == 6 * row["params"] * row["tokens"]
        assert 0.5 < row["flops_xla"] / row["flops_6nd"] < 2.0
    # The paper's figures are 2 N T / 1024 for its nominal sizes.
    assert abs(rows["8B"]["paper_2nd_over_1024"] / rows["8B"]["paper_flops"] - 1) < 1e-3
