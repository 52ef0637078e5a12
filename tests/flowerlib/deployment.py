"""The module-scoped local deployment the Flower tests share, and running apps on it."""

from __future__ import annotations

import pathlib
import subprocess

from fcir.interpreters.flower.local import Deployment, env_for

from .rounds import NODES


def node_data(root, node: int, round_name: str) -> pathlib.Path:
    """Where node ``node`` reads ``round_name``'s data (its data-path is a template)."""
    return pathlib.Path(root) / f"node{node}" / f"{round_name}.npz"


def start(root) -> Deployment:
    root = pathlib.Path(root)
    for i in range(NODES):
        (root / f"node{i}").mkdir(parents=True, exist_ok=True)
    data = [root / f"node{i}" / "{round}.npz" for i in range(NODES)]
    return Deployment(root / "deployment", NODES, data).start()


def launch(dep: Deployment, appdir, run_config: str = "") -> subprocess.Popen:
    """``flwr run APPDIR local --stream`` in the background (runs share the deployment)."""
    return subprocess.Popen(
        dep.run_command(appdir, run_config),
        env=env_for(dep.cli_home),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def finish(proc: subprocess.Popen, timeout: float = 300) -> tuple[int, str]:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        raise AssertionError(f"flwr run did not finish in {timeout} s:\n{out[-3000:]}") from None
    return proc.returncode, out


def wait_for(cond, *, timeout: float, what: str) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.2)
