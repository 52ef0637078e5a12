"""Running a test file's mesh tests in a fresh pytest process with 8 simulated CPU devices.

JAX fixes the number of CPU devices when it starts, so a file whose tests need a mesh of
8 has one test in this process that runs the file again in a child process started with
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` and an environment flag the file
reads (``inside(flag)``) to tell which process it is in.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys


def inside(flag: str) -> bool:
    """Whether this is the 8-device child process of a file using ``flag``."""
    return os.environ.get(flag) == "1"


def run_on_8_devices(test_file: str | os.PathLike, flag: str, *pytest_args: str) -> str:
    """Runs ``test_file`` with pytest in a child with 8 CPU devices and ``flag`` set;
    fails (with the ends of its output) unless every selected test passed. Returns the
    child's stdout."""
    path = pathlib.Path(test_file).resolve()
    env = dict(os.environ, **{flag: "1"})
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()
    cmd = [sys.executable, "-m", "pytest", str(path), "-q", "-p", "no:cacheprovider"]
    cmd += pytest_args
    result = subprocess.run(
        cmd,
        env=env,
        cwd=path.parent.parent,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert result.returncode == 0, (
        f"8-device tests failed ({' '.join(cmd)}):\n{result.stdout[-6000:]}\n"
        f"{result.stderr[-2000:]}"
    )
    return result.stdout
