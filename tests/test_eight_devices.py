"""eight_devices.Child and its start in conftest.py, run on a scratch suite (copies of
both) whose child needs no JAX: the child starts in the background as soon as
collection ends (under pytest-xdist, once, on the worker that runs its file); its test
fails with the child's output when a test there fails; a deselected waiting test starts
no child."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

# The suite's own machinery, no JAX; slow: fresh pytest processes (docs/contributing.md).
pytestmark = [pytest.mark.jax_independent, pytest.mark.slow]

HERE = pathlib.Path(__file__).parent

SCRATCH = '''
import os, pathlib, time
import pytest
from eight_devices import Child, inside

HERE = pathlib.Path(__file__).resolve()
EIGHT_DEVICES = Child(HERE, "FCIR_SCRATCH_TESTS")
MARK = HERE.parent / "child-started"
INSIDE = inside("FCIR_SCRATCH_TESTS")


def test_a_main_process_test_before_the_waiting_one():
    """Runs before test_on_8_simulated_devices: the child is already running."""
    if INSIDE:
        return
    if os.environ.get("DESELECTED") == "1":
        assert not EIGHT_DEVICES.started, "a child started for a deselected test"
    if os.environ.get("WAIT") != "1":
        return
    deadline = time.monotonic() + 120
    while not MARK.exists():
        assert time.monotonic() < deadline, "no child started in the background"
        time.sleep(0.05)


def test_on_8_simulated_devices():
    if INSIDE:
        pytest.skip("this is the 8-device process")
    EIGHT_DEVICES.result()


def test_in_the_child():
    if not INSIDE:
        pytest.skip("runs in the 8-device process")
    with MARK.open("a") as f:  # one line per child run
        f.write("started\\n")
    assert "--xla_force_host_platform_device_count=8" in os.environ["XLA_FLAGS"]
    assert os.environ.get("FAIL") != "1", "told to fail"
'''


def _suite(tmp_path) -> pathlib.Path:
    tests = tmp_path / "tests"
    tests.mkdir()
    shutil.copy(HERE / "conftest.py", tests / "conftest.py")
    shutil.copy(HERE / "eight_devices.py", tests / "eight_devices.py")
    shutil.copy(HERE / "cheap_compile.py", tests / "cheap_compile.py")
    (tests / "test_scratch.py").write_text(SCRATCH)
    return tests


def _pytest(tests, *flags, **env):
    return subprocess.run(
        [sys.executable, "-m", "pytest", str(tests), "-p", "no:cacheprovider", "-q", *flags],
        capture_output=True,
        text=True,
        cwd=tests.parent,
        env={**os.environ, **env},
        timeout=300,
    )


def test_the_child_runs_in_the_background_and_its_failures_fail_its_test(tmp_path):
    tests = _suite(tmp_path)
    run = _pytest(tests, WAIT="1")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "2 passed, 1 skipped" in run.stdout, run.stdout

    (tests / "child-started").unlink()
    run = _pytest(tests, FAIL="1")
    assert run.returncode == 1, run.stdout + run.stderr
    assert "8-device tests failed" in run.stdout and "told to fail" in run.stdout, run.stdout


def test_a_deselected_waiting_test_starts_no_child(tmp_path):
    tests = _suite(tmp_path)
    run = _pytest(tests, "-k", "not on_8", DESELECTED="1")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "1 passed, 1 skipped, 1 deselected" in run.stdout, run.stdout
    assert not (tests / "child-started").exists()


def test_under_xdist_the_child_starts_once_ahead_of_its_test(tmp_path):
    """Every xdist worker collects every file; only the worker that runs the child's
    file starts it, at that file's first test, before the test waiting for it."""
    tests = _suite(tmp_path)
    # Another file keeps the second worker busy long enough to start a child of its own
    # if it wrongly did.
    (tests / "test_other.py").write_text("import time\n\ndef test_busy():\n    time.sleep(4)\n")
    run = _pytest(tests, "-n", "2", "--dist", "loadfile", WAIT="1")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "3 passed, 1 skipped" in run.stdout, run.stdout
    assert (tests / "child-started").read_text() == "started\n"
