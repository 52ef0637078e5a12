"""The ServerApp of a whole training program: one Flower round per loop iteration.

plan.json's ``loop`` (written by fcir's interpreters/flower/loops.py) describes it:
``pre`` (server code before the loop) turns the program's server inputs into the loop's
server operands; each round runs the loop body as a round (``run_round``) on the
loop's consts, the carry and one slice of each ``xs``; its outputs feed the carry of the
next round and one slice of each ``ys``; a ``while_loop``'s ``cond`` decides at the
server, before each round, whether another one runs. ``post`` turns the loop's results
(the last carry, the ``ys`` stacked in iteration order as ``lax.scan`` stacks them) into
the program's results. The carry and the ``ys`` so far are checkpointed after each
round; a run started again resumes after the newest round saved.

A carry placed at the clients (per-client state: SCAFFOLD's control variates, Ditto's
personal models) never reaches the server. Each node keeps its own on disk
(client_app.py), under a key the server picks (``ClientState``) and its partition-id;
the server keeps only, per partition, the last round whose reply it aggregated in the
exchange that computes the state, and sends that table with every message: a node
enters round t with its state of that round (round 0: its initial value, the client
argument in its data file), so a node that missed rounds (not sampled, failed, its
reply lost or late) goes on from the last round it took part in, as the program would
compute with that node sitting those rounds out. The table is checkpointed with the
carry.
"""

from __future__ import annotations

import os
import time

import numpy as np

from . import runtime
from .runtime import AppError


def _round_view(plan: dict) -> dict:
    loop = plan["loop"]
    return {
        **plan,
        "server_inputs": loop["round_inputs"],
        "outputs": loop["round_outputs"],
        "output_order": list(range(len(loop["round_outputs"]))),
    }


def _metric(x) -> str:
    x = np.asarray(x).reshape(-1)
    return np.array2string(x[0], precision=6) if x.size == 1 else ""


class ClientState:
    """The server's side of the per-client state: where the nodes keep it (``key``: the
    app, and the run, or the checkpoint-dir when there is one, so that a run started
    again after a crash finds the state the nodes kept for the rounds it resumes
    after) and, per partition-id, the round whose state it enters the next round with
    (0, its initial value, when absent)."""

    def __init__(self, app: str, run_id, checkpoint_dir: str):
        import hashlib

        if checkpoint_dir:
            where = os.path.realpath(checkpoint_dir)
            self.key = f"{app[:16]}-ckpt-{hashlib.sha256(where.encode()).hexdigest()[:16]}"
        else:
            self.key = f"{app[:16]}-run-{run_id}"
        self.rounds: dict[str, int] = {}

    def message(self) -> str:
        import json

        return json.dumps({"key": self.key, "rounds": self.rounds}, sort_keys=True)

    def took_part(self, rnd: int, partitions) -> None:
        for p in partitions:
            self.rounds[str(int(p))] = rnd

    def meta(self) -> dict:
        import json

        return {"client_state": json.dumps(self.rounds, sort_keys=True)}

    def restore(self, meta: dict) -> None:
        import json

        saved = json.loads(str(meta.get("client_state", "{}")))
        self.rounds = {str(k): int(v) for k, v in saved.items()}


def _restore(ckpt, plan: dict, client_state=None):
    """(rounds done, carry by round parameter, ys so far) from the newest checkpoint."""
    step = ckpt.manager.latest_step()
    if step is None:
        return 0, None, None
    tree = ckpt.manager.restore(step)
    if tree["meta"]["app"] != ckpt.app:
        raise AppError(
            f"checkpoint {step} was written by another app (or another export of it): "
            "give a fresh checkpoint-dir"
        )
    if client_state is not None:
        client_state.restore(tree["meta"])
    loop = plan["loop"]
    specs = {s["leaf"]: s for s in loop["round_inputs"]}
    carry = {}
    for i, (_, r) in enumerate(loop["carry"]):
        s = specs[r]
        carry[r] = runtime.check_leaf(
            np.asarray(tree["state"][f"arr_{i}"]).reshape(s["shape"]),
            s,
            f"checkpoint {step} carry arr_{i}",
        )
    outs = loop["round_outputs"]
    ys = []
    for k, o in enumerate(o for kind, o in loop["results"] if kind == "stacked"):
        stacked = np.asarray(tree["outputs"][f"arr_{k}"]).reshape((step, *outs[o]["shape"]))
        ys.append([stacked[t] for t in range(step)])
    return step, carry, ys


