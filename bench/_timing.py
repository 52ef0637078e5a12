"""Side-by-side timing (see bench.md): each repetition runs every program once, back to
back, rotating which goes first, and a figure is a ratio taken per repetition."""

from __future__ import annotations

import statistics
import time


def synced(fn) -> float:  # type: ignore[no-untyped-def]
    """Seconds ``fn()`` takes, between two untimed os.sync() calls: each contender starts
    on a quiet disk and leaves nothing dirty for the next (a save's writes may still be
    in the page cache when it returns)."""
    import os

    os.sync()
    start = time.perf_counter()
    fn()
    elapsed = time.perf_counter() - start
    os.sync()
    return elapsed


def rotated(names: list[str], r: int) -> list[str]:
    """The order of repetition ``r``: ``names`` rotated by ``r`` places."""
    return names[r % len(names) :] + names[: r % len(names)]


def time_blocks(programs: dict, args, calls: int, reps: int, warmup: int) -> tuple[dict, dict]:
    """Wall and CPU seconds (this process, all threads) per call of each program: a block
    of ``calls`` calls per program per repetition, results awaited at the end of the
    block. Each program is called once first (compiles it, warms JAX's C++ caches), and
    the first ``warmup`` repetitions are not kept."""
    import jax

    names = list(programs)
    wall = {n: [] for n in names}
    cpu = {n: [] for n in names}
    for fn in programs.values():
        jax.block_until_ready(fn(*args))
    for r in range(warmup + reps):
        for name in rotated(names, r):
            fn = programs[name]
            w0, c0 = time.perf_counter(), time.process_time()
            for _ in range(calls):
                out = fn(*args)
            jax.block_until_ready(out)
            dw, dc = time.perf_counter() - w0, time.process_time() - c0
            if r >= warmup:
                wall[name].append(dw / calls)
                cpu[name].append(dc / calls)
    return wall, cpu


def ratio_stats(num: list[float], den: list[float]) -> dict:
    """The per-repetition ratios ``num[i] / den[i]``, their median, min and max."""
    ratios = [a / b for a, b in zip(num, den)]
    return {"ratios": ratios, "median": statistics.median(ratios), "min": min(ratios),
            "max": max(ratios)}  # fmt: skip


def format_ratio(s: dict) -> str:
    """A ``ratio_stats`` result as ``median [min a, max b]``, three decimals each."""
    return f"{s['median']:.3f} [min {s['min']:.3f}, max {s['max']:.3f}]"


def ratios(wall: dict, cpu: dict, num: str, dens, stats=ratio_stats) -> dict:
    """``stats`` of the per-repetition ratios ``num``/``den`` for each of ``dens``: of
    wall time (keys ``"num/den"``), then of CPU time (``"cpu num/den"``)."""
    return {
        f"{kind}{num}/{den}": stats(samples[num], samples[den])
        for kind, samples in (("", wall), ("cpu ", cpu))
        for den in dens
    }
