"""The ServerApp: the round's server parts, participation, aggregation and training loop.

Run config (declared in pyproject.toml, overridden with ``flwr run --run-config``);
the sampling keys are Flower's FedAvg's, with its defaults and meanings:

``num-server-rounds=N`` run the round N times (default 1)
``fraction-train=F``    sample ``max(int(F * online nodes), min-train-nodes)`` nodes
                        for each exchange (default 1.0)
``min-train-nodes=M``   at least M nodes sampled (default 2); fewer than M replies fail
                        the round (fcir's addition: Flower would aggregate them)
``min-available-nodes=A``  wait (up to ``timeout``) until max(A, the sample size) nodes
                        are online (default 2)
``fraction-evaluate=F``, ``min-evaluate-nodes=M``
                        the same for an evaluate stage (defaults 1.0 and 2)
``inputs=FILE``         the server's inputs, an ``.npz`` in ``fcir run-plan --inputs``
                        layout with the server leaves only; default: the app's inputs.json
``output=FILE``         where to write the final outputs (``fcir run-plan -o`` layout);
                        default ``final_model.npz``, relative paths from the ServerApp's
                        working directory; ``none``: not written
``state="I=O,..."``     after each round, output ``arr_O`` becomes server input ``arr_I``
                        for the next (positions in the output and inputs files); default
                        with several rounds: outputs of a server input's pytree path and
                        type (printed), refused when there are none; ``none``: no mapping
``metrics="O,..."``     outputs logged each round (default: every scalar output that is
                        not state)
``checkpoint-dir=DIR``  save the server inputs of the next round after each round with
                        fcir.checkpoint; a run started again resumes from the newest one
``clients=K``           sample exactly K nodes instead (fcir's; 0: by fraction-train)
``timeout=T``           seconds to wait for the replies of one exchange
``secagg=true|false``   secure sums through Flower's SecAgg+ (default), or summed by
                        the ServerApp in the clear (fewer round trips; same result)
``max-epsilon=E``       a private app's privacy budget (fcir.privacy.Budget at the
                        plan's delta, for the sampling used): the run stops before the
                        round that would take cumulative epsilon past E, writes the
                        outputs of the rounds that ran, and checkpoints the budget spent

fcir's earlier names (``rounds``, ``fraction``, ``min-clients``) are refused, naming
Flower's (runtime.RENAMED_RUN_CONFIG).

Aggregations run over the clients that replied (an error reply or no reply within
``timeout`` leaves a client out); fewer than ``min-train-nodes`` replies fail the round
before anything of it is saved, and so do fewer than an exchange's ``min_replies``
(plan.json: the ``min_clients`` of its distributed DP releases, the fewest replies its
robust aggregates are defined for; ``min_replies_why`` says which).

Messages (a plain exchange) follow Flower's layout: the server sends ``arrays`` (an
ArrayRecord of the values the clients need, keyed ``group/name``), ``config`` (a
ConfigRecord with ``server-round``) and ``fcir`` (a ConfigRecord: ``step``, the
exchange of the round, and ``client-state`` for a program with per-client state); a
client replies with ``arrays`` (its client outputs, keyed ``group/name``), ``metrics``
(a MetricRecord with ``num-examples``) and ``fcir`` (a ConfigRecord: ``partition-id``).
"""

from __future__ import annotations

import json
import math
import os
import random
import time

import numpy as np
from flwr.app import ConfigRecord, Message, RecordDict
from flwr.serverapp import ServerApp

from . import evaluation, program, runtime, secagg, training
from .runtime import AppError

app = ServerApp()


def boolean(value) -> bool:
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    if not isinstance(value, bool):
        raise ValueError(value)
    return value


