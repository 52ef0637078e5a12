"""bench/checkpoint.py --quick runs end to end, so the benchmark cannot rot."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from ckpt_testing import REPO, child_env

pytestmark = pytest.mark.slow  # docs/contributing.md: left out of the fast tier


def test_checkpoint_benchmark_quick_mode(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "bench" / "checkpoint.py"),
            "--quick",
            "--dir",
            str(tmp_path / "work"),
            "--results",
            str(tmp_path / "results"),
        ],
        env=child_env(8),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "save until committed: orbax / fcir" in done.stdout
    assert "cold restore onto the saved sharding: fcir / limit" in done.stdout
    (result,) = (tmp_path / "results").glob("checkpoint-quick-*.json")
    doc = json.loads(result.read_text())
    assert doc["cpu_count"] and doc["versions"]["jax"] and doc["versions"]["numpy"]
    assert doc["versions"]["jaxlib"] and doc["samples_s"]["fcir_save"]
    assert len(doc["figures"]) == 13
    assert "save until committed: fcir / dd oflag=direct" in done.stdout
    assert doc["samples_s"]["dd_direct"]
    assert all(share >= 0.99 for share in doc["cached_before_warm"])
    assert "peak extra host memory onto mesh (4,2) / restored" in done.stdout
    save = doc["figures"][0]
    assert save["per_repetition"] == [save["a"] / save["b"]]  # one repetition
    assert "A/B of each repetition" in done.stdout and "load average" in done.stdout
    assert doc["samples_s"]["limit_restore"] and doc["samples_s"]["limit_restore_cold"]
    # --first-restore's fresh-process restores, once: the first, then a later one.
    ratio = doc["first_restore"]["fcir"]["first_over_later"]
    assert "first / later" in done.stdout and len(ratio) == 1 and ratio[0] > 0
    # Each fcir save is split into phases, and every timed call started after an
    # untimed os.sync() (a quiet disk), whose durations are kept.
    phases = [
        doc["samples_s"][f"fcir_save_{k}"][0]
        for k in ("write", "fsync", "after_write", "before_write")
    ]
    assert all(p >= 0 for p in phases) and phases[0] <= doc["samples_s"]["fcir_save"][0]
    assert len(doc["presync_s"]) >= 10 and "untimed os.sync() before each timed call" in done.stdout
    assert "fcir save phases" in done.stdout
    assert "async save right after a busy step: blocking / whole" in done.stdout
    assert doc["samples_s"]["fcir_async_busy_blocking"] and doc["samples_s"]["fcir_async_total"]


def test_checkpoint_benchmark_s3_mode_against_a_local_server(tmp_path):
    import pytest

    try:
        import boto3  # noqa: F401
        import moto.server  # noqa: F401
    except ImportError:
        pytest.skip("moto[server] is not installed (the test extra has it): no local S3 server")
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "checkpoint.py"), "--s3", "--quick", "--reps", "1"],
        env=child_env(8),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "save fcir/limit" in done.stdout and "limit_get" in done.stdout


def test_device_checkpoint_benchmark_smoke_mode(tmp_path):
    """bench/checkpoint_device.py at a tiny model on the CPU: every contender saves and
    restores bit for bit, and the async save is timed under training steps."""
    import benchrun

    out, doc = benchrun.run_smoke("checkpoint_device", tmp_path)
    for line in ("save until committed: orbax / fcir", "cold restore: orbax / fcir",
                 "training step, async save in flight / none", "save: fcir-serial / fcir"):  # fmt: skip
        assert line in out
    samples = doc["samples_s"]
    for key in ("fcir_save", "fcir_serial_save", "orbax_save", "fcir_restore", "orbax_restore",
                "async_blocking", "step_during", "step_without", "fcir_save_write"):  # fmt: skip
        assert len(samples[key]) == 1 and samples[key][0] > 0, key
    assert doc["state_bytes"] > 0 and doc["versions"]["orbax-checkpoint"]
    assert samples["async_blocking"][0] <= samples["async_whole"][0]
