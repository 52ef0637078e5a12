"""A skewed population's memory and rounds: padded to its longest client, or per cohort.

    python bench/population.py [--json PATH]     # the sizes below, 5 repetitions
    python bench/population.py --device-loop     # and the device loop, dense against ragged
    python bench/population.py --smoke           # tiny sizes, one repetition, both (CI)

The population: ``--clients`` clients (10,000) whose numbers of examples are lognormal,
as real federated data sets' are (median ``--median`` 20, sigma ``--sigma`` 1.5, at
least 1; seed 0), each example a feature vector ``f32[16]`` and a label ``i32``,
standard-normal features and uniform labels of 10 classes. The round: a uniform cohort
of ``--cohort`` 50; each member takes one step of gradient descent (learning rate 0.1)
of a 16-32-10 MLP's softmax loss on its own examples (masked by its count); the server
adds the count-weighted mean delta.

Reported, in one run:

- host bytes of the population: the padded layout (every client padded to the longest,
  what ``Population.from_clients`` held before it kept clients ragged: computed,
  ``N * longest * bytes an example``, as allocating it would take gigabytes), the
  ragged one (``Population.nbytes``, measured), and the examples' own bytes; the same
  for a CIFAR-shaped example (``uint8[32, 32, 3]`` and a label), from the same counts;
- per round, over the timed rounds: the cohort's bytes (what the host gathers and puts
  on the device) and the round's device memory (XLA's memory analysis of the compiled
  round: arguments, outputs and temporaries), padded to the population's longest
  (``padding="population"``) and to the bucket of the cohort's longest
  (``padding="bucket"``);
- round time: ``xla.simulate``'s host loop over the same ``--rounds`` rounds (20) with
  each padding, alternating which goes first, ``--reps`` repetitions (5) after a
  warm-up run that compiles every length; rounds per second (median, min, max) and
  the per-repetition ratio bucket/population of the time a round takes.

``--device-loop`` adds the device loop (``loop="device"``, the population on the device,
padded to its longest) over the same clients kept dense (padded beforehand:
``fcir.Population(data, counts)``, a member a whole client slice) and ragged (a member
a window of the concatenated examples, zeroed past its count), alternating:
``--device-clients`` (1,000) CIFAR-shaped clients of ``--device-examples`` (50)
examples each (``f32[32, 32, 3]``, every client full: only the layout differs) under a
round that reads every value of its cohort, and the lognormal population above under
its round; the population put on the device beforehand, the compiled loop of
``xla.simulate`` timed over ``R`` rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
sys.path.insert(0, str(BENCH))

import _record  # noqa: E402  (bench/, the script's own folder)
import _timing  # noqa: E402

FULL = {"clients": 10_000, "median": 20, "sigma": 1.5, "cohort": 50, "rounds": 20, "reps": 5,
        "device_clients": 1000, "device_examples": 50}  # fmt: skip
SMOKE = {"clients": 300, "median": 5, "sigma": 1.0, "cohort": 5, "rounds": 3, "reps": 1,
         "device_clients": 12, "device_examples": 3}  # fmt: skip
FEATURES, HIDDEN, CLASSES = 16, 32, 10
CIFAR_EXAMPLE = 32 * 32 * 3 + 4  # uint8 pixels and an int32 label
PADDINGS = ("population", "bucket")


def lognormal_sizes(cfg: dict, seed: int = 0):
    import numpy as np

    rng = np.random.default_rng(seed)
    z = rng.normal(size=cfg["clients"])
    return np.maximum(1, np.rint(cfg["median"] * np.exp(cfg["sigma"] * z))).astype(int)


def population(cfg: dict, seed: int = 0):
    """The ragged population of lognormal sizes (``fcir.Population.from_clients``)."""
    import numpy as np

    import fcir

    rng = np.random.default_rng(seed + 1)
    clients = [
        (rng.normal(size=(n, FEATURES)).astype(np.float32),
         rng.integers(0, CLASSES, n).astype(np.int32))
        for n in lognormal_sizes(cfg, seed)
    ]  # fmt: skip
    return fcir.Population.from_clients(clients)


def make_round(cohort: int):
    """The FedAvg round ``(params, (x, y), counts) -> (params, mean loss)``."""
    import jax
    import jax.numpy as jnp

    import fcir

    def loss(p, x, y, n):
        h = jax.nn.relu(x @ p["w1"] + p["b1"])
        logp = jax.nn.log_softmax(h @ p["w2"] + p["b2"])
        mask = jnp.arange(x.shape[0]) < n
        nll = -jnp.take_along_axis(logp, y[:, None], 1)[:, 0]
        return jnp.sum(nll * mask) / jnp.maximum(n, 1.0)

    def client(p, x, y, n):
        value, grad = jax.value_and_grad(loss)(p, x, y, n)
        return jax.tree.map(lambda g: -0.1 * g, grad), value

    @fcir.program(placements={"clients": cohort})
    def fedavg(params, data, counts):
        deltas, losses = fcir.map_fn(client, (fcir.broadcast(params), *data, counts))
        step = fcir.reduce_weighted_mean(deltas, counts)
        new = jax.tree.map(jnp.add, params, step)
        return new, fcir.reduce_weighted_mean(losses, counts)

    return fedavg


def init_params():
    import numpy as np

    rng = np.random.default_rng(0)
    return {
        "w1": (rng.normal(size=(FEATURES, HIDDEN)) / 4).astype(np.float32),
        "b1": np.zeros(HIDDEN, np.float32),
        "w2": (rng.normal(size=(HIDDEN, CLASSES)) / 6).astype(np.float32),
        "b2": np.zeros(CLASSES, np.float32),
    }


def host_bytes(pop) -> dict:
    """The population's host bytes, padded (computed) against ragged (measured), for
    its own examples and for CIFAR-shaped ones of the same counts."""
    import jax

    n, total, longest = pop.size, int(pop.offsets[-1]), pop.longest
    example = sum(x.itemsize * x[0].size for x in jax.tree.leaves(pop.data))
    per_client = pop.counts.nbytes  # the counts, in both layouts
    offsets = pop.offsets.nbytes
    return {
        "clients": n, "examples": total, "longest": longest,
        "mean_examples": total / n, "bytes_an_example": example,
        "padded": n * longest * example + per_client,
        "ragged": pop.nbytes, "examples_bytes": total * example,
        "cifar_padded": n * longest * CIFAR_EXAMPLE + per_client,
        "cifar_ragged": total * CIFAR_EXAMPLE + per_client + offsets,
        "cifar_examples_bytes": total * CIFAR_EXAMPLE,
    }  # fmt: skip


def round_memory(pop, cohorts, fedavg, params, rounds: int) -> dict:
    """Per round: the cohort's bytes and the compiled round's device bytes (arguments,
    outputs, temporaries: XLA's memory analysis), by the round's example length."""
    import jax
    from fcir.interpreters import xla

    import fcir

    by_length = {}
    out = {"length": [], "cohort_bytes": [], "device_bytes": []}
    for r in range(rounds):
        length = cohorts.length(r)
        specs = cohorts.specs(r)
        if length not in by_length:
            exe = xla.compile(fcir.capture(fedavg, params, *specs))
            m = exe.compiled(params, *specs).memory_analysis()
            device = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
            by_length[length] = device
        out["length"].append(length)
        out["cohort_bytes"].append(sum(s.size * s.dtype.itemsize for s in jax.tree.leaves(specs)))
        out["device_bytes"].append(by_length[length])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, one repetition")
    ap.add_argument("--device-loop", action="store_true", help="also the device loop")
    ap.add_argument("--json", help="write the summary (and the record) here")
    ap.add_argument("--out-dir", default=str(BENCH / "results"))
    for key in FULL:
        flag = f"--{key.replace('_', '-')}"
        ap.add_argument(flag, type=float if key == "sigma" else int)
    a = ap.parse_args()
    cfg = dict(SMOKE if a.smoke else FULL)
    cfg.update({k: v for k, v in vars(a).items() if k in FULL and v is not None})
    if cfg["reps"] < 1 or cfg["rounds"] < 1:
        ap.error("--reps and --rounds must be positive")

    load_before = os.getloadavg()
    result = {"config": cfg, "smoke": a.smoke, **paddings(cfg)}
    if a.device_loop or a.smoke:  # the smoke run keeps it from rotting
        result["device_loop"] = device_loops(cfg)
    load_after = os.getloadavg()
    print(f"load average {load_before[0]:.1f} -> {load_after[0]:.1f}, {os.cpu_count()} cores")
    import jax

    result.update({
        "versions": _record.versions("fcir"), **_record.machine(),
        "devices": [str(d) for d in jax.devices()],
        "load_average": [load_before[0], load_after[0]],
    })  # fmt: skip
    _record.write(a.out_dir, "population", result, "smoke" if a.smoke else None)
    if a.json:
        pathlib.Path(a.json).write_text(json.dumps(result, indent=1))
    return 0


def paddings(cfg: dict) -> dict:
    """The population's bytes and its rounds padded to the longest and bucketed."""
    import jax
    from fcir.interpreters import xla

    t = time.perf_counter()
    pop = population(cfg)
    built = time.perf_counter() - t
    sizes = host_bytes(pop)
    fedavg, params = make_round(cfg["cohort"]), init_params()
    cohorts = {p: pop.uniform(cfg["cohort"], seed=0, padding=p) for p in PADDINGS}
    memory = {p: round_memory(pop, c, fedavg, params, cfg["rounds"]) for p, c in cohorts.items()}

    def run(padding):
        out = xla.simulate(fedavg, params, cohorts[padding], cfg["rounds"], loop="host")
        jax.block_until_ready(out)
        return out

    results = {p: run(p) for p in PADDINGS}  # warm-up: compiles every length
    wall = {p: [] for p in PADDINGS}
    cpu = {p: [] for p in PADDINGS}
    for rep in range(cfg["reps"]):
        for p in _timing.rotated(list(PADDINGS), rep):
            w0, c0 = time.perf_counter(), time.process_time()
            run(p)
            wall[p].append((time.perf_counter() - w0) / cfg["rounds"])
            cpu[p].append((time.process_time() - c0) / cfg["rounds"])
    ratio = _timing.ratio_stats(wall["bucket"], wall["population"])
    report(cfg, sizes, memory, wall, ratio, built)
    return {
        "host_bytes": sizes, "round_memory": memory,
        "timing": {"round_s": wall, "cpu_round_s": cpu, "bucket/population": ratio},
        "losses": {p: [float(v) for v in results[p][1]] for p in PADDINGS}, "build_s": built,
    }  # fmt: skip


def pixel_round(cohort: int):
    """A round that reads every value of its cohort: each member's pixels weighted by
    the state, summed; the state moves by a tiny multiple of their mean."""
    import jax.numpy as jnp

    import fcir

    @fcir.program(placements={"clients": cohort})
    def read_all(w, data, counts):
        sums = fcir.map_fn(lambda w, x: jnp.sum(x * w), (fcir.broadcast(w), *data))
        return w + 1e-9 * fcir.reduce_weighted_mean(sums, counts)

    return read_all


def device_loops(cfg: dict) -> dict:
    """Seconds a round of the device loop over the same clients, dense and ragged."""
    import numpy as np

    import fcir

    rng = np.random.default_rng(2)
    n, e = cfg["device_clients"], cfg["device_examples"]
    x = rng.normal(size=(n, e, 32, 32, 3)).astype(np.float32)
    cifar = {"dense": fcir.Population((x,), np.full(n, e)),
             "ragged": fcir.Population.from_clients([(x[i],) for i in range(n)])}  # fmt: skip
    del x
    pixels = np.full((32, 32, 3), 0.5, np.float32)
    out = {"cifar": _device_times(cfg, cifar, pixel_round(cfg["cohort"]), pixels)}
    del cifar
    ragged = population(cfg)
    skewed = {"dense": fcir.Population(_padded(ragged), ragged.counts), "ragged": ragged}
    out["lognormal"] = _device_times(cfg, skewed, make_round(cfg["cohort"]), init_params())
    for case, t in out.items():
        med = {k: statistics.median(v) for k, v in t["round_s"].items()}
        print(f"device loop, {case}: a round {1e3 * med['dense']:.2f} ms dense, "
              f"{1e3 * med['ragged']:.2f} ms ragged; ragged/dense "
              f"{_timing.format_ratio(t['ragged/dense'])}")  # fmt: skip
    return out


def _padded(pop):
    """A ragged population's data padded to its longest client, clients on axis 0 (the
    dense layout ``Population.from_clients`` used to build)."""
    import jax
    import numpy as np

    longest, starts, rows = pop.longest, pop.offsets[:-1], np.diff(pop.offsets)

    def pad(x):
        out = np.zeros((pop.size, longest, *x.shape[1:]), x.dtype)
        for i, (a, c) in enumerate(zip(starts.tolist(), rows.tolist())):
            out[i, :c] = x[a : a + c]
        return out

    return jax.tree.map(pad, pop.data)


def _device_times(cfg: dict, pops: dict, round_fn, state) -> dict:
    """Per repetition, alternating, the seconds of a device-loop round for each
    population of ``pops``: ``xla.simulate``'s compiled loop over ``rounds`` rounds,
    called with the population already on the device. (Timing ``simulate`` itself
    times the population's transfer too, which it makes at each call: on a TPU its
    variation exceeded a round's time.)"""
    import jax
    import numpy as np
    from fcir.interpreters.xla import simulation as xsim

    r = cfg["rounds"]
    runs = {}
    for k, pop in pops.items():
        cohorts = pop.uniform(cfg["cohort"], seed=0)
        length = None if cohorts.lengths is None else cohorts.lengths[0]
        exe = xsim._executable(round_fn, state, cohorts, length, None, 0, None, None, "auto")
        metrics = xsim._has_metrics({length: exe}, state, cohorts, None, 0)
        if pop.offsets is None:
            arrays, gather, kind = xsim._dense_layout(pop)
        else:
            arrays, gather, kind = xsim._ragged_layout(pop, length)
        loop = xsim._scan(exe, metrics, False, kind, gather)
        args = (state, jax.device_put(arrays), cohorts.plan(0, r)[0], np.arange(r, dtype=np.int32))
        jax.block_until_ready(loop(*args, None))  # compiles
        runs[k] = (loop, args)
    times = {k: [] for k in pops}
    for rep in range(cfg["reps"]):
        for k in _timing.rotated(list(pops), rep):
            loop, args = runs[k]
            t = time.perf_counter()
            jax.block_until_ready(loop(*args, None))
            times[k].append((time.perf_counter() - t) / r)
    return {"round_s": times, "ragged/dense": _timing.ratio_stats(times["ragged"], times["dense"])}


def _mib(b: float) -> str:
    return f"{b / 2**20:,.1f} MiB"


def report(cfg, sizes, memory, wall, ratio, built) -> None:
    s = sizes
    print(
        f"{s['clients']:,} clients, lognormal examples (median {cfg['median']}, sigma "
        f"{cfg['sigma']}): {s['examples']:,} examples, {s['mean_examples']:.1f} a client on "
        f"average, the longest {s['longest']:,}; built in {built:.1f} s"
    )
    print(f"\nhost bytes        {'padded to longest':>20} {'ragged':>14} {'the examples':>14}")
    for name, pre in ((f"{s['bytes_an_example']} B an example", ""), ("CIFAR-shaped", "cifar_")):
        padded, ragged, own = (s[f"{pre}{k}"] for k in ("padded", "ragged", "examples_bytes"))
        print(f"{name:<17} {_mib(padded):>20} {_mib(ragged):>14} {_mib(own):>14}")
    print(f"\nper round ({cfg['rounds']} rounds, cohort {cfg['cohort']})"
          f"{'length':>16} {'cohort':>14} {'device':>14} {'round time':>12}")  # fmt: skip
    for p in PADDINGS:
        m = memory[p]
        med = statistics.median
        print(
            f"  padding={p!r:<14}{'':>14} {med(m['length']):>8.0f} (max {max(m['length'])})"
            f" {_mib(med(m['cohort_bytes'])):>12} {_mib(med(m['device_bytes'])):>14}"
            f" {1e3 * med(wall[p]):>9.1f} ms"
        )
    print(f"\nround time bucket/population: {_timing.format_ratio(ratio)} "
          f"({len(ratio['ratios'])} alternating repetitions; medians above)")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
