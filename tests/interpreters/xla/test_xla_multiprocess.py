"""A FedAvg round compiled by the XLA backend runs on 2 processes × 4 CPU devices
(``jax.distributed`` on localhost, gloo collectives) and agrees with 1 process × 8.

Both runs use ``tests/multiprocess/fedavg_worker.py``: 16 clients sharded over a global
8-device ``clients`` mesh by ``xla.compile(module, mesh=...)``. The three processes run
at once; each has a deadline, and a hung one is killed so the test fails, not hangs.
"""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

pytestmark = pytest.mark.slow  # docs/contributing.md: left out of the fast tier

WORKER = pathlib.Path(__file__).resolve().parents[2] / "multiprocess" / "fedavg_worker.py"
DEADLINE_S = 150  # generous for a loaded 2-core machine; a normal run takes ~20 s


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(tmp_path, name: str, *flags: str) -> subprocess.Popen:
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # the worker sets its own device count
    env["JAX_PLATFORMS"] = "cpu"
    with open(tmp_path / f"{name}.log", "w") as log:  # the child keeps its own handle
        return subprocess.Popen(
            [sys.executable, str(WORKER), *flags],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=WORKER.parent,
        )


def wait_all(procs: dict, tmp_path) -> None:
    deadline = time.monotonic() + DEADLINE_S
    try:
        for proc in procs.values():
            proc.wait(timeout=max(deadline - time.monotonic(), 1))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    failed = {n: p.returncode for n, p in procs.items() if p.returncode != 0}
    if failed:
        logs = "\n".join(
            f"--- {n} (exit {rc}) ---\n{(tmp_path / f'{n}.log').read_text()[-3000:]}"
            for n, rc in failed.items()
        )
        pytest.fail(f"workers failed or timed out after {DEADLINE_S} s:\n{logs}")


def load(path):
    with np.load(path) as data:
        meta = json.loads(str(data["meta"]))
        leaves = [data[f"arr_{i}"] for i in range(len(data.files) - 1)]
    return leaves, meta


def test_two_processes_match_one_process(tmp_path):
    port = free_port()
    two, one = tmp_path / "two.npz", tmp_path / "one.npz"
    common = [
        "--num-processes",
        "2",
        "--local-devices",
        "4",
        "--coordinator",
        f"127.0.0.1:{port}",
        "--timeout",
        "60",
        "--out",
        str(two),
    ]
    procs = {
        "process0": launch(tmp_path, "process0", "--process-id", "0", *common),
        "process1": launch(tmp_path, "process1", "--process-id", "1", *common),
        "single": launch(tmp_path, "single", "--local-devices", "8", "--out", str(one)),
    }
    wait_all(procs, tmp_path)

    got, meta2 = load(two)
    want, meta1 = load(one)
    assert (meta2["process_count"], meta2["device_count"], meta2["local_device_count"]) == (2, 8, 4)
    assert (meta1["process_count"], meta1["device_count"]) == (1, 8)
    # Clients are sharded over all 8 devices: each process holds 4 of the 8 shards.
    assert meta2["client_data_spec"] == meta1["client_data_spec"] == "P('clients',)"
    assert meta2["client_shards_here"] == 4
    assert len(got) == len(want) == 5
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape
        # gloo's all-reduce adds the 8 devices' partial sums in another order than the
        # in-process one, so the mean can differ in the last bit.
        np.testing.assert_allclose(a, b, rtol=2e-6, atol=1e-7)