class Config:
    def __init__(self, rc: dict, plan: dict):
        def get(key, kind):
            try:
                return kind(rc[key])
            except (KeyError, TypeError, ValueError):
                raise AppError(f"run config {key}={rc.get(key)!r}: expected {kind.__name__}") from None

        runtime.refuse_renamed(rc)
        self.rounds = get("num-server-rounds", int)
        self.output = output_path(get("output", str))
        self.inputs = get("inputs", str)
        self.checkpoint_dir = get("checkpoint-dir", str)
        self.fraction = get("fraction-train", float)
        self.fraction_evaluate = get("fraction-evaluate", float)
        self.clients = get("clients", int)
        self.min_clients = get("min-train-nodes", int)
        self.min_evaluate = get("min-evaluate-nodes", int)
        self.min_available = get("min-available-nodes", int)
        self.timeout = get("timeout", float)
        self.secagg = get("secagg", boolean)
        self.metrics_file = get("metrics-file", str)
        self.max_epsilon = _max_epsilon(rc.get("max-epsilon", ""))
        try:
            if "loop" in plan:  # the program's loop carries its own state
                if get("state", str).strip() or self.rounds != 1:
                    raise training.StateError(
                        f"@{plan['round']} runs its own {plan['loop']['kind']} of rounds: "
                        "run config num-server-rounds and state do not apply"
                    )
                self.state, self.state_note = {}, ""
            else:
                self.state, self.state_note = training.resolve(get("state", str), plan, self.rounds)
        except training.StateError as e:
            raise AppError(str(e)) from None
        # A private round sampled by fraction is Poisson-sampled with secret randomness,
        # which is what amplification by sampling (the epsilon on the progress line) needs.
        self.private = "privacy" in plan
        if self.max_epsilon is not None and not self.private:
            raise AppError(
                f"run config max-epsilon={self.max_epsilon:g}: @{plan['round']} has no DP ops "
                "(not a private program), so it has no privacy budget to spend: drop "
                "max-epsilon, or capture a private=True program with fcir.dp_mean/dp_sum"
            )
        if self.max_epsilon is not None and "loop" in plan:
            raise AppError(
                f"run config max-epsilon: @{plan['round']} runs its own "
                f"{plan['loop']['kind']} of rounds, which a budget cannot cut short: export "
                "the round and run it with num-server-rounds=N max-epsilon=E"
            )
        if self.private and self.rounds > 1:
            fixed_keys(plan, self.state)
        self.poisson = self.private and self.clients == 0 and self.fraction < 1
        self.sampled: dict[int, list[int]] = {}
        metrics = get("metrics", str)
        if metrics.strip():
            self.metrics = [int(m) for m in metrics.replace(";", ",").split(",") if m.strip()]
        else:
            outs = [plan["outputs"][j] for j in plan["output_order"]]
            used = set(self.state.values())
            self.metrics = [
                o for o, s in enumerate(outs) if o not in used and math.prod(s["shape"]) == 1
            ]
        if self.rounds < 1 or not 0 < self.fraction <= 1 or self.timeout <= 0:
            raise AppError(
                "run config: num-server-rounds >= 1, 0 < fraction-train <= 1 and timeout > 0"
            )
        if not 0 <= self.fraction_evaluate <= 1:
            raise AppError("run config: 0 <= fraction-evaluate <= 1")
        if min(self.min_clients, self.min_evaluate, self.min_available, self.clients) < 0:
            raise AppError(
                "run config: min-train-nodes, min-evaluate-nodes, min-available-nodes and "
                "clients are >= 0"
            )


def output_path(value: str) -> str:
    """Run config ``output``: where the final outputs go, "" when nowhere (``none``).
    The default, Flower's template's ``final_model`` name, and any relative path are
    taken from the ServerApp's working directory (the line that says it was written
    gives the absolute path)."""
    value = value.strip()
    if value.lower() == "none":
        return ""
    return os.path.abspath(value or FINAL_MODEL)


FINAL_MODEL = "final_model.npz"


