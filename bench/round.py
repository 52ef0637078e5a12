"""FedAvg round benchmark: fcir's XLA backend vs DrJAX vs hand-written jit(vmap).

    python bench/round.py            # full run: 8 and 64 clients, 15 repetitions
    python bench/round.py --quick    # smoke mode (tiny model, 8 clients, one repetition;
                                     # --smoke is the same, as in bench/scale.py)

Part 1, on 8 simulated CPU devices with the clients sharded over a ``clients`` mesh
axis: one FedAvg round of the small transformer language model of
``tests/corpus/transformer.py``, written once and run three ways, interleaved in one
run (after a warm-up, each repetition times A, B and C back to back, rotating which
goes first):

- ``fcir``: ``xla.compile(fcir.capture(round), mesh=mesh)``;
- ``drjax``: the same round built on ``drjax`` 0.2.1, ``jax.jit`` under ``jax.set_mesh``;
- ``limit``: the computation hand-written as ``jax.jit`` of ``jax.vmap(client_update,
  in_axes=(None, 0))`` and a mean; the best a federated framework can hope for.

All three get the same arguments, already laid out (model replicated, client tokens
sharded over ``clients``), and run as ahead-of-time compiled executables. Reported:
median times, and the median, min/max and IQR of the per-repetition ratios
fcir/drjax (goal <= 1.0) and fcir/limit (goal <= 1.02).

Part 1b, the call path (what a user calls, not an AOT executable): per-call time of
``exe(*args)`` vs ``jax.jit`` of the DrJAX round vs ``jax.jit`` of the fcir program
itself, each warmed up, called in blocks (the three blocks back to back per
repetition, rotating which goes first; median of >= 5 repetitions, ratios per
repetition). Measured on a tiny round (8 clients, f32[4], one device,
2,000 calls per block) and on the transformer rounds of part 1 on the mesh.

Part 2: the fcir round with 16 clients on 2 processes × 4 devices (``jax.distributed``
on localhost, gloo collectives) vs 1 process × 8 devices: persistent worker processes
that time one round per request, driven alternately (A, B, A, B ...). Reported only.

Results: a table on stdout and JSON with every raw sample, versions and the core count
in bench/results/round[-quick]-<time>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import socket
import statistics
import subprocess
import sys
import time

# Simulated devices must be set before jax is imported (the workers set their own).
if "--worker" not in sys.argv and "xla_force_host_platform_device_count" not in os.environ.get(
    "XLA_FLAGS", ""
):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import _record  # bench/, the script's own folder
import _timing

FULL = {
    "vocab": 128,
    "seq": 32,
    "d": 64,
    "layers": 2,
    "heads": 4,
    "local_steps": 2,
    "batch": 2,
}
QUICK = {"vocab": 16, "seq": 4, "d": 8, "layers": 1, "heads": 2, "local_steps": 1, "batch": 1}
PROTOCOL = "FCIR-BENCH"  # prefix of the workers' protocol lines on stdout


# --- the three programs ------------------------------------------------------------------


def build_programs(num_clients: int, cfg: dict, mesh):
    """``{"fcir": f, "drjax": f, "limit": f}``, each ``f(params, tokens)`` a compiled
    round, and the laid-out arguments."""
    import drjax
    import jax
    import jax.numpy as jnp
    from corpus import transformer
    from fcir.interpreters import xla
    from jax.sharding import NamedSharding, PartitionSpec

    import fcir

    params, tokens = transformer.make_args(
        num_clients,
        vocab=cfg["vocab"],
        seq=cfg["seq"],
        d=cfg["d"],
        layers=cfg["layers"],
        local_steps=cfg["local_steps"],
        batch=cfg["batch"],
    )
    params = jax.device_put(params, NamedSharding(mesh, PartitionSpec()))
    tokens = jax.device_put(tokens, NamedSharding(mesh, PartitionSpec("clients")))
    args = (params, tokens)
    lr, heads = transformer.LR, cfg["heads"]

    fcir_round = transformer.make_round(num_clients, lr=lr, num_heads=heads, api=fcir)
    exe = xla.compile(fcir.capture(fcir_round, *args), mesh=mesh)
    exe.compiled(*args)

    drjax_round = transformer.make_round(num_clients, lr=lr, num_heads=heads, api=drjax)
    with jax.set_mesh(mesh):
        drjax_compiled = jax.jit(drjax_round).lower(*args).compile()

    def update(p, t):
        return transformer.client_update(p, t, lr, heads)

    def limit_round(params, tokens):
        deltas, losses = jax.vmap(update, in_axes=(None, 0))(params, tokens)
        new = jax.tree.map(lambda p, d: p + jnp.mean(d, axis=0), params, deltas)
        return new, jnp.mean(losses)

    limit_compiled = jax.jit(limit_round).lower(*args).compile()
    programs = {"fcir": exe, "drjax": drjax_compiled, "limit": limit_compiled}
    return programs, args


def hlo_instructions(compiled) -> list[str]:
    """The optimized HLO's instructions with names and metadata erased: equal lists
    mean the same executable up to naming."""
    import re

    text = compiled.as_text()
    text = re.sub(r", metadata=\{[^}]*\}", "", text)
    text = re.sub(r"%[\w.\-]+", "%v", text)
    return [line.strip() for line in text.splitlines() if " = " in line]


def same_hlo(programs, args) -> dict:
    base = hlo_instructions(programs["fcir"].compiled(*args))
    return {name: hlo_instructions(fn) == base for name, fn in programs.items() if name != "fcir"}


def check_agreement(programs, args) -> dict:
    """Max |difference| of each program's outputs from fcir's (they compute the same)."""
    import jax
    import numpy as np

    ref = jax.tree.leaves(programs["fcir"](*args))
    out = {}
    for name, fn in programs.items():
        leaves = jax.tree.leaves(fn(*args))
        out[name] = max(
            float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))
            for a, b in zip(leaves, ref)
        )
    return out


def time_interleaved(programs: dict, args, reps: int, warmup: int, budget_s: float) -> tuple:
    """Wall and CPU seconds (this process, all threads) per call, A, B, C back to back
    each repetition, rotating the first. At least ``reps`` repetitions, more for short
    rounds (up to ``budget_s`` of timing, 200 repetitions)."""
    import jax

    names = list(programs)
    wall = {n: [] for n in names}
    cpu = {n: [] for n in names}
    r, target = 0, reps
    while r < warmup + target:
        for name in _timing.rotated(names, r):
            w0, c0 = time.perf_counter(), time.process_time()
            jax.block_until_ready(programs[name](*args))
            dw, dc = time.perf_counter() - w0, time.process_time() - c0
            if r >= warmup:
                wall[name].append(dw)
                cpu[name].append(dc)
        if r == warmup:  # the first timed repetition sizes the run
            per_rep = sum(w[-1] for w in wall.values())
            target = max(reps, min(int(budget_s / per_rep), 200))
        r += 1
    return wall, cpu


def ratio_stats(num: list[float], den: list[float]) -> dict:
    """``_timing.ratio_stats`` and the interquartile range of the ratios."""
    stats = _timing.ratio_stats(num, den)
    ratios = stats["ratios"]
    q = statistics.quantiles(ratios, n=4) if len(ratios) >= 2 else [ratios[0]] * 3
    return {**stats, "iqr": [q[0], q[2]]}


def bench_single_process(
    clients: list[int], cfg: dict, reps: int, warmup: int, budget_s: float
) -> dict:
    import jax

    mesh = jax.make_mesh((8,), ("clients",), axis_types=(jax.sharding.AxisType.Auto,))
    out = {}
    for n in clients:
        t0 = time.perf_counter()
        programs, args = build_programs(n, cfg, mesh)
        compile_s = time.perf_counter() - t0
        agreement = check_agreement(programs, args)
        hlo = same_hlo(programs, args)
        samples, cpu = time_interleaved(programs, args, reps, warmup, budget_s)
        out[str(n)] = {
            "compile_s": compile_s,
            "max_abs_diff_from_fcir": agreement,
            "optimized_hlo_same_as_fcir": hlo,
            "samples_s": samples,
            "cpu_samples_s": cpu,
            **_timing.ratios(samples, cpu, "fcir", ("drjax", "limit"), ratio_stats),
        }
    return out


# --- part 1b: the call path --------------------------------------------------------------


def tiny_programs():
    """The tiny round (8 clients, f32[4]) three ways, as a user calls them, one device."""
    import drjax
    import jax
    import jax.numpy as jnp
    from fcir.interpreters import xla

    import fcir

    def make(api):
        @api.program(placements={"clients": 8})
        def tiny_round(w, x):
            deltas = api.map_fn(lambda w, x: w * x - 1.0, (api.broadcast(w), x))
            return w + api.reduce_mean(deltas)

        return tiny_round

    args = (jnp.arange(4, dtype=jnp.float32), jnp.ones((8, 4), jnp.float32))
    programs = {
        "fcir": xla.compile(fcir.capture(make(fcir), *args)),
        "drjax_jit": jax.jit(make(drjax)),
        "fcir_jit": jax.jit(make(fcir)),
    }
    return programs, args


def call_programs(num_clients: int, cfg: dict, mesh, args):
    """The transformer round as a user calls it: the executable and two jax.jit's."""
    import drjax
    import jax
    from corpus import transformer
    from fcir.interpreters import xla

    import fcir

    lr, heads = transformer.LR, cfg["heads"]
    fcir_round = transformer.make_round(num_clients, lr=lr, num_heads=heads, api=fcir)
    drjax_round = transformer.make_round(num_clients, lr=lr, num_heads=heads, api=drjax)
    return {
        "fcir": xla.compile(fcir.capture(fcir_round, *args), mesh=mesh),
        "drjax_jit": jax.jit(drjax_round),
        "fcir_jit": jax.jit(fcir_round),
    }


