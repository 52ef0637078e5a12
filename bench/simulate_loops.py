"""Where ``xla.simulate``'s time goes: its loops against the compiled round alone.

    python bench/simulate_loops.py            # CIFAR-10 FedAvg, cohort 50 of 1,000, 20 rounds
    python bench/simulate_loops.py --smoke    # tiny sizes (CI)

The round of bench/simulate.py (bench/cifar.py), compiled once, then, alternately in
each of ``--reps`` repetitions (rotating which goes first), ``--rounds`` rounds of:

- ``compiled``: the compiled round called back to back on one cohort already on the
  device: what a loop over rounds can at best give;
- ``host``: ``xla.simulate(..., loop="host")``: a thread gathers each cohort on the host
  and puts it on the device ahead of the rounds;
- ``device``: ``xla.simulate(..., loop="device")``: the population on the device, every
  round in one program that gathers its cohort there;
- ``drjax``: DrJAX's round in bench/cifar.py's hand loop (gather on the host,
  ``device_put`` of the next cohort while the round runs).

Reported: rounds per second of each (median, min, max), each loop's cost over
``compiled`` (its seconds / compiled's, per repetition) and ``host``/``device`` against
``drjax``; and, timed alone, the host loop's two steps for one cohort: the gather into
host arrays used before, and the transfer to the device (``device_put``, awaited), and
the device loop's put of the whole population, which it makes at a call where the
population is not on the device already (the first: it stays there for the next). A
loop keeps the device busy when one cohort's gather and transfer take less than a
round. JSON with every sample: bench/results/simulate_loops[-smoke]-<time>.json.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import _record  # noqa: E402  (bench/, the script's own folder)
import _timing  # noqa: E402
import cifar  # noqa: E402

FULL = {"clients": 1000, "examples": 50, "cohort": 50, "batch": 10, "rounds": 20, "reps": 5}
SMOKE = {"clients": 12, "examples": 20, "cohort": 4, "batch": 10, "rounds": 2, "reps": 1}
PARTS = 10  # cohorts gathered and put, each timed alone


def systems(cfg: dict) -> dict:
    """name -> function running ``cfg["rounds"]`` rounds, awaited."""
    import jax
    from fcir.interpreters import xla

    rounds = cfg["rounds"]
    pop = cifar.population(cfg["clients"], cfg["examples"])
    cohorts = cifar.population_fcir(pop, cfg["batch"], cfg["cohort"])
    exe = cifar.compile_population(cohorts)
    params = jax.device_put(cifar.model().init_params(0, pop[0].shape[2:]))
    resident = jax.device_put(cohorts.gather(0))
    hand = cifar.HandLoop(cifar.compile_drjax(cfg["cohort"], cfg["examples"], cfg["batch"]),
                          *pop, cfg["cohort"], cfg["batch"])  # fmt: skip

    def compiled():
        p = params
        for _ in range(rounds):
            p, _loss = exe(p, *resident)
        jax.block_until_ready(p)

    def loop(kind):
        return lambda: jax.block_until_ready(xla.simulate(exe, params, cohorts, rounds, loop=kind))

    return {"compiled": compiled, "host": loop("host"), "device": loop("device"),
            "drjax": lambda: hand.run(rounds)}  # fmt: skip


def parts(cfg: dict) -> dict:
    """Seconds of one cohort's gather (into host arrays written before) and of its
    transfer, each timed alone, ``PARTS`` cohorts; and of putting the whole population
    on the device as the device loop does at its first ``simulate`` call (in its layout
    of 128-lane rows), ``PARTS`` times."""
    import jax
    from fcir.interpreters.xla import simulation

    pop = cifar.population(cfg["clients"], cfg["examples"])
    cohorts = cifar.population_fcir(pop, cfg["batch"], cfg["cohort"])
    out = cohorts.empty(0)
    cohorts.take(*cohorts.indices(0), out=out)  # its pages touched once
    gather, put = [], []
    for r in range(PARTS):
        t = time.perf_counter()
        cohort = cohorts.take(*cohorts.indices(r), out=out)
        gather.append(time.perf_counter() - t)
        t = time.perf_counter()
        jax.block_until_ready(jax.device_put(cohort))
        put.append(time.perf_counter() - t)
    arrays, _, _ = simulation._dense_layout(cohorts.population)  # noqa: SLF001
    population = []
    for _ in range(PARTS):
        t = time.perf_counter()
        jax.block_until_ready(jax.device_put(arrays))
        population.append(time.perf_counter() - t)
    return {"gather_s": gather, "put_s": put, "population_put_s": population,
            "cohort_bytes": int(sum(x.nbytes for x in jax.tree.leaves(cohort))),
            "population_bytes": int(sum(x.nbytes for x in jax.tree.leaves(arrays)))}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, one repetition")
    ap.add_argument("--out-dir", default=str(pathlib.Path(__file__).parent / "results"))
    for key in FULL:
        ap.add_argument(f"--{key}", type=int)
    a = ap.parse_args()
    cfg = dict(SMOKE if a.smoke else FULL)
    cfg.update({k: getattr(a, k) for k in FULL if getattr(a, k) is not None})
    if min(cfg.values()) < 1 or cfg["cohort"] > cfg["clients"]:
        ap.error("sizes must be positive and the cohort at most the population")
    import jax

    print(f"config: {cfg} on {jax.devices()[0].device_kind}", flush=True)
    run = systems(cfg)
    for fn in run.values():
        fn()  # compiles, warms caches
    seconds = {n: [] for n in run}
    for r in range(cfg["reps"]):
        for name in _timing.rotated(list(run), r):
            t = time.perf_counter()
            run[name]()
            seconds[name].append(time.perf_counter() - t)
    steps = parts(cfg)
    rps = {n: [cfg["rounds"] / s for s in v] for n, v in seconds.items()}
    print(f"\n{'':<10} {'rounds/s':>9} {'min':>8} {'max':>8} {'ms a round':>11}")
    for n, v in rps.items():
        m = statistics.median(v)
        print(f"{n:<10} {m:>9.2f} {min(v):>8.2f} {max(v):>8.2f} {1e3 / m:>11.2f}")
    ratios = {}
    for num, den in (("host", "compiled"), ("device", "compiled"), ("drjax", "compiled"),
                     ("compiled", "drjax"), ("host", "drjax"), ("device", "drjax")):  # fmt: skip
        # seconds over seconds for the costs over compiled, rounds/s for the rest
        s = (_timing.ratio_stats(seconds[num], seconds[den]) if den == "compiled"
             else _timing.ratio_stats(rps[num], rps[den]))  # fmt: skip
        ratios[f"{num}/{den}"] = s
        what = "seconds" if den == "compiled" else "rounds/s"
        print(f"{num}/{den} ({what}): {_timing.format_ratio(s)}")
    g, p = (statistics.median(steps[k]) * 1e3 for k in ("gather_s", "put_s"))
    print(f"one cohort ({steps['cohort_bytes'] / 2**20:.1f} MiB): gather {g:.2f} ms, "
          f"transfer {p:.2f} ms (medians of {PARTS}); a compiled round "
          f"{1e3 / statistics.median(rps['compiled']):.2f} ms")  # fmt: skip
    u = statistics.median(steps["population_put_s"]) * 1e3
    print(f"the population ({steps['population_bytes'] / 2**20:.1f} MiB) put on the device, "
          f"as the device loop does at its first call: {u:.2f} ms, {u / cfg['rounds']:.2f} "
          f"ms a round over {cfg['rounds']} rounds")  # fmt: skip
    result = {"smoke": a.smoke, "config": cfg, "seconds": seconds, "rounds_per_s": rps,
              "ratios": ratios, "parts": steps, "device": jax.devices()[0].device_kind,
              "versions": _record.versions("drjax", "fcir"), **_record.machine()}  # fmt: skip
    _record.write(a.out_dir, "simulate_loops", result, "smoke" if a.smoke else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
