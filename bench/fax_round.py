"""Rounds per second of the FAX-scale FedAvg round (368M parameters), fcir against DrJAX.

    python bench/fax_round.py [--clients 16 --steps 4 --batch 4 --reps 5]
    python bench/fax_round.py --smoke     # bench/scale.py's tiny model (CPU, seconds)

The round is bench/scale.py's ``scan`` form: the FedAvg round of
``tests/corpus/transformer.py`` at the FAX paper's 350M configuration (24 layers,
d=1024, ff=4096, vocab 32,000, seq 256: 368M parameters), each client ``--steps``
local SGD steps on ``--batch`` sequences. Both sides are compiled ahead of time on
the same arguments on the default device: ``xla.compile(fcir.capture(round))`` and
``jax.jit`` of the same round on DrJAX 0.2.1; each repetition times one round of
each, rotating which goes first, after a warm-up (``_timing.time_blocks``). Reported:
rounds per second and per hour, and fcir/drjax of the rounds per second per
repetition (median, min, max). bench/gpu.sh runs it on a GPU; JSON with every sample
in bench/results/fax_round[-smoke]-<time>.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import _record  # bench/, the script's own folder
import _timing
import scale

sys.path.insert(0, str(scale.ROOT / "tests"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny model, one repetition")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out-dir", default=str(scale.ROOT / "bench" / "results"))
    a = ap.parse_args()
    import drjax
    import jax
    from corpus import transformer
    from fcir.interpreters import xla

    import fcir

    model = scale.SMOKE_MODEL if a.smoke else scale.FAX_350M
    clients, steps, batch = (2, 1, 1) if a.smoke else (a.clients, a.steps, a.batch)
    reps = 1 if a.smoke else a.reps
    params, tokens = transformer.make_args(
        clients, vocab=model["vocab"], seq=model["seq"], d=model["d"],
        layers=model["layers"], local_steps=steps, batch=batch,
    )  # fmt: skip
    args = (params, tokens)
    n = scale.num_params(model)
    print(f"{n / 1e6:.1f}M parameters, {clients} clients x {steps} steps x {batch} sequences "
          f"on {jax.devices()[0].device_kind}", flush=True)  # fmt: skip
    t = time.perf_counter()
    fcir_exe = xla.compile(fcir.capture(scale.make_round("scan", clients, model, fcir), *args))
    programs = {"fcir": fcir_exe.compiled(*args)}
    programs["drjax"] = (
        jax.jit(scale.make_round("scan", clients, model, drjax)).lower(*args).compile()
    )
    print(f"compiled both in {time.perf_counter() - t:.1f} s", flush=True)
    wall, cpu = _timing.time_blocks(programs, args, calls=1, reps=reps, warmup=1)
    rps = {k: [1 / s for s in v] for k, v in wall.items()}
    ratio = _timing.ratio_stats(rps["fcir"], rps["drjax"])
    for k, v in rps.items():
        m = statistics.median(v)
        print(f"{k:<6} {m:10.3f} rounds/s  {m * 3600:10.0f} rounds/hour  (min {min(v):.3f}, "
              f"max {max(v):.3f})")  # fmt: skip
    print(f"fcir/drjax rounds/s: {_timing.format_ratio(ratio)} (goal >= 1.0)")
    _record.write(a.out_dir, "fax_round", {
        "smoke": a.smoke, "params": n, "model": model,
        "config": {"clients": clients, "steps": steps, "batch": batch, "reps": reps},
        "device": jax.devices()[0].device_kind, "seconds": wall, "cpu_seconds": cpu,
        "rounds_per_s": rps, "fcir/drjax": ratio, "versions": _record.versions("drjax"),
        **_record.machine(),
    }, "smoke" if a.smoke else None)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
