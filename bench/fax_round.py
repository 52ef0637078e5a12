"""The FAX-scale FedAvg round (368M parameters) streamed at growing cohorts, against a
hand-written streamed round and DrJAX.

    python bench/fax_round.py [--cohorts 16,64,256 --steps 4 --batch 4 --reps 5]
    python bench/fax_round.py --smoke     # bench/scale.py's tiny model (CPU, seconds)

The round is bench/scale.py's ``scan`` form: the FedAvg round of
``tests/corpus/transformer.py`` at the FAX paper's 350M configuration (24 layers,
d=1024, ff=4096, vocab 32,000, seq 256: 368M parameters), each client ``--steps``
local SGD steps on ``--batch`` sequences. Per cohort, on the default device:

- ``fcir``: ``xla.compile(fcir.capture(round), clients_per_step=k)``; at the first
  cohort ``k="auto"`` (the largest k the device's memory holds, chosen by compiling
  k = 1, 2, ...: docs/backends/streaming.md), at the larger ones the k chosen there
  (what a step holds depends on k, not on the cohort);
- ``hand-written``: the same round written by hand as streaming writes it, a
  ``lax.scan`` over chunks of k clients, each chunk ``jax.vmap``'d, summing the
  clients' deltas and losses, under ``jax.jit`` (k must divide the cohort);
- ``drjax``: the round on DrJAX 0.2.1 under ``jax.jit``, every client at once, at the
  first cohort only (on one TPU v5e it does not fit 16 clients: a compile that fails is
  not worth repeating at 64 and 256).

A program that runs out of the device's memory (compiling, as a TPU's compiler
refuses it, or running) is recorded as ``out of memory`` with the bytes it asked for,
and the run goes on. Each repetition times one round of each program, rotating which
goes first, after one untimed call (``_timing.time_blocks``); the larger cohorts get
fewer repetitions (``--reps`` x first cohort / cohort, at least 2). ``--deadline-s``:
a cohort that would not end before that many seconds since the start (estimated from
the cohort before) is not started, and is recorded as cut. Reported per cohort and
program: rounds per second and per hour, TFLOP/s (the round's flops counted from its
HLO by ``exe.cost()``'s ``flops_per_call``, and the ``6·N·tokens`` estimate),
XLA's temporaries and predicted peak per device; fcir/hand-written and fcir/drjax of
rounds per second per repetition (median, min, max). JSON with every sample in
bench/results/fax_round[-smoke]-<time>.json, written after each cohort.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time

import _record  # bench/, the script's own folder
import _timing
import scale

sys.path.insert(0, str(scale.ROOT / "tests"))

GIB = 2**30


def hand_round(clients: int, k: int, model: dict):
    """The FedAvg round streamed by hand: ``lax.scan`` over chunks of ``k`` vmapped
    clients, the deltas and losses summed, their means applied."""
    import jax
    import jax.numpy as jnp
    from corpus import transformer

    update = functools.partial(
        transformer.client_update, lr=transformer.LR, num_heads=model["heads"]
    )

    def round_(params, tokens):
        chunks = tokens.reshape(clients // k, k, *tokens.shape[1:])

        def chunk(sums, tokens_k):
            deltas, losses = jax.vmap(update, in_axes=(None, 0))(params, tokens_k)
            return jax.tree.map(lambda s, d: s + d.sum(0), sums, (deltas, losses)), None

        zero = jax.tree.map(jnp.zeros_like, (params, jnp.float32(0)))
        (delta, loss), _ = jax.lax.scan(chunk, zero, chunks)
        return jax.tree.map(lambda p, d: p + d / clients, params, delta), loss / clients

    return round_


def compile_or_oom(make) -> tuple[object, dict]:
    """``make()`` (a compiled program), and what to record of it: its memory, or that
    it ran out of the device's memory."""
    t = time.perf_counter()
    try:
        compiled = make()
    except Exception as e:
        if (record := _record.out_of_memory(e)) is None:
            raise
        return None, {**record, "compile_s": time.perf_counter() - t}
    m = compiled.memory_analysis()
    peak = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
    return compiled, {
        "status": "ok",
        "compile_s": time.perf_counter() - t,
        "temp_bytes": int(m.temp_size_in_bytes),
        "peak_bytes": int(peak - m.alias_size_in_bytes),
    }