def fixed_keys(plan: dict, state: dict[int, int]) -> None:
    """Refuses, before round 1, a private app run for several rounds whose DP release
    draws its noise from a key that depends on no state-fed server input (plan.json's
    privacy ``keys``, from fcir.privacy.keys.key_arguments at export): every other server
    input, and every client input, is the same in every round, so the key and the noise
    are too, and the difference of two rounds' releases is noise-free, while the
    accountant composes the rounds as independent releases."""
    k = training.fixed_key(plan, state)
    if k is not None:
        raise AppError(
            f"@{plan['round']}'s {k['op']} (clip_norm={k['clip_norm']:g}, "
            f"noise_multiplier={k['noise_multiplier']:g}) draws its noise from a key that "
            "depends on no state-fed server input, so its key is the same every round: "
            "the rounds would release the same noise, which their epsilon does not "
            "allow. Make the round number state and fold it into the key "
            "((model, r, key, data) -> (model, r + 1) with jax.random.fold_in(key, r), "
            "as examples/dp_flower_training.py does), or run num-server-rounds=1 per run with a "
            "fresh key"
        )


def _max_epsilon(value) -> float | None:
    """Run config max-epsilon: "" (the default) for no budget, else a number > 0."""
    if isinstance(value, str) and not value.strip():
        return None
    try:
        eps = math.nan if isinstance(value, bool) else float(value)
    except (TypeError, ValueError):
        eps = math.nan
    if not (eps > 0 and math.isfinite(eps)):
        raise AppError(f"run config max-epsilon={value!r}: expected a finite number > 0")
    return eps


def initial_inputs(cfg: Config, plan: dict) -> list:
    specs = plan["server_inputs"]
    if cfg.inputs:
        return runtime.load_leaves(cfg.inputs, specs, "run config inputs")
    embedded = runtime.embedded_inputs()
    if embedded is None:
        if specs:
            raise AppError(
                f"@{plan['round']} takes {len(specs)} server input(s) "
                f"({', '.join(s['type'] for s in specs)}): give them with --run-config "
                "'inputs=\"/abs/path/inputs.npz\"' or export with --inputs"
            )
        return []
    return [runtime.check_leaf(x, s, f"inputs.json arr_{i}") for i, (x, s) in enumerate(zip(embedded, specs))]


def sample(grid, cfg: Config, rnd: int, stage: str = "train") -> list[int]:
    """The nodes of round ``rnd``'s ``stage`` ("train" or "evaluate"), as Flower's
    FedAvg samples them: ``max(int(fraction * online), minimum)`` nodes (or ``clients``
    nodes), once ``max(min-available-nodes, that size)`` are online, waiting up to
    ``timeout`` for them (Flower waits forever). Seeded by the round, so a run is
    repeatable; a private app's fraction sample is Poisson (see Config)."""
    fraction, least = (
        (cfg.fraction_evaluate, cfg.min_evaluate) if stage == "evaluate" else (cfg.fraction, cfg.min_clients)
    )
    deadline = time.monotonic() + cfg.timeout
    while True:
        nodes = sorted(grid.get_node_ids())
        want = cfg.clients if cfg.clients > 0 else max(int(fraction * len(nodes)), least)
        if cfg.poisson and stage == "train":
            want = least
        need = max(cfg.min_available, want)
        if len(nodes) >= need:
            break
        if time.monotonic() > deadline:
            raise AppError(
                f"round {rnd}: {len(nodes)} node(s) online after {cfg.timeout:g} s, "
                f"{need} needed (min-available-nodes={cfg.min_available}, "
                f"{'min-evaluate-nodes' if stage == 'evaluate' else 'min-train-nodes'}={least}"
                f"{f', clients={cfg.clients}' if cfg.clients > 0 else ''}): start more "
                "SuperNodes or lower them"
            )
        time.sleep(1.0)
    if cfg.poisson and stage == "train":  # each online node independently with probability fraction, once a round
        if rnd not in cfg.sampled:
            cfg.sampled[rnd] = [n for n in nodes if _SECRET.random() < cfg.fraction]
        return sorted(cfg.sampled[rnd])
    return sorted(random.Random(rnd).sample(nodes, min(want, len(nodes))))


_SECRET = random.SystemRandom()


