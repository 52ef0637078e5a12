"""bench/streaming.py --smoke runs end to end, so the benchmark cannot rot."""

from __future__ import annotations

import os

import benchrun
import pytest

pytestmark = pytest.mark.slow  # docs/contributing.md: left out of the fast tier


def test_streaming_benchmark_smoke_mode(tmp_path):
    # At LLVM -O0: its two gradient and DP memory workers were 40 of its 46 CPU s.
    out, data = benchrun.run_smoke("streaming", tmp_path, xla_flags=benchrun.CHEAP_CODEGEN)
    assert "fcir growth" in out and "fcir/drjax median" in out
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
    assert "Gradient and DP programs" in out
    rows = data["memory_rows"]
    assert set(rows) == set(data["results"])
    for n, row in rows.items():
        assert {"jax.grad(exe)", "exe of captured grad", "dp_mean round"} <= set(row), (n, row)
        assert all(m["temp_bytes"] > 0 for m in row.values()), (n, row)
