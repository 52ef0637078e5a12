"""Kills a process with SIGKILL at a random moment while it saves checkpoints, then checks.

Used by test_kill.py (20 trials) and tools/ckpt_stress.py (as many as you like). A
child process saves steps 0, 1, 2, ... asynchronously with a CheckpointManager and
logs each step once `wait_until_finished()` says it is committed; the parent kills it
`delay` seconds after it is ready, then checks that every logged step restores
bit-exactly, that `latest_step()` names a complete checkpoint, and that nothing else
(no partial checkpoint, no temporary directory) is left once a manager has started.

Children are forked from a forkserver that has imported jax and fcir already, so a
trial costs its delay plus a fraction of a second rather than a fresh interpreter.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import pathlib
import signal
import time

import numpy as np
from fcir.checkpoint import commit

from fcir import checkpoint

LOG = "log.txt"
RUN = "run"


def expected(step: int) -> dict:
    """The host values of step `step` (distinct per step, per array and per element)."""
    rng = np.random.default_rng(1234)
    w = rng.standard_normal((256, 1024)).astype(np.float32)
    return {
        "params": {
            "w": w + np.float32(step),
            "b": np.arange(1024, dtype=np.float32) * step,
            "m": (w[:64, :512] * (step + 1)).astype(np.float16),
        },
        "host": {"n": np.arange(1000, dtype=np.int64) + step},
        "meta": {"step": step},
    }


def _device_tree(step: int) -> dict:
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    devices = jax.devices()
    mesh = jax.make_mesh((len(devices),), ("x",), devices=devices)
    want = expected(step)
    p = want["params"]
    return {
        "params": {
            "w": jax.device_put(p["w"], NamedSharding(mesh, P("x"))),
            "b": jax.device_put(p["b"], NamedSharding(mesh, P())),
            "m": jax.device_put(p["m"], NamedSharding(mesh, P(None, "x"))),
        },
        "host": want["host"],
        "meta": want["meta"],
    }


def _log(directory: pathlib.Path, line: str) -> None:
    # One write() per line: a kill never leaves half a line.
    fd = os.open(directory / LOG, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def child(directory: pathlib.Path) -> None:
    """Saves step after step until killed."""
    mgr = checkpoint.CheckpointManager(directory / RUN)
    trees = [_device_tree(s) for s in range(2)]  # device buffers for steps 0, 1: warm start
    _log(directory, "ready")
    step = 0
    while True:
        tree = trees[step] if step < len(trees) else _device_tree(step)
        mgr.save(step, tree)  # returns after the host copy
        mgr.wait_until_finished()
        _log(directory, f"committed {step}")
        step += 1


def _context() -> multiprocessing.context.BaseContext:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["jax", "numpy", "fcir.checkpoint", __name__])
    return ctx


@dataclasses.dataclass
class Outcome:
    delay: float
    committed: list[int]
    on_disk: list[int]
    killed_mid_save: bool  # the kill left a temporary directory behind


def run_trial(directory: pathlib.Path, delay: float, ready_timeout: float = 120.0) -> Outcome:
    """Starts a saving child, SIGKILLs it `delay` s after it is ready, and verifies."""
    directory.mkdir(parents=True, exist_ok=True)
    proc = _context().Process(target=child, args=(directory,))
    proc.start()
    try:
        deadline = time.monotonic() + ready_timeout
        while not (directory / LOG).exists() or "ready" not in (directory / LOG).read_text():
            if not proc.is_alive():
                raise AssertionError(
                    f"saving child died before it was ready (exit {proc.exitcode})"
                )
            if time.monotonic() > deadline:
                raise AssertionError("saving child did not get ready in time")
            time.sleep(0.01)
        time.sleep(delay)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
            proc.join()
    lines = (directory / LOG).read_text().splitlines()
    committed = [int(line.split()[1]) for line in lines if line.startswith("committed ")]
    mid_save = any(commit.is_leftover(p.name) for p in (directory / RUN).iterdir())
    on_disk = verify(directory / RUN, committed)
    return Outcome(delay, committed, on_disk, mid_save)


def same_bits(a: object, b: object) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def verify(run: pathlib.Path, committed: list[int]) -> list[int]:
    """Checks the state a killed saver left; returns the steps on disk."""
    mgr = checkpoint.CheckpointManager(run)  # removes leftovers of the killed save
    left = [p.name for p in run.iterdir() if commit.is_leftover(p.name)]
    assert not left, f"leftovers survived a new manager: {left}"
    steps = mgr.all_steps()
    missing = sorted(set(committed) - set(steps))
    assert not missing, f"committed steps {missing} are gone"
    in_flight = max(committed, default=-1) + 1
    unexpected = sorted(set(steps) - set(committed) - {in_flight})
    assert not unexpected, f"steps {unexpected} were never saved"
    assert mgr.latest_step() == (steps[-1] if steps else None)
    names = {p.name for p in run.iterdir()}
    assert names == {str(s) for s in steps}, f"unexpected entries {names}"
    for step in steps:
        got = checkpoint.restore(run / str(step))
        want = expected(step)
        for name in ("w", "b", "m"):
            assert same_bits(got["params"][name], want["params"][name]), (step, name)
        assert same_bits(got["host"]["n"], want["host"]["n"]) and got["meta"] == want["meta"]
    return steps