class Accounting:
    """Cumulative epsilon of a private app's rounds for the sampling the ServerApp uses
    (fcir.privacy.epsilon on the round the export embedded in plan.json): Poisson at rate
    ``fraction`` when it samples so, else every client (a fixed-size or seeded sample
    claims no amplification)."""

    def __init__(self, plan: dict, cfg: Config):
        self.module, self.note = None, ""
        self.budget = None
        p = plan.get("privacy") or {}
        if not p or "ir" not in p or "error" in p:
            if cfg.max_epsilon is not None:
                raise AppError(
                    f"run config max-epsilon: plan.json states no round to account "
                    f"({p.get('error', 'no privacy entry')})"
                )
            return
        try:
            from fcir.ir.text import parse
            from fcir.privacy import Budget, epsilon
        except ImportError:
            self.note = "epsilon needs fcir beside the SuperLink"
            if cfg.max_epsilon is not None:
                raise AppError(
                    "run config max-epsilon needs fcir installed beside the SuperLink"
                ) from None
            return
        self.epsilon, self.module, self.delta = epsilon, parse(p["ir"]), float(p["delta"])
        self.rate = cfg.fraction if cfg.poisson else 1.0
        if cfg.poisson:
            self.how = f"Poisson sampling q={cfg.fraction:g}"
        elif cfg.clients > 0 or cfg.fraction < 1:
            self.how = "no amplification claimed: fixed-size sampling"
        else:
            self.how = "every client"
        from fcir.errors import PrivacyError  # fcir is optional beside the SuperLink: see above

        try:  # refused at this sampling (fed.ddp_* under Poisson): say so before round 1
            epsilon(self.module, 1, self.delta, sampling_rate=self.rate)
        except PrivacyError as e:
            raise AppError(f"{self.how}: {e}") from None
        if cfg.max_epsilon is not None:
            self.budget = Budget(self.module, self.delta, cfg.max_epsilon, sampling_rate=self.rate)

    def resume(self, state: dict | None, done: int) -> None:
        """Continues the budget a checkpoint after round ``done`` saved (its rounds count,
        under this run's max-epsilon); one saved without a budget spent ``done`` rounds."""
        if self.budget is None or not done:
            return
        from fcir.privacy import Budget  # fcir is optional beside the SuperLink

        if state is None:  # an earlier run without max-epsilon: done rounds, this sampling
            state = {**self.budget.state(), "rounds": done}
        if (state.get("delta"), state.get("sampling_rate")) != (self.delta, self.rate):
            raise AppError(
                f"checkpoint: its {state.get('rounds')} round(s) were accounted at "
                f"delta={state.get('delta')}, sampling rate {state.get('sampling_rate')}; this "
                f"run samples at {self.rate:g} ({self.how}): resume with the same fraction "
                "and clients, or give a fresh checkpoint-dir"
            )
        self.budget = Budget.from_state(
            self.module, {**state, "max_epsilon": self.budget.max_epsilon}
        )

    def stop_before(self, rnd: int) -> str:
        """Why round ``rnd`` must not run (its epsilon would pass max-epsilon), or ""."""
        if self.budget is None or self.budget.can_spend():
            return ""
        b = self.budget
        return (
            f"stopping before round {rnd}: it would bring epsilon to {b.epsilon_after():.4g}, "
            f"past max-epsilon={b.max_epsilon:g} (delta={self.delta:g}, {self.how}); ran "
            f"{b.rounds} round(s), epsilon={b.epsilon:.4g} spent"
        )

    def line(self, rounds: int) -> str:
        if self.module is None:
            return self.note
        eps = self.epsilon(self.module, rounds, self.delta, sampling_rate=self.rate)
        return f"epsilon={eps:.4g} after {rounds} round(s) (delta={self.delta:g}, {self.how})"