def time_calls(programs: dict, args, calls: int, reps: int, warmup: int) -> dict:
    """Seconds per call, wall and CPU: a block of ``calls`` calls per program per
    repetition (results awaited at the end of the block), rotating the first."""
    wall, cpu = _timing.time_blocks(programs, args, calls, reps, warmup)
    return {
        "calls_per_block": calls,
        "samples_s": wall,
        "cpu_samples_s": cpu,
        **_timing.ratios(wall, cpu, "fcir", ("drjax_jit", "fcir_jit"), ratio_stats),
    }


def bench_call_path(clients: list[int], cfg: dict, reps: int, warmup: int, quick: bool) -> dict:
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    out = {}
    programs, args = tiny_programs()
    out["tiny (8 clients, f32[4], 1 device)"] = time_calls(
        programs, args, 50 if quick else 2000, reps, warmup
    )
    mesh = jax.make_mesh((8,), ("clients",), axis_types=(jax.sharding.AxisType.Auto,))
    from corpus import transformer

    for n in clients:
        params, tokens = transformer.make_args(
            n, **{k: cfg[k] for k in ("vocab", "seq", "d", "layers", "local_steps", "batch")}
        )
        params = jax.device_put(params, NamedSharding(mesh, PartitionSpec()))
        tokens = jax.device_put(tokens, NamedSharding(mesh, PartitionSpec("clients")))
        args = (params, tokens)
        # DrJAX's jit adds its constraints for the mesh in context: all three run in it.
        with jax.set_mesh(mesh):
            programs = call_programs(n, cfg, mesh, args)
            out[f"transformer, {n} clients, 8 devices"] = time_calls(
                programs, args, 1 if quick else 5, reps, warmup
            )
    return out


