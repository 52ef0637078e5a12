"""A 3-node FedAvg round on a real local Flower deployment: fcir's export vs a
hand-written Flower app doing the same exchange.

    python bench/flower_round.py            # warm-up, then 5 repetitions of each
    python bench/flower_round.py --smoke    # one run of each, no warm-up

Both apps run ``fedavg_mlp`` of tests/corpus (8->16->2 MLP, 3 SGD steps per client)
on the same deployment (one SuperLink, 3 SuperNodes on localhost, started once) with
the same node data files:

- ``fcir``: ``fcir export --target flower`` of the round; ClientApp runs client work
  from its jax.export artifact, ServerApp runs the server parts and the aggregation;
- ``hand``: bench/flower_hand/, the same exchange written by hand against Flower's
  Message API (``jax.jit`` training step in the ClientApp, numpy mean at the server).

Each repetition times one ``flwr run APP local --stream`` of each app, from submission
until the command returns (ServerApp start, one round, shutdown), alternating which
goes first. Reported: median wall times and the median, min/max of the per-repetition
ratio fcir/hand (goal <= 1.2), plus the round time each ServerApp prints. JSON with
every sample in bench/results/flower-[smoke-]<time>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from fcir.interpreters.flower.local import Deployment, env_for  # noqa: E402
from flowerlib import rounds  # noqa: E402

ROUND_LINE = re.compile(r"\[(fcir|hand)\] round 1\S*: .*?(\d+\.\d) s")


def run_once(dep: Deployment, app, config: str) -> tuple[float, float | None, str]:
    start = time.perf_counter()
    proc = subprocess.run(
        dep.run_command(app, config),
        env=env_for(dep.cli_home),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    wall = time.perf_counter() - start
    out = proc.stdout + proc.stderr
    if proc.returncode != 0 or "round 1" not in out:  # flwr run exits 0 when the app fails
        raise RuntimeError(f"flwr run {app} failed:\n{out[-3000:]}")
    m = ROUND_LINE.search(out)
    return wall, float(m.group(2)) if m else None, out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="one run of each, no warm-up")
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    reps = 1 if a.smoke else a.reps

    work = pathlib.Path(tempfile.mkdtemp(prefix="fcir-flower-bench-"))
    r = rounds.corpus_round("fedavg_mlp")
    fcir_app = rounds.export(r, work / "fcir_app")
    plan = rounds.plan_of(fcir_app)
    for i in range(rounds.NODES):
        (work / f"node{i}").mkdir()
        np.savez(work / f"node{i}" / "fedavg_mlp.npz", *r.node_leaves(plan, i))
    np.savez(work / "inputs.npz", *r.server_leaves)
    hand_app = ROOT / "bench" / "flower_hand"
    data = [work / f"node{i}" / "{round}.npz" for i in range(rounds.NODES)]

    apps = {
        "fcir": (fcir_app, f'output="{work}/fcir.npz"'),
        "hand": (hand_app, f'inputs="{work}/inputs.npz" output="{work}/hand.npz"'),
    }
    samples: dict[str, list] = {"fcir": [], "hand": []}
    with Deployment(work / "deployment", rounds.NODES, data) as dep:
        if not a.smoke:
            for app, config in apps.values():
                run_once(dep, app, config)  # warm-up: FAB install, compilation cache
        for k in range(reps):
            order = ["fcir", "hand"] if k % 2 == 0 else ["hand", "fcir"]
            for name in order:
                wall, rnd, _ = run_once(dep, *apps[name])
                samples[name].append({"wall_s": wall, "round_s": rnd})
                print(f"rep {k}: {name} wall {wall:.1f} s, round {rnd} s", flush=True)

    with np.load(work / "fcir.npz") as fcir_out, np.load(work / "hand.npz") as hand_out:
        max_diff = max(
            float(np.max(np.abs(fcir_out[k] - hand_out[k]))) for k in fcir_out.files
        )
    shutil.rmtree(work, ignore_errors=True)
    ratios = [f["wall_s"] / h["wall_s"] for f, h in zip(samples["fcir"], samples["hand"])]
    round_ratios = [
        f["round_s"] / h["round_s"]
        for f, h in zip(samples["fcir"], samples["hand"])
        if f["round_s"] and h["round_s"]
    ]
    med = {n: statistics.median(s["wall_s"] for s in v) for n, v in samples.items()}
    print()
    print(f"{'app':<6} {'median wall (s)':>16} {'samples':>40}")
    for n, v in samples.items():
        walls = " ".join(f"{s['wall_s']:.1f}" for s in v)
        print(f"{n:<6} {med[n]:>16.1f} {walls:>40}")
    print(
        f"fcir/hand wall: median {statistics.median(ratios):.3f}, min {min(ratios):.3f}, "
        f"max {max(ratios):.3f} (goal <= 1.2)"
    )
    if round_ratios:
        print(
            f"fcir/hand round (ServerApp's own timing): median "
            f"{statistics.median(round_ratios):.3f}, min {min(round_ratios):.3f}, "
            f"max {max(round_ratios):.3f}"
        )
    print(f"max |fcir - hand| over the outputs: {max_diff:.2e}")
    doc = {
        "samples": samples,
        "ratios_wall": ratios,
        "ratios_round": round_ratios,
        "max_abs_diff": max_diff,
        "versions": {"jax": jax.__version__, "numpy": np.__version__,
                     "python": platform.python_version()},
        "cores": os.cpu_count(),
    }
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = out / f"flower-{'smoke-' if a.smoke else ''}{stamp}.json"
    path.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
