"""bench/streaming.py --smoke runs end to end, so the benchmark cannot rot."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_streaming_benchmark_smoke_mode(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "streaming.py"),
            "--smoke",
            "--out-dir",
            str(tmp_path),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "fcir growth" in result.stdout and "fcir/drjax median" in result.stdout
    (path,) = tmp_path.glob("streaming-smoke-*.json")
    data = json.loads(path.read_text())
    assert data["smoke"] and data["devices"] == 8 and data["cores"] == os.cpu_count()
    assert set(data["versions"]) >= {"jax", "jaxlib", "numpy", "drjax"}
    for n, row in data["results"].items():
        for which in ("fcir", "drjax"):
            r = row[which]
            assert r["ran"] and len(r["samples_s"]) == 1, (n, which, r)
            assert r["memory"]["peak_bytes"] > 0 and r["peak_rss_bytes"] > 0
    # The two rounds compute the same thing.
    assert data["pair"]["max_abs_diff"] < 1e-5
    # The gradient and DP rows: every program compiled at every cohort.
    assert "Gradient and DP programs" in result.stdout
    rows = data["memory_rows"]
    assert set(rows) == set(data["results"])
    for n, row in rows.items():
        assert {"jax.grad(exe)", "exe of captured grad", "dp_mean round"} <= set(row), (n, row)
        assert all(m["temp_bytes"] > 0 for m in row.values()), (n, row)