# --- part 2: processes -------------------------------------------------------------------


def worker(a) -> int:
    """One process of a persistent round server: prints READY, then times one round
    per ``run`` line read from stdin until ``quit``."""
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "")
        + f" --xla_force_host_platform_device_count={a.local_devices}"
    )
    import jax

    if a.num_processes > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            a.coordinator,
            num_processes=a.num_processes,
            process_id=a.process_id,
            initialization_timeout=120,
        )
    import numpy as np
    from corpus import transformer
    from fcir.interpreters import xla
    from jax.sharding import NamedSharding, PartitionSpec

    import fcir

    cfg = json.loads(a.config)
    mesh = jax.make_mesh(
        (jax.device_count(),), ("clients",), axis_types=(jax.sharding.AxisType.Auto,)
    )
    n = a.process_clients
    params, tokens = transformer.make_args(
        n, **{k: cfg[k] for k in ("vocab", "seq", "d", "layers", "local_steps", "batch")}
    )
    # Every process holds the same host arrays; device_put keeps its own shards.
    params, tokens = jax.tree.map(np.asarray, (params, tokens))
    params = jax.device_put(params, NamedSharding(mesh, PartitionSpec()))
    tokens = jax.device_put(tokens, NamedSharding(mesh, PartitionSpec("clients")))
    fcir_round = transformer.make_round(n, lr=transformer.LR, num_heads=cfg["heads"], api=fcir)
    exe = xla.compile(fcir.capture(fcir_round, params, tokens), mesh=mesh)
    jax.block_until_ready(exe(params, tokens))
    print(f"{PROTOCOL} READY {jax.process_count()} {jax.device_count()}", flush=True)
    for line in sys.stdin:
        if line.strip() != "run":
            break
        w0, c0 = time.perf_counter(), time.process_time()
        jax.block_until_ready(exe(params, tokens))
        dw, dc = time.perf_counter() - w0, time.process_time() - c0
        print(f"{PROTOCOL} TIME {dw!r} {dc!r}", flush=True)
    if a.num_processes > 1:
        jax.distributed.shutdown()
    return 0


