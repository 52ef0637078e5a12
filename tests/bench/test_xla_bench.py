"""bench/round.py --quick runs end to end (both parts), so the benchmark cannot rot."""

from __future__ import annotations

import os

import benchrun
import pytest

pytestmark = pytest.mark.slow  # docs/contributing.md: left out of the fast tier


def test_slow_round_benchmark_quick_mode(tmp_path):
    """Named "slow" so `-k "not slow"` skips it (about a minute and a half)."""
    # At LLVM -O0 (its multi-process workers set their own XLA_FLAGS, compiling as users do).
    out, data = benchrun.run_smoke("round", tmp_path, "--quick", xla_flags=benchrun.CHEAP_CODEGEN)
    assert "fcir/drjax" in out and "2x4/1x8" in out
    assert data["quick"] and data["devices"] == 8 and data["cores"] == os.cpu_count()
    assert set(data["versions"]) >= {"jax", "jaxlib", "numpy", "drjax"}
    row = data["single_process"]["8"]
    assert set(row["samples_s"]) == {"fcir", "drjax", "limit"}
    assert all(len(v) == 1 for v in row["samples_s"].values())
    # The three programs compute the same round.
    assert max(row["max_abs_diff_from_fcir"].values()) < 1e-5
    assert len(data["processes"]["samples_s"]["2x4"]) == 1
    # The call path: the executable, DrJAX's jit and fcir's jit, as users call them.
    assert "call path" in out
    calls = data["call_path"]
    assert {"tiny (8 clients, f32[4], 1 device)", "transformer, 8 clients, 8 devices"} <= set(calls)
    assert all(set(row["samples_s"]) == {"fcir", "drjax_jit", "fcir_jit"} for row in calls.values())
