"""One round with secure sums on a real local Flower deployment: through SecAgg+
(``secagg=true``, the default) vs summed by the ServerApp (``secagg=false``).

    python bench/flower_secagg.py            # warm-up, then 3 repetitions of each
    python bench/flower_secagg.py --smoke    # one run of each, no warm-up

The round is tests/flowerlib/secure.py's ``secure_mix`` (secure sums at 32 bits on
uint32, 12 bits on int32 and 16 bits on int16, and a plain mean) on one SuperLink and 3
SuperNodes on localhost, started once. Each repetition times one ``flwr run APP local
--stream`` per mode (submission until the command returns), alternating which goes
first, and checks both modes wrote the same outputs. Reported: each sample, the
medians, and the per-repetition ratio SecAgg+/plain (median, min, max), for the wall
time and for the round time the ServerApp prints. JSON with every sample in
bench/results/flower-secagg-[smoke-]<time>.json.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import statistics
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

import numpy as np  # noqa: E402
from fcir.interpreters import flower  # noqa: E402
from fcir.interpreters.flower.local import Deployment  # noqa: E402
from flower_round import run_once  # noqa: E402
from flowerlib import rounds, secure  # noqa: E402

import fcir  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="one run of each, no warm-up")
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    reps = 1 if a.smoke else a.reps

    work = pathlib.Path(tempfile.mkdtemp(prefix="fcir-flower-secagg-"))
    args = secure.make_args()
    module = fcir.capture(secure.secure_mix, *args)
    app = flower.export(module, work / "app")
    for i in range(rounds.NODES):
        (work / f"node{i}").mkdir()
        np.savez(work / f"node{i}" / f"{module.name}.npz", *(x[i] for x in args))
    data = [work / f"node{i}" / "{round}.npz" for i in range(rounds.NODES)]
    modes = {"secagg": "secagg=true", "plain": "secagg=false"}
    samples: dict[str, list] = {m: [] for m in modes}
    with Deployment(work / "deployment", rounds.NODES, data) as dep:
        if not a.smoke:
            for mode, flag in modes.items():
                run_once(dep, app, f'{flag} output="{work}/{mode}.npz"')
        for k in range(reps):
            order = list(modes) if k % 2 == 0 else list(modes)[::-1]
            for mode in order:
                wall, rnd, _ = run_once(dep, app, f'{modes[mode]} output="{work}/{mode}.npz"')
                samples[mode].append({"wall_s": wall, "round_s": rnd})
                print(f"rep {k}: {mode} wall {wall:.1f} s, round {rnd} s", flush=True)
            with np.load(work / "secagg.npz") as s, np.load(work / "plain.npz") as p:
                assert all(s[f].tobytes() == p[f].tobytes() for f in s.files), "outputs differ"
    shutil.rmtree(work, ignore_errors=True)

    def ratios(key):
        return [s[key] / p[key] for s, p in zip(samples["secagg"], samples["plain"]) if s[key] and p[key]]

    print()
    for mode, v in samples.items():
        walls = " ".join(f"{s['wall_s']:.1f}" for s in v)
        rnds = " ".join(f"{s['round_s']}" for s in v)
        print(f"{mode:<7} wall median {statistics.median(s['wall_s'] for s in v):6.1f} s [{walls}]"
              f"  round [{rnds}] s")
    for key in ("wall_s", "round_s"):
        r = ratios(key)
        if r:
            print(f"secagg/plain {key}: median {statistics.median(r):.2f}, min {min(r):.2f}, max {max(r):.2f}")
    print("outputs identical in both modes")
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"flower-secagg-{'smoke-' if a.smoke else ''}{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps({"samples": samples, "ratios_wall": ratios("wall_s"),
                                "ratios_round": ratios("round_s")}, indent=2) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
