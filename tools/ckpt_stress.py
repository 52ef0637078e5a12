"""Stress test of crash safety: SIGKILL a saving process at random moments, many times.

    python tools/ckpt_stress.py                   # 200 trials, delays uniform in [0, 1) s
    python tools/ckpt_stress.py --trials 1000 --max-delay 2 --parallel 2 --seed 7

Each trial starts a child that saves checkpoints asynchronously with a
CheckpointManager, kills it with SIGKILL after a random delay, and checks that every
checkpoint the child saw committed restores bit-exactly, that latest_step() names a
complete one, and that a new manager leaves no temporaries. The trial logic is
tests/checkpoint/kill_worker.py, which the test suite runs 20 times.
"""

from __future__ import annotations

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import argparse
import pathlib
import shutil
import sys
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "checkpoint")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=200)
    parser.add_argument("--max-delay", type=float, default=1.0, help="seconds (default 1)")
    parser.add_argument("--parallel", type=int, default=2, help="children at a time")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dir", help="work directory (default: a temporary one, removed)")
    parser.add_argument("--keep", action="store_true", help="keep the trials' directories")
    args = parser.parse_args(argv)

    import kill_worker  # after sys.path is set

    work = pathlib.Path(args.dir or tempfile.mkdtemp(prefix="fcir-ckpt-stress-"))
    delays = np.random.default_rng(args.seed).uniform(0.0, args.max_delay, args.trials)
    failures: list[str] = []
    mid_save = committed = 0
    start = time.monotonic()

    def trial(i: int) -> None:
        nonlocal mid_save, committed
        where = work / f"trial{i:05d}"
        try:
            outcome = kill_worker.run_trial(where, float(delays[i]))
        except Exception:  # noqa: BLE001 - every failure is recorded and reported
            failures.append(f"trial {i} (delay {delays[i]:.3f} s): {traceback.format_exc()}")
            print(f"trial {i}: FAILED", flush=True)
            return
        mid_save += outcome.killed_mid_save
        committed += len(outcome.committed)
        if not args.keep:
            shutil.rmtree(where, ignore_errors=True)
        if (i + 1) % 20 == 0:
            print(f"{i + 1}/{args.trials} trials, {time.monotonic() - start:.0f} s", flush=True)

    with ThreadPoolExecutor(args.parallel) as pool:
        list(pool.map(trial, range(args.trials)))
    print(
        f"{args.trials} trials: {len(failures)} failed; {mid_save} kills landed inside a save; "
        f"{committed} committed checkpoints checked bit-exactly"
    )
    for f in failures:
        print(f)
    if args.dir is None and not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