def programs_at(clients: int, k, model: dict, args, drjax: bool) -> tuple[dict, dict]:
    """The compiled programs at one cohort (name: callable; fcir's is its Executable)
    and what to record of each; DrJAX's only if ``drjax``."""
    import drjax as drjax_api
    import jax
    from fcir.interpreters import xla

    import fcir

    module = fcir.capture(scale.make_round("scan", clients, model, fcir), *args)
    made: list = []

    def fcir_program():  # with "auto", xla.compile compiles its candidates itself
        made.append(xla.compile(module, clients_per_step=k))
        return made[0].compiled(*args)

    programs, records = {}, {}
    compiled, records["fcir"] = compile_or_oom(fcir_program)
    exe = made[0] if compiled is not None else None
    records["fcir"]["streaming"] = exe.streaming if exe else None
    if exe is not None:
        programs["fcir"] = exe
    chosen = exe.streaming["clients_per_step"] if exe else None
    if isinstance(chosen, int) and clients % chosen == 0:
        jitted = jax.jit(hand_round(clients, chosen, model))
        programs["hand-written"], records["hand-written"] = compile_or_oom(
            lambda: jitted.lower(*args).compile()
        )
        records["hand-written"]["k"] = chosen
    else:
        why = f"k={chosen} does not divide the cohort" if exe else "fcir did not compile"
        records["hand-written"] = {"status": "not run", "reason": why}
    if drjax:
        jitted = jax.jit(scale.make_round("scan", clients, model, drjax_api))
        programs["drjax"], records["drjax"] = compile_or_oom(lambda: jitted.lower(*args).compile())
    else:
        records["drjax"] = {"status": "not run", "reason": "measured at the first cohort only"}
    return {n: p for n, p in programs.items() if p is not None}, records


def compiles(records: dict) -> int:
    """How many programs a cohort compiled (the auto search's candidates each count)."""
    streaming = records["fcir"].get("streaming") or {}
    tried = len(streaming.get("candidates", {})) + len(streaming.get("out_of_memory", {}))
    others = sum(records[n]["status"] != "not run" for n in ("hand-written", "drjax"))
    return max(1, tried if streaming.get("mode") == "auto" else 1) + others


def round_flops(exe, args, clients: int, first: dict | None) -> tuple[float, dict]:
    """The round's flops from its HLO (``exe.cost()``'s ``flops_per_call``), and what
    gives them at another cohort: counted at the first (lowering the member's update
    alone costs seconds at this size), the members' share scaled with the cohort after."""
    if first is None:
        cost = exe.cost(*args)
        first = {"clients": clients, "server": cost["server"]["flops"],
                 "all": cost["flops_per_call"]}  # fmt: skip
    members = (first["all"] - first["server"]) * clients / first["clients"]
    return first["server"] + members, first


def time_cohort(programs: dict, records: dict, args, reps: int, flops, six_n: float) -> dict:
    """Times the programs side by side; fills in their rates (every program computes the
    same round: ``flops``, counted from fcir's HLO, or None; ``six_n``: 6·N·tokens).
    Returns the ratios."""
    wall, _ = _timing.time_blocks(programs, args, calls=1, reps=reps, warmup=0)
    for name, seconds in wall.items():
        median = statistics.median(seconds)
        records[name].update(
            seconds=seconds,
            rounds_per_s=1 / median,
            rounds_per_hour=3600 / median,
            tflops_hlo=None if flops is None else flops / median / 1e12,
            tflops_6n=six_n / median / 1e12,
        )
    rps = {name: [1 / s for s in seconds] for name, seconds in wall.items()}
    return {
        f"fcir/{other}": _timing.ratio_stats(rps["fcir"], rps[other])
        for other in ("hand-written", "drjax")
        if "fcir" in rps and other in rps
    }