class _Group:
    """Worker processes that run one round together on each request."""

    def __init__(self, num_processes: int, local_devices: int, clients: int, cfg: dict):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
        self.procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    __file__,
                    "--worker",
                    f"--process-id={i}",
                    f"--num-processes={num_processes}",
                    f"--local-devices={local_devices}",
                    f"--coordinator=127.0.0.1:{port}",
                    f"--process-clients={clients}",
                    f"--config={json.dumps(cfg)}",
                ],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
                env=env,
            )
            for i in range(num_processes)
        ]

    def _read(self, proc, what: str) -> list[str]:
        for line in proc.stdout:
            if line.startswith(PROTOCOL):
                fields = line.split()[1:]
                if fields[0] == what:
                    return fields[1:]
        raise RuntimeError(f"a worker exited (code {proc.wait()}) before sending {what}")

    def ready(self) -> None:
        for p in self.procs:
            self._read(p, "READY")

    def run(self) -> tuple[float, float]:
        """(wall seconds of the slowest process, CPU seconds of all processes)."""
        for p in self.procs:
            p.stdin.write("run\n")
            p.stdin.flush()
        times = [[float(t) for t in self._read(p, "TIME")] for p in self.procs]
        return max(w for w, _ in times), sum(c for _, c in times)

    def close(self) -> None:
        for p in self.procs:
            try:
                p.stdin.write("quit\n")
                p.stdin.close()
            except OSError:
                pass
        for p in self.procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()


def bench_processes(clients: int, cfg: dict, reps: int, warmup: int) -> dict:
    one = _Group(1, 8, clients, cfg)
    two = _Group(2, 4, clients, cfg)
    try:
        one.ready()
        two.ready()
        samples = {"1x8": [], "2x4": []}
        cpu = {"1x8": [], "2x4": []}
        for r in range(warmup + reps):
            pair = [("1x8", one), ("2x4", two)]
            for name, group in pair if r % 2 == 0 else pair[::-1]:
                dw, dc = group.run()
                if r >= warmup:
                    samples[name].append(dw)
                    cpu[name].append(dc)
    finally:
        one.close()
        two.close()
    return {
        "clients": clients,
        "samples_s": samples,
        "cpu_samples_s": cpu,
        **_timing.ratios(samples, cpu, "2x4", ("1x8",), ratio_stats),
    }


# --- report ------------------------------------------------------------------------------


def _ms(xs: list[float]) -> str:
    return f"{statistics.median(xs) * 1e3:9.1f}"


def _ratio(s: dict) -> str:
    return (
        f"{s['median']:.3f} [min {s['min']:.3f}, max {s['max']:.3f}; "
        f"IQR {s['iqr'][0]:.3f}-{s['iqr'][1]:.3f}]"
    )


def _us(xs: list[float]) -> str:
    return f"{statistics.median(xs) * 1e6:10.1f}"


def _rows(table: dict, label: str, cell, cols: tuple[str, str, str], cpu_title: str) -> list[str]:
    """A line per row of ``table`` (its name formatted by ``label``): the median of each
    of ``cols`` and the ratios of the first to the other two; wall time, then the same
    lines for CPU time under ``cpu_title``."""
    lines = []
    for samples, cpu in (("samples_s", ""), ("cpu_samples_s", "cpu ")):
        if cpu:
            lines.append(cpu_title)
        for name, row in table.items():
            cells = " ".join(cell(row[samples][c]) for c in cols)
            first, second = (_ratio(row[f"{cpu}{cols[0]}/{c}"]) for c in cols[1:])
            lines.append(f"  {name:{label}} {cells}   {first:<46} {second}")
    return lines


