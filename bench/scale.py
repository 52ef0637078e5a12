"""FAX-scale benchmark: capture + lower of a 368M-parameter FedAvg round, and the cost
of a round at the FAX paper's three configurations.

    python bench/scale.py            # full: 5 pairs of fresh processes per form, FAX sizes
    python bench/scale.py --smoke    # tiny model, one pair per form (CI: seconds)

Part 1, capture + lower, first call in a fresh process. The round is the FedAvg round
of ``tests/corpus/transformer.py`` (24 layers, d=1024, ff=4096, vocab 32,000, seq 256:
368M parameters) over 2,048 clients, on abstract ``jax.ShapeDtypeStruct`` arguments,
so nothing is allocated or run. The layer stack comes in two forms, each measured:
``scan``, the corpus model (per-layer weights stacked, applied by ``lax.scan``), and
``unrolled``, the same model with one parameter dict per layer applied by a Python
loop, as many flax and hand-written models are (24 copies of the block in the jaxpr,
~7,000 ops). Each sample is one fresh Python process that imports everything, then
times

- ``fcir``: ``m = fcir.capture(round, *specs)`` then ``xla.compile(m).lower(*specs)``;
- ``drjax``: the same round on ``drjax`` 0.2.1: ``jax.make_jaxpr(round)(*specs)`` then
  ``jax.jit(round).lower(*specs)``.

Pairs of processes run one after the other, alternating which side (and, between
pairs, which form) goes first. Reported per form: wall and CPU seconds per side, and
per pair the ratio fcir/drjax (goal <= 1.2 for both forms): median [min, max] over the
pairs, for the total and for each step alone.

Part 2, one round's cost at the FAX paper's configurations (2,048 clients with a
~350M model, 512 with ~1B, 128 with ~8B; 16,384 tokens per client = 16 local steps of
4 sequences of 256 tokens). FLOPs per round, each defined:

- ``6·N·tokens``: the usual training estimate, 2 FLOPs per parameter per token forward
  and 4 backward (N counts every parameter, embeddings included);
- ``XLA``: XLA's cost analysis (HLO before optimization, 2 FLOPs per multiply-add,
  attention included) of one local step, lowered on abstract arguments with the layer
  loop unrolled (XLA counts a loop body once), times steps and clients, plus the
  server's mean and update from the fcir cost report's server part (lowered, not
  compiled: nothing runs);
- the paper's own figures (3.355e7 tokens, 2.293e13 FLOPs; 8.389e6, 1.638e13; 2.097e6,
  3.277e13). Those FLOPs equal 2·N·tokens/1024 for N = 350M, 1B, 8B exactly, i.e. the
  forward FLOPs of one token per 1,024; the table prints that identity next to them.

Results: a table on stdout and JSON with every raw sample, versions, the core count
and the load average in bench/results/scale[-smoke]-<time>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import _record  # bench/, the script's own folder
import _timing

TOKENS_PER_CLIENT = 16_384
STEPS, BATCH = 16, 4  # local steps x sequences per step x SEQ = TOKENS_PER_CLIENT

# name: model (vocab, d, layers, ff, heads, seq) and clients per round.
FAX_350M = {"vocab": 32_000, "d": 1024, "layers": 24, "ff": 4096, "heads": 16, "seq": 256}
CONFIGS = {
    "350M": {"model": FAX_350M, "clients": 2048},
    "1B": {"model": {**FAX_350M, "d": 2048, "layers": 18, "ff": 8192}, "clients": 512},
    "8B": {
        "model": {**FAX_350M, "d": 4096, "layers": 38, "ff": 16384, "heads": 32},
        "clients": 128,
    },
}
# The FAX paper's per-round figures: (nominal parameters, tokens, FLOPs).
PAPER = {"350M": (350e6, 3.355e7, 2.293e13), "1B": (1e9, 8.389e6, 1.638e13),
         "8B": (8e9, 2.097e6, 3.277e13)}  # fmt: skip

SMOKE_MODEL = {"vocab": 64, "d": 16, "layers": 2, "ff": 32, "heads": 2, "seq": 8}
SMOKE = {
    "350M": {"model": SMOKE_MODEL, "clients": 8},
    "1B": {"model": {**SMOKE_MODEL, "d": 32, "ff": 64}, "clients": 4},
    "8B": {"model": {**SMOKE_MODEL, "d": 64, "ff": 128}, "clients": 2},
}
SMOKE_STEPS, SMOKE_BATCH = 2, 2


# --- the round on abstract arguments -----------------------------------------------------


def param_specs(model: dict, form: str = "scan") -> dict:
    """ShapeDtypeStructs of ``transformer.init_params`` at this size (nothing allocated).

    ``form="scan"``: per-layer weights stacked on a leading layers axis (the corpus
    model's ``lax.scan``); ``"unrolled"``: a list of one dict per layer, as flax and
    hand-written models hold them (applied by a Python loop)."""
    import jax
    import jax.numpy as jnp

    v, d, n, f, s = (model[k] for k in ("vocab", "d", "layers", "ff", "seq"))

    def spec(*shape):
        return jax.ShapeDtypeStruct(shape, jnp.float32)

    def layer(*lead):
        return {
            "ln1_scale": spec(*lead, d), "ln1_bias": spec(*lead, d),
            "wqkv": spec(*lead, d, 3 * d), "wo": spec(*lead, d, d),
            "ln2_scale": spec(*lead, d), "ln2_bias": spec(*lead, d),
            "w_in": spec(*lead, d, f), "b_in": spec(*lead, f),
            "w_out": spec(*lead, f, d), "b_out": spec(*lead, d),
        }  # fmt: skip

    return {
        "embed": spec(v, d),
        "pos": spec(s, d),
        "layers": layer(n) if form == "scan" else [layer() for _ in range(n)],
        "ln_f_scale": spec(d),
        "ln_f_bias": spec(d),
        "unembed": spec(d, v),
    }


def round_specs(model: dict, clients: int, steps: int, batch: int, form: str = "scan"):
    import jax
    import jax.numpy as jnp

    tokens = jax.ShapeDtypeStruct((clients, steps, batch, model["seq"] + 1), jnp.int32)
    return param_specs(model, form), tokens


def num_params(model: dict) -> int:
    import jax
    import numpy as np

    return int(sum(np.prod(s.shape) for s in jax.tree.leaves(param_specs(model))))


FORMS = ("unrolled", "scan")


def unrolled_loss(params, tokens, heads: int):
    """Next-token cross-entropy of ``transformer.logits_fn`` (its layers a list of
    per-layer dicts: a Python loop), as the unrolled round has always traced it: the
    negation after the mean (``transformer.loss_fn`` negates before it)."""
    import jax
    import jax.numpy as jnp
    from corpus import transformer

    logp = jax.nn.log_softmax(transformer.logits_fn(params, tokens[:, :-1], heads), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))


def make_round(form: str, clients: int, model: dict, api):
    """The FedAvg round of ``tests/corpus/transformer.py`` on ``api`` (fcir or drjax):
    ``"scan"`` is the corpus round itself; ``"unrolled"`` the same model with its
    layers applied by a Python loop over per-layer parameters (``logits_fn`` of a
    list). The unrolled round keeps its own loss and client update, which trace a few
    ops in another order than the corpus round's, so that its jaxpr (what part 1
    times) stays the one docs/backends/xla.md's figures were measured on."""
    import jax
    import jax.numpy as jnp
    from corpus import transformer

    heads, lr = model["heads"], transformer.LR
    if form == "scan":
        return transformer.make_round(clients, lr=lr, num_heads=heads, api=api)

    def client_update(params, batches):
        def step(p, tokens):
            value, grads = jax.value_and_grad(unrolled_loss)(p, tokens, heads)
            return jax.tree.map(lambda w, g: w - lr * g, p, grads), value

        trained, losses = jax.lax.scan(step, params, batches)
        return jax.tree.map(lambda new, old: new - old, trained, params), jnp.mean(losses)

    return transformer.fedavg_program(
        clients, client_update, api=api, name="fedavg_transformer_unrolled"
    )


