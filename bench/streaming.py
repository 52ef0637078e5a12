"""Streaming client maps at scale: fcir ``clients_per_step`` vs DrJAX's unchunked round.

    python bench/streaming.py            # full run: 256, 1024, 4096 clients
    python bench/streaming.py --smoke    # CI: a tiny MLP, 16 and 32 clients, one repetition

One FedAvg round of a two-layer MLP (full size: 1024 -> 3072 -> 256, ~3.9M float32
parameters, 15 MiB a copy), one local SGD step per client on its own batch, on 8
simulated CPU devices with the clients sharded over a ``clients`` mesh axis and the
model replicated, run two ways:

- ``fcir``: ``xla.compile(fcir.capture(round), mesh, clients_per_step=K)``: each device
  streams its own clients K at a time into a running sum;
- ``drjax``: the same round built on ``drjax`` 0.2.1 (``jax.jit`` under
  ``jax.set_mesh``): one batched computation, every client's update at once.

Each (program, cohort) runs in a fresh subprocess, so its peak RSS (``ru_maxrss``) is
its own: compile, read XLA's memory analysis of the compiled executable (per device:
arguments, outputs, temporaries; ``peak`` = their sum minus aliases; ``total`` = peak ×
8 devices), then, if it fits, run it (a warm-up, then ``--reps`` timed rounds; time per
client = median round / cohort). A DrJAX configuration whose predicted total exceeds
``--max-gib`` (default 8 GiB: other people share this machine) or the free memory is
compiled only, never run: its row shows the predicted bytes.

Time per client is compared side by side where both fit (by default 256 clients, where
DrJAX needs ~4 GiB): one subprocess holds both compiled rounds and times them
alternately (fcir, drjax, drjax, fcir, ...) after a warm-up; the figure is the median of
per-pair ratios fcir/drjax (goal <= 1.2), with min/max.

Goals: fcir's peak flat (<= 1.1x from 256 to 4096 clients) while DrJAX's
grows linearly; 4096 clients run for fcir.

Gradient and DP rows (compiled, not run, each cohort in a fresh process): XLA's
temporaries per device (``memory_analysis().temp_size_in_bytes``) of the same round
streamed K per device as ``jax.grad(exe)`` with respect to the server model, as
``xla.compile`` of a captured gradient, as a meta-gradient through a ``lax.scan`` of
two rounds, with ``dp_mean`` (forward and gradient) and with ``ddp_mean`` in place of
the mean, and the unchunked ``jax.grad(exe)`` for reference; each with its ratio to
the first cohort (goal <= 1.1 for the streamed rows).

Results: a table on stdout, JSON with every raw sample, versions, core count and load
average in bench/results/streaming[-smoke]-<time>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import resource
import statistics
import subprocess
import sys
import time

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

ROOT = pathlib.Path(__file__).resolve().parent.parent

import _record  # bench/, the script's own folder

PROTOCOL = "FCIR-BENCH"
FULL = {"d_in": 1024, "hidden": 3072, "d_out": 256, "batch": 2, "k": 8}
SMOKE = {"d_in": 16, "hidden": 32, "d_out": 4, "batch": 2, "k": 2}
LR = 0.1
GIB = 2**30


# --- the round ---------------------------------------------------------------------------


def local_step(params, x, y):
    """One SGD step on the client's batch; the client's update (new - old)."""
    import jax
    import jax.numpy as jnp

    def loss(p):
        h = jax.nn.relu(x @ p["w1"] + p["b1"])
        return jnp.mean(jnp.square(h @ p["w2"] + p["b2"] - y))

    grads = jax.grad(loss)(params)
    return jax.tree.map(lambda g: -LR * g, grads)


def make_round(n: int, api):
    import jax

    @api.program(placements={"clients": n})
    def fedavg(params, x, y):
        deltas = api.map_fn(local_step, (api.broadcast(params), x, y))
        return jax.tree.map(lambda p, d: p + d, params, api.reduce_mean(deltas))

    return fedavg


def make_variant(n: int, which: str):
    """The round with its mean replaced (``dp_mean``, ``ddp_mean``) or iterated (a
    ``lax.scan`` of two rounds), for the memory rows."""
    import jax

    import fcir

    def agg(deltas, key):
        if which == "dp":
            return fcir.dp_mean(deltas, 1.0, 1.0, key)
        if which == "ddp":
            return fcir.ddp_mean(deltas, 1.0, 1.0, key, bits=24)
        return fcir.reduce_mean(deltas)

    def one(params, x, y, key):
        deltas = fcir.map_fn(local_step, (fcir.broadcast(params), x, y))
        return jax.tree.map(lambda p, d: p + d, params, agg(deltas, key))

    if which == "scan":

        @fcir.program(placements={"clients": n})
        def rounds(params, x, y):
            step = lambda p, _: (one(p, x, y, None), None)  # noqa: E731
            return jax.lax.scan(step, params, None, length=2)[0]

        return rounds

    @fcir.program(placements={"clients": n})
    def dp_round(params, x, y, key):
        return one(params, x, y, key)

    return dp_round


def server_loss(params):
    import jax
    import jax.numpy as jnp

    return sum(jnp.sum(jnp.square(v)) for v in jax.tree.leaves(params))


def memory_rows(n: int, cfg: dict, mesh) -> dict:
    """{row: memory(compiled)} of the gradient and DP programs at ``n`` clients."""
    import jax
    from fcir.interpreters import xla
    from jax.sharding import NamedSharding, PartitionSpec

    import fcir

    k = cfg["k"]
    params, x, y = make_args(n, cfg, mesh)
    key = jax.device_put(jax.random.key(0), NamedSharding(mesh, PartitionSpec()))
    keys = jax.device_put(
        jax.random.split(jax.random.key(1), n), NamedSharding(mesh, PartitionSpec("clients"))
    )

    def grad(exe, *rest):
        f = jax.jit(jax.grad(lambda p, *a: server_loss(exe(p, *a))))
        return f.lower(params, x, y, *rest).compile()

    rnd = make_round(n, fcir)
    module = fcir.capture(rnd, params, x, y)
    streamed = xla.compile(module, mesh=mesh, clients_per_step=k)
    captured = fcir.capture(jax.grad(lambda p, x, y: server_loss(rnd(p, x, y))), params, x, y)
    scan = fcir.capture(make_variant(n, "scan"), params, x, y)
    dp = xla.compile(
        fcir.capture(make_variant(n, "dp"), params, x, y, key), mesh=mesh, clients_per_step=k
    )
    ddp = xla.compile(
        fcir.capture(make_variant(n, "ddp"), params, x, y, keys), mesh=mesh, clients_per_step=k
    )
    rows = {
        "round": streamed.compiled(params, x, y),
        "jax.grad(exe)": grad(streamed),
        "exe of captured grad": xla.compile(captured, mesh=mesh, clients_per_step=k).compiled(
            params, x, y
        ),
        "meta-grad, 2 rounds": grad(xla.compile(scan, mesh=mesh, clients_per_step=k)),
        "dp_mean round": dp.compiled(params, x, y, key),
        "jax.grad(dp_mean)": grad(dp, key),
        "ddp_mean round": ddp.compiled(params, x, y, keys),
        "unchunked jax.grad": grad(xla.compile(module, mesh=mesh)),
    }
    return {name: memory(c) for name, c in rows.items()}


def memory_table(rows: dict) -> str:
    cohorts = [n for n in rows if "error" not in rows[n]]
    if not cohorts:
        return "gradient and DP rows: " + "; ".join(str(r) for r in rows.values())[:300]
    first = rows[cohorts[0]]
    lines = [
        "Gradient and DP programs (compiled, not run): XLA temp per device in MiB "
        f"(ratio to {cohorts[0]} clients)",
        f"{'program':<24}" + "".join(f"{n:>20}" for n in cohorts),
    ]
    for name in first:
        cells = []
        for n in cohorts:
            t = rows[n][name]["temp_bytes"]
            cells.append(f"{t / 2**20:.2f} ({t / first[name]['temp_bytes']:.2f}x)")
        lines.append(f"{name:<24}" + "".join(f"{c:>20}" for c in cells))
    return "\n".join(lines)


def make_args(n: int, cfg: dict, mesh):
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec

    rng = np.random.default_rng(0)
    d_in, h, d_out, b = cfg["d_in"], cfg["hidden"], cfg["d_out"], cfg["batch"]
    params = {
        "w1": (rng.normal(size=(d_in, h)) / np.sqrt(d_in)).astype(np.float32),
        "b1": np.zeros(h, np.float32),
        "w2": (rng.normal(size=(h, d_out)) / np.sqrt(h)).astype(np.float32),
        "b2": np.zeros(d_out, np.float32),
    }
    x = rng.normal(size=(n, b, d_in)).astype(np.float32)
    y = rng.normal(size=(n, b, d_out)).astype(np.float32)
    params = jax.device_put(params, NamedSharding(mesh, PartitionSpec()))
    x, y = (jax.device_put(a, NamedSharding(mesh, PartitionSpec("clients"))) for a in (x, y))
    return params, x, y


def compile_round(which: str, n: int, cfg: dict, mesh, args):
    """(round ``f(*args)``, its ``jax.stages.Compiled``) for ``which`` in {"fcir", "drjax"}."""
    import jax

    if which == "fcir":
        from fcir.interpreters import xla

        import fcir

        module = fcir.capture(make_round(n, fcir), *args)
        exe = xla.compile(module, mesh=mesh, clients_per_step=cfg["k"])
        return exe, exe.compiled(*args)
    import drjax

    with jax.set_mesh(mesh):
        compiled = jax.jit(make_round(n, drjax)).lower(*args).compile()
    return compiled, compiled


def memory(compiled) -> dict:
    m = compiled.memory_analysis()
    peak = (
        m.argument_size_in_bytes
        + m.output_size_in_bytes
        + m.temp_size_in_bytes
        - m.alias_size_in_bytes
    )
    return {
        "argument_bytes": int(m.argument_size_in_bytes),
        "output_bytes": int(m.output_size_in_bytes),
        "temp_bytes": int(m.temp_size_in_bytes),
        "peak_bytes": int(peak),
        "total_bytes": int(peak) * 8,
    }


def rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


# --- workers (one per configuration, fresh process) ----------------------------------------


def worker(which: str, n: int, cfg: dict, reps: int, run: bool, max_bytes: int) -> dict:
    import jax

    mesh = jax.make_mesh((8,), ("clients",), axis_types=(jax.sharding.AxisType.Auto,))
    args = make_args(n, cfg, mesh)
    t0 = time.perf_counter()
    fn, compiled = compile_round(which, n, cfg, mesh, args)
    out = {"compile_s": time.perf_counter() - t0, "memory": memory(compiled)}
    out["rss_after_compile_bytes"] = rss_bytes()
    if not run or out["memory"]["total_bytes"] > max_bytes:
        out["ran"] = False
        return out
    # Rounds get long (minutes at 4096 clients on 2 shared cores): repetitions scale
    # down with the cohort, and the biggest cohorts skip the warm-up (a round there is
    # far longer than a first call's overhead).
    reps = max(1, reps * 256 // n) if n > 256 else reps
    out["warmup"] = n <= 1024
    if out["warmup"]:
        jax.block_until_ready(fn(*args))
    samples = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        samples.append(time.perf_counter() - t)
    out.update(ran=True, samples_s=samples, peak_rss_bytes=rss_bytes())
    out["s_per_client"] = statistics.median(samples) / n
    return out


def pair_worker(n: int, cfg: dict, reps: int) -> dict:
    """Both rounds in one process, timed alternately: the side-by-side ratio."""
    import jax
    import numpy as np

    mesh = jax.make_mesh((8,), ("clients",), axis_types=(jax.sharding.AxisType.Auto,))
    requested = n
    while True:
        # This process holds both rounds at once, and DrJAX's measured RSS runs about
        # twice XLA's predicted total (buffers of the 8 CPU devices, host copies): halve
        # the cohort until twice the predictions fit in what is free, with 2 GiB to spare.
        args = make_args(n, cfg, mesh)
        progs = {w: compile_round(w, n, cfg, mesh, args) for w in ("fcir", "drjax")}
        need = 2 * sum(memory(c)["total_bytes"] for _, c in progs.values())
        if n <= 8 or need + 2 * GIB <= free_bytes():
            break
        n //= 2
    progs = {w: f for w, (f, _) in progs.items()}
    outs = {w: jax.tree.leaves(p(*args)) for w, p in progs.items()}  # warm-up
    diff = max(
        float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
        for a, b in zip(outs["fcir"], outs["drjax"])
    )
    samples = {"fcir": [], "drjax": []}
    for r in range(reps):
        order = ("fcir", "drjax") if r % 2 == 0 else ("drjax", "fcir")
        for w in order:
            t = time.perf_counter()
            jax.block_until_ready(progs[w](*args))
            samples[w].append(time.perf_counter() - t)
    ratios = [a / b for a, b in zip(samples["fcir"], samples["drjax"])]
    return {
        "clients": n,
        "clients_requested": requested,
        "samples_s": samples,
        "ratios": ratios,
        "median_ratio": statistics.median(ratios),
        "min_ratio": min(ratios),
        "max_ratio": max(ratios),
        "max_abs_diff": diff,
    }


def spawn(argv: list[str], timeout: float) -> dict:
    cmd = [sys.executable, str(pathlib.Path(__file__).resolve()), *argv]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    for line in res.stdout.splitlines():
        if line.startswith(PROTOCOL + " "):
            return json.loads(line[len(PROTOCOL) + 1 :])
    return {"error": f"exit {res.returncode}: {(res.stderr or res.stdout)[-1500:]}"}


# --- driver ------------------------------------------------------------------------------


def free_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def gib(x) -> str:
    return "-" if x is None else f"{x / GIB:.2f}"


def table(results: dict, pair: dict | None, cfg_params: int) -> str:
    lines = [
        f"FedAvg round, MLP {cfg_params / 1e6:.2f}M params ({cfg_params * 4 / 2**20:.1f} MiB a "
        "copy), one local step per client, 8 CPU devices",
        f"{'clients':>7}  {'program':<16} {'XLA temp/dev':>12} {'XLA peak/dev':>12} "
        f"{'XLA total':>10} {'peak RSS':>9} {'ms/client':>9}  note",
    ]
    for n, row in results.items():
        for which, r in row.items():
            if "error" in r:
                lines.append(f"{n:>7}  {which:<16} error: {r['error'][:60]}")
                continue
            m = r["memory"]
            ms = f"{r['s_per_client'] * 1e3:.3f}" if r.get("ran") else "-"
            note = "" if r.get("ran") else "compiled only (predicted total over the cap)"
            lines.append(
                f"{n:>7}  {r['label']:<16} {gib(m['temp_bytes']):>12} {gib(m['peak_bytes']):>12} "
                f"{gib(m['total_bytes']):>10} {gib(r.get('peak_rss_bytes')):>9} {ms:>9}  {note}"
            )
    lines.append(
        "(memory in GiB; XLA figures from Compiled.memory_analysis(), per device; "
        "total = 8 devices; peak RSS = ru_maxrss of the config's own process)"
    )
    fc = [r["fcir"] for r in results.values() if r["fcir"].get("ran")]
    if len(fc) >= 2:
        a, b = fc[0], fc[-1]
        lines.append(
            f"fcir growth {list(results)[0]} -> {list(results)[-1]} clients: XLA peak "
            f"{b['memory']['peak_bytes'] / a['memory']['peak_bytes']:.3f}x, RSS "
            f"{b['peak_rss_bytes'] / a['peak_rss_bytes']:.3f}x (goal <= 1.1x)"
        )
    dj = [r["drjax"] for r in results.values() if "memory" in r["drjax"]]
    if len(dj) >= 2:
        lines.append(
            f"drjax growth: XLA peak {dj[-1]['memory']['peak_bytes'] / dj[0]['memory']['peak_bytes']:.1f}x"
        )
    if pair and "median_ratio" in pair:
        lines.append(
            f"time per client, side by side at {pair['clients']} clients: fcir/drjax median "
            f"{pair['median_ratio']:.3f} (min {pair['min_ratio']:.3f}, max {pair['max_ratio']:.3f}, "
            f"{len(pair['ratios'])} pairs; goal <= 1.2); max |diff| {pair['max_abs_diff']:.2e}"
        )
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny sizes, one repetition (CI)")
    p.add_argument("--clients", type=int, nargs="*", help="cohorts (default 256 1024 4096)")
    p.add_argument("--pair-clients", type=int, help="cohort of the side-by-side timing (256)")
    p.add_argument(
        "--reps", type=int, help="timed rounds per configuration (default 5; 256/n of it above 256)"
    )
    p.add_argument(
        "--max-gib", type=float, default=8.0, help="never run a predicted total over this"
    )
    p.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    p.add_argument("--worker", nargs=2, metavar=("PROGRAM", "N"), help=argparse.SUPPRESS)
    p.add_argument("--pair-worker", type=int, metavar="N", help=argparse.SUPPRESS)
    p.add_argument("--memory-worker", type=int, metavar="N", help=argparse.SUPPRESS)
    p.add_argument(
        "--no-memory-rows", action="store_true", help="skip the gradient and DP memory rows"
    )
    p.add_argument("--no-run", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def serve_worker(a: argparse.Namespace, cfg: dict, reps: int, max_bytes: int) -> bool:
    """In a worker process (``--worker``, ``--memory-worker``, ``--pair-worker``): does its
    one measurement and prints it on the protocol line. False in the driver."""
    if a.worker:
        out = worker(a.worker[0], int(a.worker[1]), cfg, reps, not a.no_run, max_bytes)
        print(PROTOCOL, json.dumps(out))
        return True
    if a.memory_worker:
        import jax

        mesh = jax.make_mesh((8,), ("clients",), axis_types=(jax.sharding.AxisType.Auto,))
        print(PROTOCOL, json.dumps(memory_rows(a.memory_worker, cfg, mesh)))
        return True
    if a.pair_worker:
        print(
            PROTOCOL, json.dumps(pair_worker(a.pair_worker, cfg, a.reps or (1 if a.smoke else 4)))
        )
        return True
    return False


def fits(probe: dict, max_bytes: int) -> bool:
    """Whether a compiled-only probe's predicted total is under the cap and under half of
    the memory free now."""
    return "memory" in probe and probe["memory"]["total_bytes"] <= min(max_bytes, free_bytes() // 2)


def measure_cohorts(clients: list[int], flags: list[str], cfg: dict, max_bytes: int) -> dict:
    """{n: {"fcir" | "drjax": worker record}}, each configuration in a fresh process."""
    results: dict = {}
    for n in clients:
        results[n] = {}
        for which in ("fcir", "drjax"):
            # DrJAX is compiled first alone; run only when its predicted total fits
            # under the cap and in what is free now.
            if which == "drjax":
                probe = spawn([*flags, "--worker", which, str(n), "--no-run"], 3600)
                if not fits(probe, max_bytes):
                    results[n][which] = {**probe, "ran": False, "label": "drjax (unchunked)"}
                    continue
            r = spawn([*flags, "--worker", which, str(n)], 3600)
            r["label"] = f"fcir k={cfg['k']}/dev" if which == "fcir" else "drjax (unchunked)"
            results[n][which] = r
            print(
                f"  {n} {which}: {json.dumps({k: v for k, v in r.items() if k != 'samples_s'})}",
                file=sys.stderr,
            )
    return results


def measure_pair(
    a: argparse.Namespace, results: dict, pair_n: int, flags: list[str], max_bytes: int
) -> dict:
    """The side-by-side timing at ``pair_n`` clients, or why it was skipped."""
    probe = results.get(pair_n, {}).get("drjax") or spawn(
        [*flags, "--worker", "drjax", str(pair_n), "--no-run"], 3600
    )
    if not fits(probe, max_bytes):
        return {"skipped": f"drjax at {pair_n} clients does not fit under the cap", **probe}
    pair_reps = a.reps or (1 if a.smoke else 4)  # alternating pairs
    return spawn([*flags, "--reps", str(pair_reps), "--pair-worker", str(pair_n)], 3600)


def param_count(cfg: dict) -> int:
    return cfg["d_in"] * cfg["hidden"] + cfg["hidden"] + cfg["hidden"] * cfg["d_out"] + cfg["d_out"]


def main(argv=None) -> int:
    a = parse_args(argv)
    cfg = SMOKE if a.smoke else FULL
    reps = a.reps or (1 if a.smoke else 5)
    max_bytes = int(a.max_gib * GIB)
    if serve_worker(a, cfg, reps, max_bytes):
        return 0

    clients = a.clients or ([16, 32] if a.smoke else [256, 1024, 4096])
    pair_n = a.pair_clients or (16 if a.smoke else 256)
    flags = ["--smoke"] if a.smoke else []
    flags += ["--reps", str(reps), "--max-gib", str(a.max_gib)]
    load_before = os.getloadavg()
    results = measure_cohorts(clients, flags, cfg, max_bytes)
    pair = measure_pair(a, results, pair_n, flags, max_bytes)
    params = param_count(cfg)
    text = table(results, pair, params)
    grad_rows = {}
    if not a.no_memory_rows:
        for n in clients:
            grad_rows[n] = spawn([*flags, "--memory-worker", str(n)], 3600)
        text += "\n\n" + memory_table(grad_rows)
    print(text)
    record = {
        "smoke": a.smoke,
        "config": cfg,
        "params": params,
        "devices": 8,
        "load_avg_before": load_before,
        "load_avg_after": os.getloadavg(),
        "versions": _record.versions("drjax"),
        **_record.machine(),
        "results": {str(n): r for n, r in results.items()},
        "pair": pair,
        "memory_rows": {str(n): r for n, r in grad_rows.items()},
        "table": text,
    }
    _record.write(a.out_dir, "streaming", record, "smoke" if a.smoke else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