def report_calls(calls: dict, reps: int) -> list[str]:
    lines = [
        "",
        f"call path: exe(*args) vs jax.jit (median of >= {reps} blocks, us per call; "
        "ratios per block: median [min, max; IQR])",
        f"  {'round':38} {'fcir exe':>10} {'drjax jit':>10} {'fcir jit':>10}   "
        f"{'fcir/drjax_jit (goal <= 1.1)':<46} fcir/fcir_jit",
    ]
    cpu_title = "  CPU time of this process, same blocks:"
    return lines + _rows(calls, "38", _us, ("fcir", "drjax_jit", "fcir_jit"), cpu_title)


def report(single: dict, procs: dict | None, reps: int, calls: dict | None = None) -> str:
    lines = [
        (
            f"FedAvg round, transformer LM, 8 CPU devices, clients sharded "
            f"(median of >= {reps}, ms; ratios per repetition: median [min, max; IQR])"
        ),
        (
            f"  {'clients':>7} {'fcir':>9} {'drjax':>9} {'limit':>9}   "
            f"{'fcir/drjax (goal <= 1.0)':<46} fcir/limit (goal <= 1.02)"
        ),
    ]
    cpu_title = "  CPU time of this process (less sensitive to other load), same pairs:"
    lines += _rows(single, ">7", _ms, ("fcir", "drjax", "limit"), cpu_title)
    for n, row in single.items():
        same = [k for k, v in row["optimized_hlo_same_as_fcir"].items() if v]
        diff = row["max_abs_diff_from_fcir"]
        lines.append(
            f"  {n} clients: optimized HLO identical to fcir's (up to names): "
            f"{', '.join(same) or 'none'}; max |output - fcir| "
            + ", ".join(f"{k} {v:.1e}" for k, v in diff.items() if k != "fcir")
        )
    if calls:
        lines += report_calls(calls, reps)
    if procs is not None:
        s = procs["samples_s"]
        lines += [
            "",
            f"multi-process, fcir round with {procs['clients']} clients (median of {reps}, ms)",
            (
                f"  1 process x 8 devices {_ms(s['1x8'])}   2 processes x 4 devices "
                f"{_ms(s['2x4'])}   2x4/1x8 = {_ratio(procs['2x4/1x8'])}"
            ),
            (
                f"  CPU time (all processes)  {_ms(procs['cpu_samples_s']['1x8'])} vs "
                f"{_ms(procs['cpu_samples_s']['2x4'])}   2x4/1x8 = "
                f"{_ratio(procs['cpu 2x4/1x8'])}"
            ),
        ]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--quick", "--smoke", action="store_true", help="tiny model, 8 clients, one repetition"
    )
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--budget", type=float, default=20.0, help="seconds of timing per client count")
    ap.add_argument("--clients", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--process-clients", type=int, default=16)
    ap.add_argument("--no-processes", action="store_true", help="skip part 2")
    ap.add_argument("--no-calls", action="store_true", help="skip part 1b (the call path)")
    ap.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--process-id", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--num-processes", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--local-devices", type=int, default=8, help=argparse.SUPPRESS)
    ap.add_argument("--coordinator", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--config", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        return worker(a)

    import jax

    cfg = QUICK if a.quick else FULL
    reps, warmup = (1, 1) if a.quick else (a.reps, a.warmup)
    clients = [8] if a.quick else a.clients
    started = time.time()
    load = [os.getloadavg()]
    single = bench_single_process(clients, cfg, reps, warmup, 0.0 if a.quick else a.budget)
    call_reps = reps if a.quick else max(reps, 5)
    calls = None if a.no_calls else bench_call_path(clients, cfg, call_reps, warmup, a.quick)
    procs = None if a.no_processes else bench_processes(a.process_clients, cfg, reps, warmup)
    load.append(os.getloadavg())
    print(report(single, procs, reps, calls))
    print(f"load average (1, 5, 15 min) before: {load[0]}, after: {load[1]}")

    result = {
        "config": {
            **cfg,
            "clients": clients,
            "min_reps": reps,
            "warmup": warmup,
            "budget_s": a.budget,
        },
        "single_process": single,
        "call_path": calls,
        "processes": procs,
        "load_average": load,
        "versions": _record.versions("drjax"),
        **_record.machine(),
        "devices": jax.device_count(),
        "quick": a.quick,
        "wall_s": time.time() - started,
    }
    _record.write(a.out_dir, "round", result, "quick" if a.quick else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