def exchange(grid, cfg, step_index: int, step: dict, env: dict, rnd: int, stats: dict) -> None:
    values = {f"{dst[0]}/{dst[1]}": env[tuple(src)] for src, dst in step["send"]}
    nodes = sample(grid, cfg, rnd)
    stats["sent"] += sum(np.asarray(v).nbytes for v in values.values()) * len(nodes)
    aggregations, results = step["aggregations"], {}
    extra = client_state_config(cfg)
    if cfg.secagg and runtime.secure_inputs(step):
        replies, errors, results, received = secagg.exchange(
            grid, nodes, step_index, step, values, rnd, cfg.timeout, extra
        )
        stats["received"] += received
        aggregations = [a for a in aggregations if not runtime.is_secure_sum(a)]
    else:
        replies, errors = plain_exchange(grid, cfg, step_index, values, nodes, rnd, stats, extra)
    if step.get("state"):  # the clients whose state of this round the server counts
        stats.setdefault("state_partitions", []).extend(p for (p, _), _ in replies)
    # Floating-point sums depend on their order: aggregate in partition-id order (node
    # id among equals), not in the order replies happen to arrive.
    replies = [out for _, out in sorted(replies, key=lambda r: r[0])]
    silent = len(nodes) - len(replies) - len(errors)
    stats["sampled"] += len(nodes)
    stats["exchanges"] += 1
    stats["replied"] += len(replies)
    for e in errors:
        print(f"[fcir] round {rnd}: client failed, left out: {e}", flush=True)
    if len(replies) < cfg.min_clients:
        why = "; ".join(errors) + (f"; {silent} did not answer in {cfg.timeout:g} s" if silent > 0 else "")
        raise AppError(
            f"round {rnd}: {len(replies)} of {len(nodes)} sampled clients replied, "
            f"min-train-nodes={cfg.min_clients}: {why.strip('; ')}"
        )
    need = step.get("min_replies", 0)
    if len(replies) < need:
        # A distributed DP release's clients added the noise for min_clients shares (a sum
        # of fewer carries less noise than the accountant assumed); a robust aggregate
        # (Bulyan) is not defined over fewer: nothing of the round is released.
        raise AppError(
            f"round {rnd}: {len(replies)} of {len(nodes)} sampled clients replied, but "
            f"{step['min_replies_why']}, so the round is refused and nothing of it released"
            + (f" ({'; '.join(errors)})" if errors else "")
        )
    if aggregations:
        results.update(runtime.aggregate(aggregations, replies))
    for entry in step.get("state", ()):  # the per-client state stays on the nodes: the
        # marks' aggregates are read by no server part, but the parts take them
        results[entry["aggregated"]] = np.zeros(entry["shape"], runtime.np_dtype(entry["dtype"]))
    for name, value in results.items():
        env[(step.get("aggregated", "aggregated"), name)] = value


def client_state_config(cfg) -> dict:
    """What every message of a program with per-client state carries (program.py
    ClientState): where the nodes keep it and which round's state each partition
    enters the round with; empty otherwise."""
    state = getattr(cfg, "client_state", None)
    return {} if state is None else {"client-state": state.message()}


def plain_exchange(
    grid, cfg, step_index: int, values: dict, nodes: list[int], rnd: int, stats: dict, extra=None
):
    """One send/receive: every client output in the clear. Returns (replies, errors)
    as secagg.exchange does."""
    record = runtime.to_record(values)
    messages = []
    for node in nodes:
        content = RecordDict(
            {
                "arrays": record,
                "config": ConfigRecord({"server-round": rnd}),
                "fcir": ConfigRecord({"step": step_index, **(extra or {})}),
            }
        )
        messages.append(Message(content, dst_node_id=node, message_type="train.fcir"))
    replies, errors = [], []
    for reply in grid.send_and_receive(messages, timeout=cfg.timeout):
        node = reply.metadata.src_node_id
        if reply.has_error():
            errors.append(f"node {node}: {reply.error.reason}")
            continue
        record = reply.content["arrays"]
        stats["received"] += runtime.record_bytes(record)
        out = {}
        for key, x in runtime.from_record(record).items():
            out[key.partition("/")[2]] = x
        replies.append(((int(reply.content["fcir"]["partition-id"]), node), out))
    return replies, errors


