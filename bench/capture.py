"""Capture benchmark: how much fcir adds on top of tracing, and how it scales.

    python bench/capture.py            # full run (1e3, 1e4, 1e5 ops)
    python bench/capture.py --quick    # smoke mode for CI (tiny sizes, one repetition)

Part 1 times, side by side in one run (A, B, A, B ... after a warm-up), ``jax.make_jaxpr``
alone and ``fcir.capture`` (trace + convert + check) on the FedAvg transformer round,
and reports (capture - trace) / trace, the convert+check overhead (goal <= 0.5).
Part 2 builds programs of 1e3, 1e4 and 1e5 ops and times capture, print, parse and
serialize at each size, reporting each step's growth per 10x ops (goal <= 11x) and
parse/print, paired within each repetition (goal <= 2 at 1e5 ops).
Results: a table on stdout and JSON with every raw sample in bench/results/.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import fcir  # noqa: E402


def _time(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def chain_program(num_ops: int, clients: int = 4):
    """A round whose client body is a chain of about ``num_ops`` elementwise ops."""
    steps = max(num_ops // 2, 1)

    @fcir.program(placements={"clients": clients})
    def chain(w, data):
        def body(w, x):
            y = w * x
            for _ in range(steps):
                y = jnp.sin(y) + x
            return y

        return fcir.reduce_mean(fcir.map_fn(body, (fcir.broadcast(w), data)))

    args = (jnp.ones((8,), jnp.float32), jnp.ones((clients, 8), jnp.float32))
    return chain, args


def count_ops(module) -> int:
    from fcir.ir import walk

    return sum(1 for _ in walk(module.main.body))


def bench_overhead(reps: int) -> dict:
    """make_jaxpr time vs convert+check time of the same trace, pairwise."""
    from corpus import case

    from fcir.frontend.capture import _placements, from_jaxpr

    c = case("fedavg_transformer")
    args = c.make_args()
    trace, convert = [], []
    for i in range(reps + 1):
        fn = lambda *a: c.fn(*a)  # noqa: E731  (a fresh function: no tracing cache)
        box = {}
        t = _time(lambda: box.setdefault("j", jax.make_jaxpr(fn)(*args)))
        closed = box["j"]
        k = _time(lambda: fcir.check(from_jaxpr(closed, placements=_placements(c.fn, closed.jaxpr))))
        if i:  # the first pair is the warm-up
            trace.append(t)
            convert.append(k)
    return {"trace_s": trace, "convert_check_s": convert,
            "overhead_ratios": [k / t for t, k in zip(trace, convert)]}


def bench_scaling(sizes, reps: int) -> dict:
    out = {}
    for n in sizes:
        fn, args = chain_program(n)
        rows = {"capture": [], "print": [], "parse": [], "serialize": [], "check": []}
        for _ in range(reps):
            box = {}
            rows["capture"].append(_time(lambda: box.setdefault("m", fcir.capture(fn, *args))))
            m = box["m"]
            rows["check"].append(_time(lambda: fcir.check(m)))
            rows["print"].append(_time(lambda: box.setdefault("t", m.to_text())))
            text = box["t"]
            rows["parse"].append(_time(lambda: fcir.parse(text)))
            rows["serialize"].append(_time(lambda: m.serialize()))
        out[n] = {"ops": count_ops(box["m"]), **rows}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes, one repetition")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "capture.json"))
    a = ap.parse_args(argv)
    reps = 1 if a.quick else a.reps
    sizes = [100, 1000] if a.quick else [1000, 10000, 100000]

    over = bench_overhead(reps)
    med = statistics.median(over["overhead_ratios"])
    print("capture overhead on the FedAvg transformer round (side by side, median of "
          f"{reps}):")
    print(f"  make_jaxpr {statistics.median(over['trace_s']) * 1e3:8.1f} ms   convert+check "
          f"{statistics.median(over['convert_check_s']) * 1e3:8.1f} ms   ratio = "
          f"{med:.2f}  [min {min(over['overhead_ratios']):.2f}, max "
          f"{max(over['overhead_ratios']):.2f}]  goal <= 0.5")

    scale = bench_scaling(sizes, reps)
    print("\nscaling (median seconds; growth per 10x ops, goal <= 11x):")
    steps = ["capture", "check", "print", "parse", "serialize"]
    print(f"  {'ops':>8} " + " ".join(f"{s:>10}" for s in steps))
    prev = None
    for n in sizes:
        row = scale[n]
        meds = {s: statistics.median(row[s]) for s in steps}
        print(f"  {row['ops']:>8} " + " ".join(f"{meds[s]:>10.4f}" for s in steps))
        if prev is not None:
            growth = {s: meds[s] / prev[s] for s in steps}
            print(f"  {'growth':>8} " + " ".join(f"{growth[s]:>9.2f}x" for s in steps))
        prev = meds
    print("\nparse/print, pairwise in each repetition (goal <= 2 at 1e5 ops):")
    for n in sizes:
        ratios = [pa / pr for pa, pr in zip(scale[n]["parse"], scale[n]["print"])]
        scale[n]["parse_over_print"] = ratios
        print(f"  {scale[n]['ops']:>8} ops: median {statistics.median(ratios):.2f}  "
              f"[min {min(ratios):.2f}, max {max(ratios):.2f}]")

    result = {
        "overhead": over,
        "scaling": {str(k): v for k, v in scale.items()},
        "versions": {"jax": jax.__version__, "jaxlib": jax.lib.__version__ if hasattr(
            jax.lib, "__version__") else None, "numpy": np.__version__, "fcir": fcir.__version__},
        "cores": os.cpu_count(),
        "machine": platform.machine(),
        "quick": a.quick,
    }
    path = pathlib.Path(a.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    print(f"\nraw samples: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
