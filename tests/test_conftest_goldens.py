"""The golden-file bookkeeping of tests/conftest.py, run on a scratch copy of it."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys

import pytest

# The suite's own bookkeeping, no JAX; slow: fresh pytest processes, 13 s (docs/contributing.md).
pytestmark = [pytest.mark.jax_independent, pytest.mark.slow]

CONFTEST = pathlib.Path(__file__).parent / "conftest.py"


def _suite(tmp_path) -> pathlib.Path:
    tests = tmp_path / "tests"
    (tests / "golden").mkdir(parents=True)
    shutil.copy(CONFTEST, tests / "conftest.py")
    (tests / "golden" / "used.fcir").write_text("a\n")
    (tests / "golden" / "stale.fcir").write_text("b\n")
    (tests / "test_one.py").write_text("def test_compares(golden):\n    golden('used', 'a\\n')\n")
    return tests


def _pytest(tests, *flags):
    return subprocess.run(
        [sys.executable, "-m", "pytest", str(tests), "-p", "no:cacheprovider", *flags],
        capture_output=True,
        text=True,
        cwd=tests.parent,
        timeout=300,
    )


def test_collect_only_exits_0_while_a_full_run_fails_on_unused_goldens(tmp_path):
    tests = _suite(tmp_path)
    collected = _pytest(tests, "--collect-only", "-q")
    assert collected.returncode == 0, collected.stdout + collected.stderr
    assert "unused golden" not in collected.stdout
    run = _pytest(tests, "-q")
    assert run.returncode == 1, run.stdout + run.stderr
    assert "unused golden files (no test compares them): stale.fcir" in run.stdout


def test_under_xdist_the_controller_counts_every_workers_goldens(tmp_path):
    """With -n 2 each worker compares some goldens; the controller fails on the one
    no worker compared, not on those another worker did."""
    tests = _suite(tmp_path)
    (tests / "golden" / "other.fcir").write_text("c\n")
    (tests / "test_two.py").write_text("def test_compares(golden):\n    golden('other', 'c\\n')\n")
    run = _pytest(tests, "-q", "-n", "2", "--dist", "loadfile")
    assert run.returncode == 1, run.stdout + run.stderr
    assert "unused golden files (no test compares them): stale.fcir\n" in run.stdout, run.stdout
    (tests / "golden" / "stale.fcir").unlink()
    run = _pytest(tests, "-q", "-n", "2", "--dist", "loadfile")
    assert run.returncode == 0, run.stdout + run.stderr