def run_round(grid, cfg: Config, plan: dict, inputs: list, rnd: int, stats: dict) -> list:
    env = {("arg", str(s["leaf"])): x for s, x in zip(plan["server_inputs"], inputs)}
    later = [s["part"]["artifact"] for s in plan["steps"][1:] if s["kind"] == "server"]
    runtime.precompile(later)
    for i, step in enumerate(plan["steps"]):
        if step["kind"] == "server":
            runtime.call(step["part"], env)
        else:
            exchange(grid, cfg, i, step, env, rnd, stats)
    outs = [np.asarray(env[("output", str(j))]) for j in range(len(plan["outputs"]))]
    return [outs[j] for j in plan["output_order"]]


class Checkpoints:
    """The server inputs of the next round, saved after each round (fcir.checkpoint)."""

    def __init__(self, directory: str):
        try:  # the server (not a device) has fcir: checkpoints are fcir.checkpoint's
            from fcir.checkpoint import CheckpointManager
        except ImportError as e:
            raise AppError(f"checkpoint-dir needs fcir installed beside the SuperLink: {e}") from None

        self.manager = CheckpointManager(directory, max_to_keep=2)
        self.app = runtime.app_digest()
        self.budget = None  # the privacy budget's state the restored checkpoint saved

    def resume(self, plan: dict):
        step = self.manager.latest_step()
        if step is None:
            return 0, None, None
        tree = self.manager.restore(step)
        if tree["meta"]["app"] != self.app:
            raise AppError(
                f"checkpoint {step} was written by another app (or another export of it): "
                "give a fresh checkpoint-dir"
            )
        state, outs = tree["state"], tree["outputs"]
        if tree["meta"].get("budget"):
            self.budget = json.loads(str(tree["meta"]["budget"]))
        out_specs = [plan["outputs"][j] for j in plan["output_order"]]

        def leaves(saved, specs, what):
            # Restored in their declared shapes: a 0-d loss is written back as (), not (1,).
            return [
                runtime.check_leaf(
                    np.asarray(saved[f"arr_{i}"]).reshape(s["shape"]), s, f"checkpoint {step} {what} arr_{i}"
                )
                for i, s in enumerate(specs)
            ]

        return step, leaves(state, plan["server_inputs"], "state"), leaves(outs, out_specs, "outputs")

    def save(self, rnd: int, inputs: list, outputs: list, budget=None, meta=None) -> None:
        meta = {"app": self.app, "round": rnd, **(meta or {})}
        if budget is not None:  # fcir.privacy.Budget.state(), as JSON
            meta["budget"] = json.dumps(budget.state(), sort_keys=True)
        tree = {
            "state": {f"arr_{i}": np.asarray(x) for i, x in enumerate(inputs)},
            "outputs": {f"arr_{i}": np.asarray(x) for i, x in enumerate(outputs)},
            "meta": meta,
        }
        self.manager.save(rnd, tree, blocking=True, force=True)


def _metric(x) -> str:
    x = np.asarray(x).reshape(-1)
    return np.array2string(x[0], precision=6) if x.size == 1 else f"{x.dtype}{list(x.shape)}"


def record_metrics(context, history, rnd: int, metrics: dict) -> None:
    """Round ``rnd``'s scalar metrics into the history (metrics-file) and Flower's
    MetricRecord in the ServerApp's context state."""
    from flwr.app import MetricRecord

    history.add(rnd, metrics)
    context.state["fcir.metrics"] = MetricRecord(history.record())


def ray_first(timeout: float) -> None:
    """On Flower's Simulation Engine, waits until Ray has started before JAX does.

    There the ServerApp runs in a thread of the ``flwr-simulation`` process, which
    starts Ray next to it: ``ray.init`` spawns Ray's processes with a ``preexec_fn``,
    that is through ``fork``, and once JAX's runtime runs its threads a fork warns
    (``os.fork() ... JAX is multithreaded, so this will likely lead to a deadlock``)
    and can deadlock. So nothing here starts JAX's runtime until Ray is up (or
    ``timeout`` passed: Ray failing to start is Flower's error to report)."""
    import sys

    if os.path.basename(sys.argv[0] if sys.argv else "") != "flwr-simulation":
        return
    try:
        import ray
    except ImportError:
        return
    deadline = time.monotonic() + timeout
    while not ray.is_initialized() and time.monotonic() < deadline:
        time.sleep(0.1)