def print_cohort(clients: int, records: dict, ratios: dict) -> None:
    for name, r in records.items():
        k = r.get("k") or (r.get("streaming") or {}).get("clients_per_step", "-")
        if r["status"] != "ok":
            what = _record.describe(r) if r["status"] == "out of memory" else r["status"]
            print(f"{clients:>7}  {name:<13} {k!s:>4}  {what}: {r.get('reason', '')}")
            continue
        tf = "-" if r.get("tflops_hlo") is None else f"{r['tflops_hlo']:.1f}"
        print(f"{clients:>7}  {name:<13} {k!s:>4}  {r['rounds_per_s']:9.3f} "
              f"{r['rounds_per_hour']:11,.0f} {tf:>10} {r['tflops_6n']:9.1f} "
              f"{r['temp_bytes'] / GIB:9.2f} {r['peak_bytes'] / GIB:9.2f}")  # fmt: skip
    for key, s in ratios.items():
        goal = " (goal >= 0.95)" if key == "fcir/hand-written" else ""
        print(f"{clients:>7}  {key} rounds/s: {_timing.format_ratio(s)}{goal}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny model, one repetition")
    ap.add_argument("--cohorts", default="16,64,256", help="comma-separated client counts")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--deadline-s", type=float, help="start no cohort that would end later")
    ap.add_argument("--out-dir", default=str(scale.ROOT / "bench" / "results"))
    a = ap.parse_args()
    return run(a, time.perf_counter())


def run(a, start: float) -> int:
    import jax
    import numpy as np
    from corpus import transformer

    model = scale.SMOKE_MODEL if a.smoke else scale.FAX_350M
    cohorts = [1, 2] if a.smoke else [int(c) for c in a.cohorts.split(",")]
    steps, batch = (1, 1) if a.smoke else (a.steps, a.batch)
    reps = 1 if a.smoke else a.reps
    n = scale.num_params(model)
    device = jax.devices()[0].device_kind
    print(f"{n / 1e6:.1f}M parameters, {steps} steps x {batch} sequences a client, on {device}")
    print(f"{'clients':>7}  {'system':<13} {'k':>4}  {'rounds/s':>9} {'rounds/hour':>11} "
          f"{'TFLOP/s':>10} {'(6N/tok)':>9} {'temp GiB':>9} {'peak GiB':>9}", flush=True)  # fmt: skip
    result = {
        "smoke": a.smoke, "params": n, "model": model, "device": device,
        "config": {"cohorts": cohorts, "steps": steps, "batch": batch, "reps": reps},
        "cohorts": {}, "versions": _record.versions("drjax"), **_record.machine(),
    }  # fmt: skip
    path, k, last, first, params = None, "auto", None, None, None
    tag = "smoke" if a.smoke else None
    seq_vocab = (model["seq"], model["vocab"])
    for clients in cohorts:
        if last is not None and a.deadline_s is not None:
            # From the cohort before: seconds per compile (the next compiles two: fcir at
            # its k, the hand-written round) and its rounds' seconds, scaled by the cohort.
            before, per_compile, running = last
            estimate = 2 * per_compile + running * clients / before
            if time.perf_counter() - start + estimate > a.deadline_s:
                result["cohorts"][str(clients)] = {"status": "cut", "reason": "time limit"}
                print(f"{clients:>7}  cut: would not end within {a.deadline_s:.0f} s", flush=True)
                path = _record.write(a.out_dir, "fax_round", result, tag, path)
                continue
        t = time.perf_counter()
        programs = args = None  # the cohort before's: off the device before this one's
        if params is None:  # one model for every cohort (368M parameters: 1.5 GB)
            params, _ = transformer.make_args(
                1, vocab=model["vocab"], seq=model["seq"], d=model["d"],
                layers=model["layers"], local_steps=steps, batch=batch,
            )  # fmt: skip
        shape = (clients, steps, batch)
        args = (params, transformer.make_tokens(np.random.default_rng(0), shape, *seq_vocab))
        programs, records = programs_at(clients, k, model, args, clients == cohorts[0])
        flops = None
        if "fcir" in programs:
            flops, first = round_flops(programs["fcir"], args, clients, first)
            records["fcir"]["flops_per_call"] = flops
        compiling = time.perf_counter() - t
        cohort_reps = 1 if a.smoke else max(2, reps * cohorts[0] // clients)
        six_n = 6 * n * clients * steps * batch * model["seq"]
        ratios = time_cohort(programs, records, args, cohort_reps, flops, six_n) if programs else {}
        chosen = (records["fcir"].get("streaming") or {}).get("clients_per_step")
        k = chosen if isinstance(chosen, int) else k
        print_cohort(clients, records, ratios)
        result["cohorts"][str(clients)] = {"programs": records, "ratios": ratios}
        last = (clients, compiling / compiles(records), time.perf_counter() - t - compiling)
        path = _record.write(a.out_dir, "fax_round", result, tag, path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
