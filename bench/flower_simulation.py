"""Wall times of exported apps on Flower's Simulation Engine against a local deployment,
and of a whole training program (a scan of rounds) against reference.run.

    python bench/flower_simulation.py [--reps 2]

1. ``fedavg_mlp`` of tests/corpus, 3 rounds on 3 nodes (state inferred):
   - ``simulate``: ``fcir flower simulate APP --nodes 3 --data DIR`` from start to exit
     (its SuperLink's and Ray's start-up and shutdown included);
   - ``deployment``: ``flwr run APP local --stream`` on a SuperLink and 3 SuperNodes
     started once beforehand (their start-up reported apart);
   and whether both wrote the same bytes.
2. ``scan_rounds`` of tests/corpus (3 rounds in a lax.scan): its exported app on the
   Simulation Engine (as above) against ``reference.run`` of the program (first call,
   then a second call), and whether the outputs agree within 1e-5.

Each figure is one run per repetition; the load (``uptime``) before and after is
printed, since the machine may be shared.
"""

from __future__ import annotations

import argparse
import pathlib
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def stage(name: str, root: pathlib.Path):
    from flowerlib import simulation

    return simulation.stage(name, root / f"{name}-app", root / f"{name}-data")


def simulate(app, data, config: str, root) -> float:
    from flowerlib import simulation

    cmd = simulation.command(app, data, config, root)
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    wall = time.perf_counter() - t
    if proc.returncode != 0:
        raise SystemExit(proc.stdout[-3000:] + proc.stderr[-3000:])
    return wall


def main() -> None:
    from fcir.interpreters import reference
    from fcir.interpreters.flower.local import Deployment
    from flowerlib import files

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=2)
    a = ap.parse_args()
    root = pathlib.Path(tempfile.mkdtemp(prefix="fcir-bench-sim-"))
    print("before:", uptime())
    r, app, data = stage("fedavg_mlp", root)
    sim, dep_t = [], []
    t = time.perf_counter()
    dep = Deployment(root / "dep", 3, [data / f"node{i}.npz" for i in range(3)]).start()
    dep_start = time.perf_counter() - t
    try:
        for k in range(a.reps):
            out = root / f"sim{k}.npz"
            sim.append(simulate(app, data, f'num-server-rounds=3 output="{out}"', root / f"sim{k}"))
            out2 = root / f"dep{k}.npz"
            t = time.perf_counter()
            proc = dep.run(app, f'num-server-rounds=3 output="{out2}"', timeout=600)
            dep_t.append(time.perf_counter() - t)
            if proc.returncode != 0 or not out2.exists():
                raise SystemExit(proc.stdout[-3000:])
            by_sim, by_dep = files.read_outputs(out), files.read_outputs(out2)
            same = [x.tobytes() for x in by_sim] == [x.tobytes() for x in by_dep]
            print(
                f"rep {k}: simulate {sim[-1]:.1f} s, deployment flwr run {dep_t[-1]:.1f} s, "
                f"same bytes: {same}",
                flush=True,
            )
    finally:
        dep.stop()
    print(
        f"fedavg_mlp, 3 rounds, 3 nodes: simulate {min(sim):.1f}-{max(sim):.1f} s; "
        f"deployment {min(dep_t):.1f}-{max(dep_t):.1f} s (+ {dep_start:.1f} s to start it)"
    )

    r, app, data = stage("scan_rounds", root)
    sims = []
    for k in range(a.reps):
        out = root / f"scan{k}.npz"
        sims.append(simulate(app, data, f'output="{out}"', root / f"scan-sim{k}"))
    ref = []
    for _ in range(2):
        t = time.perf_counter()
        want = [
            np.asarray(x) for x in __import__("jax").tree.leaves(reference.run(r.module, *r.leaves))
        ]
        ref.append(time.perf_counter() - t)
    got = files.read_outputs(out)
    close = all(np.allclose(g, w, rtol=1e-5, atol=1e-6) for g, w in zip(got, want))
    print(
        f"scan_rounds (3 rounds in a lax.scan, 3 nodes): simulate {min(sims):.1f}-{max(sims):.1f} s; "
        f"reference.run {ref[0]:.2f} s first call, {ref[1]:.2f} s second; outputs agree: {close}"
    )
    print("after:", uptime())


if __name__ == "__main__":
    main()