@app.main()
def main(grid, context) -> None:
    plan = runtime.plan()
    cfg = Config(dict(context.run_config), plan)
    ray_first(cfg.timeout)
    inputs = initial_inputs(cfg, plan)
    if cfg.state_note:
        print(f"[fcir] {cfg.state_note}", flush=True)
    ckpt = Checkpoints(cfg.checkpoint_dir) if cfg.checkpoint_dir else None
    history = training.History(cfg.metrics_file)
    accounting = Accounting(plan, cfg)
    done, outputs = 0, None
    if ckpt is not None and "loop" not in plan:
        done, restored, outputs = ckpt.resume(plan)
        if restored is not None:
            inputs = restored
            print(f"[fcir] resuming after round {done} from {cfg.checkpoint_dir}", flush=True)
            accounting.resume(ckpt.budget, done)
    if "loop" in plan:  # a whole training program: one round per loop iteration
        outputs = program.run(grid, cfg, plan, inputs, ckpt, run_round,
                              lambda rnd, m: record_metrics(context, history, rnd, m),
                              accounting.line, run_id=context.run_id)
        if cfg.output:
            program.write(cfg.output, outputs)
            print(f"[fcir] wrote {len(outputs)} output array(s) to {cfg.output}", flush=True)
        return
    for rnd in range(done + 1, cfg.rounds + 1):
        why = accounting.stop_before(rnd)
        if why and outputs is None:
            raise AppError(f"run config max-epsilon: {why}: raise max-epsilon or the noise")
        if why:
            print(f"[fcir] {why}", flush=True)
            break
        stats = dict.fromkeys(("sent", "received", "sampled", "replied", "exchanges"), 0)
        start = time.perf_counter()
        outputs = run_round(grid, cfg, plan, inputs, rnd, stats)
        inputs = list(inputs)
        for i, o in cfg.state.items():
            inputs[i] = outputs[o]
        names = training.output_names(plan)
        metrics = " ".join(f"{names[o]}={_metric(outputs[o])}" for o in cfg.metrics)
        scalars = {
            names[o]: float(np.asarray(outputs[o]).reshape(-1)[0])
            for o in cfg.metrics
            if np.asarray(outputs[o]).size == 1
        }
        evaluated = ""
        if "evaluate" in plan and cfg.fraction_evaluate > 0:  # Flower's evaluate stage, on the next round's model
            nodes = sample(grid, cfg, rnd, stage="evaluate")
            more, evaluated = evaluation.run(grid, nodes, plan, inputs, rnd, cfg.timeout)
            scalars.update(more)
        record_metrics(context, history, rnd, scalars)
        if accounting.budget is not None:
            accounting.budget.spend()
        who = f"{stats['replied']}/{stats['sampled']} clients replied"
        if stats["exchanges"] > 1:
            who = f"{stats['replied']}/{stats['sampled']} client replies over {stats['exchanges']} exchanges"
        print(
            f"[fcir] round {rnd}/{cfg.rounds}: {who}, sent {stats['sent']} B, received {stats['received']} B, "
            f"{time.perf_counter() - start:.1f} s "
            + " ".join(x for x in (metrics, evaluated, accounting.line(rnd)) if x),
            flush=True,
        )
        if ckpt is not None:
            ckpt.save(rnd, inputs, outputs, accounting.budget)
    if cfg.output:
        # Written under a temporary name and renamed: a reader never sees half a file.
        tmp = f"{cfg.output}.tmp-{os.getpid()}.npz"
        np.savez(tmp, *outputs)
        os.replace(tmp, cfg.output)
        print(f"[fcir] wrote {len(outputs)} output array(s) to {cfg.output}", flush=True)