# --- part 1: one fresh process per sample ------------------------------------------------


def worker(side: str, form: str, model: dict, clients: int, steps: int, batch: int) -> dict:
    """Times capture and lower on ``side`` in this (fresh) process; imports come first."""
    import drjax
    import jax
    from fcir.interpreters import xla

    import fcir

    specs = round_specs(model, clients, steps, batch, form)
    fn = make_round(form, clients, model, fcir if side == "fcir" else drjax)
    w0, c0 = time.perf_counter(), time.process_time()
    if side == "fcir":
        module = fcir.capture(fn, *specs)
    else:
        jax.make_jaxpr(fn)(*specs)
    w1, c1 = time.perf_counter(), time.process_time()
    if side == "fcir":
        xla.compile(module).lower(*specs)
    else:
        jax.jit(fn).lower(*specs)
    w2, c2 = time.perf_counter(), time.process_time()
    return {
        "capture_s": w1 - w0, "lower_s": w2 - w1, "total_s": w2 - w0,
        "capture_cpu_s": c1 - c0, "lower_cpu_s": c2 - c1, "total_cpu_s": c2 - c0,
    }  # fmt: skip


def run_worker(side: str, form: str, model: dict, clients: int, steps: int, batch: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    config = json.dumps(
        {"form": form, "model": model, "clients": clients, "steps": steps, "batch": batch}
    )
    out = subprocess.run(
        [sys.executable, __file__, "--worker", side, "--config", config],
        env=env, capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    for line in out.stdout.splitlines():
        if line.startswith("FCIR-SCALE "):
            return json.loads(line.removeprefix("FCIR-SCALE "))
    raise RuntimeError(f"{side} worker failed (code {out.returncode}):\n{out.stderr[-3000:]}")


def bench_lowering(model: dict, clients: int, steps: int, batch: int, pairs: int) -> dict:
    """Per layer-stack form: ``pairs`` pairs of fresh processes, alternating which side
    goes first (and, between pairs, which form)."""
    samples = {form: {"fcir": [], "drjax": []} for form in FORMS}
    for i in range(pairs):
        for form in FORMS if i % 2 == 0 else FORMS[::-1]:
            for side in ("fcir", "drjax") if i % 2 == 0 else ("drjax", "fcir"):
                samples[form][side].append(run_worker(side, form, model, clients, steps, batch))
    out = {}
    for form in FORMS:
        s = samples[form]
        ratios = {
            key: _timing.ratio_stats([x[key] for x in s["fcir"]], [x[key] for x in s["drjax"]])
            for key in ("total_s", "lower_s", "capture_s", "total_cpu_s", "lower_cpu_s")
        }
        out[form] = {"samples": s, "fcir/drjax": ratios}
    return out


# --- part 2: cost of a round -------------------------------------------------------------


def step_flops(model: dict, batch: int) -> float:
    """XLA's flops of one SGD step of one client, the layer loop unrolled (XLA counts a
    loop body once): the stacked weights sliced into one dict per layer, each as the
    loop reaches it."""
    import jax
    from corpus import transformer

    def loss(params, tokens):
        stacked = params["layers"]
        layers = (jax.tree.map(lambda w, i=i: w[i], stacked) for i in range(model["layers"]))
        return unrolled_loss({**params, "layers": layers}, tokens, model["heads"])

    def step(params, tokens):
        grads = jax.grad(loss)(params, tokens)
        return jax.tree.map(lambda w, g: w - transformer.LR * g, params, grads)

    params, tokens = round_specs(model, 1, 1, batch)
    one = jax.ShapeDtypeStruct(tokens.shape[2:], tokens.dtype)
    return float(_flops(jax.jit(step).lower(params, one).cost_analysis()))


def server_flops(model: dict, clients: int) -> float:
    """The server's part of the fcir round (mean of the deltas, the update), from the
    fcir cost report's lowering of ``main`` with its ``fed.map`` replaced by zeros."""
    from corpus import transformer
    from fcir.interpreters.xla import cost

    import fcir

    specs = round_specs(model, clients, 1, 1)
    fn = transformer.make_round(clients, lr=transformer.LR, num_heads=model["heads"], api=fcir)
    module = fcir.capture(fn, *specs)
    return float(cost.own_flops(module, module.main.body))


def _flops(analysis) -> float:
    if isinstance(analysis, (list, tuple)):
        analysis = analysis[0]
    return analysis.get("flops", 0.0)


def cost_table(configs: dict, steps: int, batch: int) -> list[dict]:
    rows = []
    for name, c in configs.items():
        model, clients = c["model"], c["clients"]
        n = num_params(model)
        tokens_per_client = steps * batch * model["seq"]
        tokens = clients * tokens_per_client
        xla_flops = clients * steps * step_flops(model, batch) + server_flops(model, clients)
        paper_n, paper_tokens, paper_flops = PAPER[name]
        rows.append({
            "config": name, "clients": clients, "params": n, "model": model,
            "tokens_per_client": tokens_per_client, "tokens": tokens,
            "flops_6nd": 6.0 * n * tokens, "flops_xla": xla_flops,
            "paper_tokens": paper_tokens, "paper_flops": paper_flops,
            "paper_2nd_over_1024": 2.0 * paper_n * paper_tokens / 1024,
        })  # fmt: skip
    return rows


# --- report ------------------------------------------------------------------------------


_ratio = _timing.format_ratio


def report(lowering: dict, table: list[dict], pairs: int, load: list) -> str:
    lines = [
        f"capture + lower, first call in a fresh process ({pairs} pairs per form, alternating "
        "order; seconds, median; fcir/drjax per pair: median [min, max])"
    ]
    for form in FORMS:
        s, r = lowering[form]["samples"], lowering[form]["fcir/drjax"]

        def med(side, key, s=s):
            return statistics.median(x[key] for x in s[side])

        lines += [
            f"  layers as {'a Python loop' if form == 'unrolled' else 'a lax.scan'} ({form}):",
            f"    {'':8} {'capture':>8} {'lower':>8} {'total':>8} {'CPU total':>10}",
        ]
        for side in ("fcir", "drjax"):
            lines.append(
                f"    {side:8} {med(side, 'capture_s'):8.3f} {med(side, 'lower_s'):8.3f} "
                f"{med(side, 'total_s'):8.3f} {med(side, 'total_cpu_s'):10.3f}"
            )
        lines += [
            f"    fcir/drjax total {_ratio(r['total_s'])}  (goal <= 1.2)",
            f"    fcir/drjax lower {_ratio(r['lower_s'])}, capture {_ratio(r['capture_s'])}",
            f"    fcir/drjax CPU   total {_ratio(r['total_cpu_s'])}, "
            f"lower {_ratio(r['lower_cpu_s'])}",
        ]
    lines += [
        f"  load average (1, 5, 15 min) before: {load[0]}, after: {load[1]}",
        "",
        "one round (tokens per round; FLOPs: 6NT = 6 x params x tokens, XLA = cost analysis",
        "of the lowered local step x steps x clients + server; paper = FAX's figure, which",
        "equals 2 x N_nominal x tokens / 1024)",
        f"  {'config':6} {'clients':>7} {'params':>9} {'tokens':>10} {'paper tok':>10} "
        f"{'6NT':>10} {'XLA':>10} {'paper':>10} {'2NT/1024':>10}",
    ]
    for row in table:
        lines.append(
            f"  {row['config']:6} {row['clients']:7d} {row['params']:9.3e} {row['tokens']:10.3e} "
            f"{row['paper_tokens']:10.3e} {row['flops_6nd']:10.3e} {row['flops_xla']:10.3e} "
            f"{row['paper_flops']:10.3e} {row['paper_2nd_over_1024']:10.3e}"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny models, one pair (CI)")
    ap.add_argument("--pairs", type=int, default=5, help="pairs of fresh processes per form (>= 5)")
    ap.add_argument("--no-table", action="store_true", help="skip part 2")
    ap.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--worker", choices=("fcir", "drjax"), help=argparse.SUPPRESS)
    ap.add_argument("--config", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        c = json.loads(a.config)
        result = worker(a.worker, c["form"], c["model"], c["clients"], c["steps"], c["batch"])
        print("FCIR-SCALE " + json.dumps(result), flush=True)
        return 0

    configs = SMOKE if a.smoke else CONFIGS
    steps, batch = (SMOKE_STEPS, SMOKE_BATCH) if a.smoke else (STEPS, BATCH)
    pairs = 1 if a.smoke else a.pairs
    big = configs["350M"]
    started = time.time()
    load = [os.getloadavg()]
    lowering = bench_lowering(big["model"], big["clients"], steps, batch, pairs)
    load.append(os.getloadavg())
    table = [] if a.no_table else cost_table(configs, steps, batch)
    print(report(lowering, table, pairs, [tuple(round(x, 2) for x in v) for v in load]))

    result = {
        "config": {"configs": configs, "steps": steps, "batch": batch, "pairs": pairs},
        "lowering": lowering,
        "cost_table": table,
        "load_average": load,
        "versions": _record.versions("drjax"),
        **_record.machine(),
        "smoke": a.smoke,
        "wall_s": time.time() - started,
    }
    _record.write(a.out_dir, "scale", result, "smoke" if a.smoke else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
