"""Runs a ``bench/`` script as CI's smoke step does: in a fresh Python without the
inherited XLA_FLAGS (each benchmark sets its own device count), writing its JSON
record into a folder of the test's."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import cheap_compile

ROOT = pathlib.Path(__file__).resolve().parent.parent

# XLA_FLAGS for a smoke run whose checks hold however LLVM optimizes XLA:CPU's kernels
# (LLVM at -O0, as the 8-device children, tests/eight_devices.py): it proves that the
# script runs and records what it should, and what it compares (programs compiled alike,
# within a tolerance), XLA's memory analysis (buffer assignment is decided on the HLO:
# bench/streaming.py's gradient and DP rows have the same bytes at -O0, measured) and
# its flops are not the kernels' speed. A smoke run's timings say nothing either way.
CHEAP_CODEGEN = " ".join(cheap_compile.words(cheap_compile.LEVEL_0))


def run_smoke(
    name: str, out_dir, mode: str = "--smoke", timeout: float = 600, xla_flags: str = ""
) -> tuple[str, dict]:
    """``python bench/NAME.py MODE --out-dir OUT_DIR``; asserts that it exits 0 and
    returns its stdout and the one record it wrote (``NAME-<mode>-<time>.json``).
    ``xla_flags``: its XLA_FLAGS (``CHEAP_CODEGEN``), to which the script adds its
    device count."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    if xla_flags:
        env["XLA_FLAGS"] = xla_flags
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / f"{name}.py"), mode, "--out-dir", str(out_dir)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (path,) = pathlib.Path(out_dir).glob(f"{name}-{mode.lstrip('-')}-*.json")
    return result.stdout, json.loads(path.read_text())
