"""Two jax.distributed processes (4 CPU devices each, gloo) save and restore together;
one process with 8 devices, and one with 1, restore what they saved."""

from __future__ import annotations

import subprocess
import sys

import pytest
from ckpt_testing import HERE, child_env, free_port

pytestmark = pytest.mark.slow  # docs/contributing.md: left out of the fast tier

WORKER = str(HERE / "mp_worker.py")


def run_all(commands: list[tuple[list[str], dict[str, str]]], timeout: float) -> list[str]:
    procs = [
        subprocess.Popen(
            [sys.executable, *args],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for args, env in commands
    ]
    outputs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            outputs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, out in zip(procs, outputs):
        assert p.returncode == 0 and out.rstrip().endswith("OK"), out[-3000:]
    return outputs


def test_two_processes_save_then_restore_in_two_one_and_eight_device_processes(tmp_path):
    port = str(free_port())
    run_all(
        [([WORKER, "pair", str(tmp_path), port, str(i)], child_env(4)) for i in range(2)],
        timeout=150,
    )
    run_all(
        [
            ([WORKER, "single", str(tmp_path)], child_env(8)),
            ([WORKER, "single", str(tmp_path)], child_env(1)),
        ],
        timeout=120,
    )
