"""Runs a ``bench/`` script as CI's smoke step does: in a fresh Python without the
inherited XLA_FLAGS (each benchmark sets its own device count), writing its JSON
record into a folder of the test's."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def run_smoke(name: str, out_dir, mode: str = "--smoke", timeout: float = 600) -> tuple[str, dict]:
    """``python bench/NAME.py MODE --out-dir OUT_DIR``; asserts that it exits 0 and
    returns its stdout and the one record it wrote (``NAME-<mode>-<time>.json``)."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
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