def run(
    grid, cfg, plan: dict, inputs: list, ckpt, run_round, record=None, privacy=None, run_id=0
) -> list:
    """Runs the program; returns its outputs in output-file order."""
    loop = plan["loop"]
    state = None
    if loop.get("client_state"):
        state = ClientState(runtime.app_digest(), run_id, cfg.checkpoint_dir)
    cfg.client_state = state  # server_app.exchange sends it with every message
    view = _round_view(plan)
    env = {("arg", str(s["leaf"])): x for s, x in zip(plan["server_inputs"], inputs)}
    runtime.call(loop["pre"], env)
    pre = lambda j: env[("pre", str(j))]  # noqa: E731
    carry = {r: None for _, r in loop["carry"]}
    for s in loop["round_inputs"]:
        if s["role"] == "carry":
            carry[s["leaf"]] = pre(s["from"][1])
    stacked = [o for kind, o in loop["results"] if kind == "stacked"]
    ys: list[list] = [[] for _ in stacked]
    done = 0
    if ckpt is not None:
        done, restored, saved_ys = _restore(ckpt, plan, state)
        if restored is not None:
            carry, ys = restored, saved_ys
            print(f"[fcir] resuming after round {done} from {cfg.checkpoint_dir}", flush=True)
    length = loop["length"]
    total = f"/{length}" if loop["kind"] == "scan" else ""
    rnd = done
    while (t := _next_iteration(loop, env, carry, rnd)) is not None:
        inputs_t = _round_inputs(loop, carry, pre, t)
        stats = dict.fromkeys(("sent", "received", "sampled", "replied", "exchanges"), 0)
        start = time.perf_counter()
        outs = run_round(grid, cfg, view, inputs_t, rnd + 1, stats)
        took_part = None
        if state is not None:
            took_part = sorted(set(stats.get("state_partitions", ())))
            state.took_part(rnd + 1, took_part)
        for o, r in loop["carry"]:
            carry[r] = outs[o]
        for k, o in enumerate(stacked):
            ys[k].append(outs[o])
        rnd += 1
        if record is not None:  # scalar ys: the progress line's, MetricRecord, metrics-file
            scalars = {
                f"ys_{k}": float(np.asarray(outs[o]).reshape(-1)[0])
                for k, o in enumerate(stacked)
                if np.asarray(outs[o]).size == 1
            }
            record(rnd, scalars)
        extra = (privacy(rnd) if privacy else "",)
        line = _round_line(
            f"{rnd}{total}", stats, start, [outs[o] for o in stacked], took_part, extra
        )
        print(line, flush=True)
        if ckpt is not None:
            ckpt.save(
                rnd,
                [carry[r] for _, r in loop["carry"]],
                [np.stack(y) for y in ys],
                meta=state.meta() if state is not None else None,
            )
    if loop["kind"] == "scan" and rnd != length:
        raise AppError(f"ran {rnd} of {length} rounds")
    results = _loop_results(loop, carry, ys, stacked)
    penv = dict(env)
    penv.update({("loop", str(k)): v for k, v in enumerate(results) if v is not None})
    runtime.call(loop["post"], penv)
    outputs = [np.asarray(penv[("output", str(j))]) for j in range(len(plan["outputs"]))]
    return [outputs[j] for j in plan["output_order"]]


def _next_iteration(loop: dict, env: dict, carry: dict, rnd: int) -> int | None:
    """The loop iteration that round ``rnd`` (from 0) runs, or None when the loop is
    done: a scan's next slice (from the end for a reversed scan), a while loop's round
    while its condition, evaluated at the server on the carry, holds."""
    if loop["kind"] == "scan":
        length = loop["length"]
        if rnd >= length:
            return None
        return length - 1 - rnd if loop["reverse"] else rnd
    cenv = {("pre", k[1]): env[("pre", k[1])] for k in loop["cond"]["params"] if k[0] == "pre"}
    cenv.update({("round", str(r)): v for r, v in carry.items()})
    runtime.call(loop["cond"], cenv)
    return rnd if bool(np.asarray(cenv[("cond", "0")])) else None


def _round_inputs(loop: dict, carry: dict, pre, t: int) -> list:
    """The round's server inputs at iteration ``t``: the carry, slice ``t`` of each xs,
    and the loop's consts."""
    out = []
    for s in loop["round_inputs"]:
        if s["role"] == "carry":
            out.append(carry[s["leaf"]])
        elif s["role"] == "xs":
            out.append(np.asarray(pre(s["from"][1]))[t])
        else:
            out.append(pre(s["from"][1]))
    return out


def _round_line(rnd: str, stats: dict, start: float, ys: list, took_part, extra) -> str:
    """The progress line of a round: who replied, the bytes, the seconds, the scalar ys,
    whose client state advanced (``took_part``, None without client state), ``extra``."""
    metrics = " ".join(f"ys_{k}={m}" for k, y in enumerate(ys) if (m := _metric(y)))
    who = f"{stats['replied']}/{stats['sampled']} clients replied"
    if stats["exchanges"] > 1:
        who = (
            f"{stats['replied']}/{stats['sampled']} client replies over "
            f"{stats['exchanges']} exchanges"
        )
    kept = ""
    if took_part is not None:  # whose state advanced this round (on its node)
        kept = f"client state of partition(s) {','.join(map(str, took_part)) or 'none'}"
    return (
        f"[fcir] round {rnd}: {who}, sent {stats['sent']} B, received "
        f"{stats['received']} B, {time.perf_counter() - start:.1f} s "
        + " ".join(x for x in (metrics, kept, *extra) if x)
    )


def _loop_results(loop: dict, carry: dict, ys: list, stacked: list) -> list:
    """The loop's results: the last carry, and each ys stacked in iteration order (the
    clients' final state stays on the nodes: None)."""
    results = []
    outs_spec = loop["round_outputs"]
    for kind, x in loop["results"]:
        if kind == "client":  # the clients' final state: on the nodes, read by no server part
            results.append(None)
        elif kind == "carry":
            results.append(carry[x])
        else:
            y = ys[stacked.index(x)]
            if loop["kind"] == "scan" and loop["reverse"]:
                y = y[::-1]  # ys[t] is iteration t's slice, whichever way the scan ran
            shape = (len(y), *outs_spec[x]["shape"])
            results.append(
                np.stack(y) if y else np.zeros(shape, runtime.np_dtype(outs_spec[x]["dtype"]))
            )
    return results


def write(path: str, outputs: list) -> None:
    tmp = f"{path}.tmp-{os.getpid()}.npz"
    np.savez(tmp, *outputs)
    os.replace(tmp, path)
