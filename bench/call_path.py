"""Call path benchmark: a warm ``exe(*args)`` of fcir's XLA backend against DrJAX.

    python bench/call_path.py            # full: 64 clients, 9 repetitions of 300 calls
    python bench/call_path.py --smoke    # CI: 8 clients, 2 repetitions of 5 calls

The round is FedAvg on the two-layer MLP of ``tests/corpus/fedavg_mlp.py`` (8 -> 16 ->
2, 3 local SGD steps of 4 examples per client) over 64 clients, on one device, called
the way a user calls it, each program compiled and warmed up first:

- ``fcir``: ``exe = xla.compile(fcir.capture(round, *args))``, then ``exe(*args)``;
- ``drjax``: the same round on ``drjax`` 0.2.1, ``jax.jit(round)(*args)``;
- ``fcir_jit``: ``jax.jit`` of the fcir round itself (what exe's program computes).

Each repetition times one block of calls per program (results awaited at the end of
the block), the three blocks back to back, rotating which goes first. Reported: the
median time per call and, per repetition, the ratios fcir/drjax (goal <= 1.05) and
fcir/fcir_jit: median [min, max] over the repetitions, wall and CPU.

Results: a table on stdout and JSON with every raw sample, versions, the core count
and the load average in bench/results/call_path[-smoke]-<time>.json.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import _record  # bench/, the script's own folder
import _timing

FULL = {"clients": 64, "calls": 300, "reps": 9, "warmup": 2}
SMOKE = {"clients": 8, "calls": 5, "reps": 2, "warmup": 1}


def programs(clients: int):
    """The corpus FedAvg MLP round over ``clients`` clients, three ways, and its args."""
    import drjax
    import jax
    from corpus import fedavg_mlp
    from fcir.interpreters import xla

    import fcir

    args = fedavg_mlp.make_args(clients, seed=0)
    progs = {
        "fcir": xla.compile(fcir.capture(fedavg_mlp.build(fcir, clients), *args)),
        "drjax": jax.jit(fedavg_mlp.build(drjax, clients)),
        "fcir_jit": jax.jit(fedavg_mlp.build(fcir, clients)),
    }
    return progs, args


def time_calls(progs: dict, args, calls: int, reps: int, warmup: int) -> dict:
    wall, cpu = _timing.time_blocks(progs, args, calls, reps, warmup)
    return {
        "samples_s": wall,
        "cpu_samples_s": cpu,
        **_timing.ratios(wall, cpu, "fcir", ("drjax", "fcir_jit")),
    }


_ratio = _timing.format_ratio


def report(result: dict, cfg: dict, load: list) -> str:
    t = result["timing"]
    us = {n: statistics.median(v) * 1e6 for n, v in t["samples_s"].items()}
    return "\n".join([
        f"call path, FedAvg MLP round, {cfg['clients']} clients, 1 device ({cfg['reps']} "
        f"repetitions of {cfg['calls']} calls per program, rotating the first; us per call, "
        "median)",
        f"  fcir exe {us['fcir']:9.1f}   drjax jit {us['drjax']:9.1f}   "
        f"fcir jit {us['fcir_jit']:9.1f}",
        f"  fcir/drjax     {_ratio(t['fcir/drjax'])}  (goal <= 1.05)",
        f"  fcir/fcir_jit  {_ratio(t['fcir/fcir_jit'])}",
        f"  CPU: fcir/drjax {_ratio(t['cpu fcir/drjax'])}, "
        f"fcir/fcir_jit {_ratio(t['cpu fcir/fcir_jit'])}",
        f"  load average (1, 5, 15 min) before: {load[0]}, after: {load[1]}",
    ])  # fmt: skip


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="8 clients, 2 short repetitions (CI)")
    ap.add_argument("--reps", type=int, help="repetitions (default 9; >= 5 for a figure)")
    ap.add_argument("--calls", type=int, help="calls per block (default 300)")
    ap.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    a = ap.parse_args(argv)
    cfg = dict(SMOKE if a.smoke else FULL)
    if a.reps is not None:
        cfg["reps"] = a.reps
    if a.calls is not None:
        cfg["calls"] = a.calls
    if cfg["reps"] < 1 or cfg["calls"] < 1:
        ap.error("--reps and --calls must be positive")
    started = time.time()
    load = [os.getloadavg()]
    progs, args = programs(cfg["clients"])
    timing = time_calls(progs, args, cfg["calls"], cfg["reps"], cfg["warmup"])
    load.append(os.getloadavg())
    result = {
        "config": cfg,
        "timing": timing,
        "load_average": load,
        "versions": _record.versions("drjax"),
        **_record.machine(),
        "smoke": a.smoke,
        "wall_s": time.time() - started,
    }
    print(report(result, cfg, [tuple(round(x, 2) for x in v) for v in load]))
    _record.write(a.out_dir, "call_path", result, "smoke" if a.smoke else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
