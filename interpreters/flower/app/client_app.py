"""The ClientApp: one client's work of the round, from its jax.export artifact.

Messages of type ``train.fcir`` follow Flower's layout: ``arrays`` (an ArrayRecord:
what the server sends), ``config`` (``server-round``) and fcir's own ConfigRecord
``fcir`` (``step``: which exchange of the round; ``client-state``). The reply holds
``arrays`` (the client outputs), ``metrics`` (``num-examples``) and ``fcir``
(``partition-id``, which orders the server's sums). The
client reads its data from the ``.npz`` its node config names (``data-path``: leaves
``arr_0``, ``arr_1``, ... in the order of the round's flattened client arguments, one
client's slice) and replies with its client outputs. Every message starts a fresh
process, so nothing is cached between messages except what ``context.state`` holds.
"""

from __future__ import annotations

import flwr.compat.common.recorddict_compat as compat
import numpy as np
from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict
from flwr.client.mod import secaggplus_mod
from flwr.clientapp import ClientApp
from flwr.common import Code, FitRes, Status, ndarrays_to_parameters

from . import evaluation, runtime

app = ClientApp()


def client_data(context, info=None) -> list:
    """The node's client inputs: its partition of run config ``dataset`` (below), or the
    ``.npz`` of node config ``data-path`` (else run config ``data-dir``). ``info``, when
    given, gets the node's ``num-examples``."""
    plan = runtime.plan()
    specs = plan["client_inputs"]
    if not specs:
        if info is not None:
            info["num-examples"] = 1
        return []
    if str(context.run_config.get("dataset", "") or ""):
        return partition_data(context, plan, info)
    path = context.node_config.get("data-path")
    what = "data-path"
    if not path:
        path, what = data_dir_path(context, plan), "data-dir"
    if not path:
        raise runtime.AppError(
            f"node {context.node_id}: @{plan['round']} needs client data: start the "
            "SuperNode with --node-config \"data-path='/path/to/client.npz'\" (or give "
            "run config data-dir=\"/abs/folder\" of node<partition-id>.npz files)"
        )
    # "{round}" in data-path names the round, so one SuperNode can serve several apps.
    path = str(path).replace("{round}", plan["round"])
    leaves = runtime.load_leaves(path, specs, f"node {context.node_id} {what}")
    if info is not None:
        info["num-examples"] = num_examples(leaves)
    return leaves


def partition_data(context, plan: dict, info=None) -> list:
    """The node's partition of run config ``dataset`` (an ``.npz`` of named arrays, one
    leading example axis), as flwr-datasets' partitioner ``partitioner`` (``iid``,
    ``dirichlet``, ``pathological``; ``partition-by``, ``alpha``,
    ``num-classes-per-partition``, ``partition-seed``) splits it into node config
    ``num-partitions`` partitions; this node's is ``partition-id``. Run config
    ``dataset-fields`` names the array for each client input in order (``mask``: 1 for an
    example, 0 for padding), each zero-padded to the input's rows; ``num-examples`` is the
    partition's size before padding. Every node draws the same partitioning (one seed)."""
    import pathlib

    from . import partitions

    rc, nc = context.run_config, context.node_config
    what = f"node {context.node_id} dataset"
    pid = partition(context)
    try:
        n = int(nc.get("num-partitions", -1))
    except (TypeError, ValueError):
        n = -1
    if pid < 0 or n < 1 or pid >= n:
        raise runtime.AppError(
            f"{what}: run config dataset needs node config partition-id and num-partitions "
            f"(0 <= partition-id < num-partitions; got {pid}, {n}): the Simulation Engine "
            "and fcir flower up set both"
        )
    fields = [f.strip() for f in str(rc.get("dataset-fields", "")).split(",") if f.strip()]
    specs = plan["client_inputs"]
    if len(fields) != len(specs):
        raise runtime.AppError(
            f"{what}: run config dataset-fields={rc.get('dataset-fields', '')!r} names "
            f"{len(fields)} array(s); @{plan['round']} takes {len(specs)} client input(s) "
            f"({', '.join(s['type'] for s in specs)}): name one per input, in order"
        )
    path = str(rc["dataset"])
    if not pathlib.Path(path).is_file():
        raise runtime.AppError(f"{what}: no such file: {path}")
    with np.load(path) as f:
        dataset = {k: f[k] for k in f.files}
    try:
        p = partitions.make(
            str(rc.get("partitioner", "iid")), n,
            partition_by=str(rc.get("partition-by", "label")),
            alpha=float(rc.get("alpha", 0.5)),
            num_classes_per_partition=int(rc.get("num-classes-per-partition", 2)),
            seed=int(rc.get("partition-seed", 42)),
        )
        p.dataset = dataset
        part = p.load_partition(pid)
        leaves = partitions.pad(part, fields, specs, f"{what} partition {pid} of {n}")
    except ValueError as e:
        raise runtime.AppError(f"{what}: {e}") from None
    if info is not None:
        info["num-examples"] = partitions._num_rows(part)
    return leaves


def data_dir_path(context, plan: dict) -> str | None:
    """Without a node config ``data-path`` (the Simulation Engine's virtual nodes have
    only ``partition-id``): run config ``data-dir`` + ``node<partition-id>.npz``, or
    ``node<partition-id>/<round>.npz`` when that folder exists."""
    import pathlib

    folder = str(context.run_config.get("data-dir", "") or "")
    pid = partition(context)
    if not folder or pid < 0:
        return None
    node = pathlib.Path(folder) / f"node{pid}"
    return str(node / f"{plan['round']}.npz") if node.is_dir() else f"{node}.npz"


def partition(context) -> int:
    """The node's ``partition-id`` (node config), which orders the server's sums; -1
    when the node has none."""
    try:
        return int(context.node_config.get("partition-id", -1))
    except (TypeError, ValueError):
        return -1


def state_dir(context):
    """Where this node keeps per-client state: node config ``state-dir``, else
    ``$FLWR_HOME/fcir-state`` (``~/.flwr/fcir-state``): a SuperNode started again with
    the same FLWR_HOME finds it."""
    import os
    import pathlib

    folder = context.node_config.get("state-dir")
    if folder:
        return pathlib.Path(str(folder))
    home = os.environ.get("FLWR_HOME") or str(pathlib.Path.home() / ".flwr")
    return pathlib.Path(home) / "fcir-state"


class NodeState:
    """One partition's per-client state on its node: ``<state-dir>/<key>/partition-<id>/
    round-<t>.npz`` holds its state after round t (``arr_j``: the j-th carry of the
    program's ``loop.client_state``), written to a temporary name and renamed. The
    server's message says which round's state the partition enters the round with
    (program.py ClientState); round 0 is the initial value from the data file."""

    KEEP = 2  # files kept below that round (a server resuming from an older checkpoint)

    def __init__(self, context, config: str):
        import json

        msg = json.loads(config)
        self.pid = partition(context)
        if self.pid < 0:
            raise runtime.AppError(
                f"node {context.node_id}: @{runtime.plan()['round']} keeps per-client state, "
                "which is the partition's: start the SuperNode with --node-config "
                "'partition-id=I'"
            )
        self.folder = state_dir(context) / str(msg["key"]) / f"partition-{self.pid}"
        self.entered = int(msg["rounds"].get(str(self.pid), 0))
        self.specs = runtime.plan()["loop"]["client_state"]
        self.what = f"node {context.node_id} (partition {self.pid}) client state"

    def path(self, rnd: int):
        return self.folder / f"round-{rnd}.npz"

    def load(self) -> list | None:
        """The state the partition enters the round with, or None for the initial one."""
        if self.entered == 0:
            return None
        path = self.path(self.entered)
        if not path.is_file():
            raise runtime.AppError(
                f"{self.what}: the server counts partition {self.pid}'s state of round "
                f"{self.entered}, and {path} is missing (another state-dir or FLWR_HOME than "
                "the node had then?): give the node its state-dir back, or start the "
                "training afresh"
            )
        return runtime.load_leaves(str(path), self.specs, self.what)

    def save(self, rnd: int, leaves: list) -> None:
        import os

        self.folder.mkdir(parents=True, exist_ok=True)
        leaves = [
            np.asarray(x).astype(runtime.np_dtype(s["dtype"])) for x, s in zip(leaves, self.specs)
        ]
        tmp = self.folder / f".round-{rnd}.tmp-{os.getpid()}.npz"
        with open(tmp, "wb") as f:
            np.savez(f, *leaves)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path(rnd))
        # Older rounds the server can no longer ask for: it only moves a partition on.
        rounds = (_round_of(p) for p in self.folder.glob("round-*.npz"))
        older = sorted((r for r in rounds if r is not None and r < self.entered), reverse=True)
        for r in older[self.KEEP:]:
            self.path(r).unlink(missing_ok=True)


def _round_of(path) -> int | None:
    try:
        return int(path.stem.removeprefix("round-"))
    except ValueError:
        return None


def num_examples(leaves: list) -> int:
    """The node's example count, the ``num-examples`` Flower weighs replies by: the
    rows of its first client input that has any (1 when none has)."""
    for x in leaves:
        if np.ndim(x) > 0:
            return int(np.shape(x)[0])
    return 1


def compute(
    step_index: int, values: dict, context, rnd: int = 0, state_config=None, info=None
) -> dict:
    """The client work of exchange ``step_index`` on the node's data and the values the
    server sent: ``"group/name" -> array`` of the client outputs. With per-client state
    (``state_config``: what the server sent), the state the node kept replaces the
    initial value of each carry at the clients, and the exchange that computes its new
    value saves it as the state after round ``rnd`` (never sent). ``info``, when
    given, gets the node's ``num-examples``."""
    plan = runtime.plan()
    step = plan["steps"][step_index]
    leaves = client_data(context, info)
    specs = plan["client_inputs"]
    node_state = None
    if plan.get("loop", {}).get("client_state"):
        if not state_config:
            raise runtime.AppError("the server sent no client-state entry for a program with state")
        node_state = NodeState(context, str(state_config))
        kept = node_state.load()
        if kept is not None:
            leaves = [kept[s["state"]] if "state" in s else x for s, x in zip(specs, leaves)]
    # A program's loop body is the round: its parameter "round_leaf" holds the
    # program's client argument "leaf".
    env = {("arg", str(s.get("round_leaf", s["leaf"]))): x for s, x in zip(specs, leaves)}
    for key, x in values.items():
        group, _, name = key.partition("/")
        env[(group, name)] = x
    if "iree" in step["client"]:  # --device-runtime iree: no jax on this node
        from . import iree_runtime  # only --device-runtime iree apps carry this file

        requested = context.node_config.get("device-target")
        iree_runtime.call(step["client"], env, runtime.artifact_bytes, requested)
    else:
        runtime.call(step["client"], env)
    outputs = {f"{g}/{n}": env[(g, n)] for g, n in step["client"]["results"]}
    if step.get("state"):
        order = [s["round_leaf"] for s in plan["loop"]["client_state"]]
        new = {e["round_leaf"]: outputs.pop(e["output"]) for e in step["state"]}
        node_state.save(rnd, [new[r] for r in order])
    return outputs


@app.train("fcir")
def work(msg: Message, context) -> Message:
    config = msg.content["fcir"]
    info = {}
    outputs = compute(
        int(config["step"]), runtime.from_record(msg.content["arrays"]), context,
        int(msg.content["config"].get("server-round", 0)), config.get("client-state"), info,
    )
    content = RecordDict(
        {
            "arrays": runtime.to_record(outputs),
            "metrics": MetricRecord({"num-examples": info["num-examples"]}),
            "fcir": ConfigRecord({"partition-id": partition(context)}),
        }
    )
    return Message(content, reply_to=msg)


@app.train(mods=[secaggplus_mod])
def secure(msg: Message, context) -> Message:
    """An exchange with secure sums, inside Flower's SecAgg+ protocol (the workflow's
    plain ``train`` messages; ``secaggplus_mod`` answers the key stages and calls this
    once, for the masked vectors). The secure sums' inputs go out as 16-bit chunks in
    the FitRes parameters, which the mod masks; the other client outputs travel in the
    clear in the FitRes metrics (bytes), as they would in a plain exchange."""
    ins = compat.recorddict_to_fitins(msg.content, keep_input=True)
    step_index = int(ins.config["step"])
    step = runtime.plan()["steps"][step_index]
    outputs = compute(
        step_index, runtime.unpack(ins.config, "v:"), context,
        int(ins.config.get("round", 0)), ins.config.get("client-state"),
    )
    by_name = {k.partition("/")[2]: (k, v) for k, v in outputs.items()}
    sums = runtime.secure_inputs(step)  # [(client output name, bitwidth)], plan order
    chunks = [runtime.to_chunks(by_name[name][1], bw) for name, bw in sums]
    plain = dict(by_name[name] for name in runtime.plain_inputs(step))
    metrics = {"partition": partition(context), **runtime.pack(plain, "v:")}
    for name, _ in sums:  # the server rebuilds each sum in its input's dtype
        metrics[f"dtype:{name}"] = str(np.asarray(by_name[name][1]).dtype)
    res = FitRes(Status(Code.OK, ""), ndarrays_to_parameters(chunks), num_examples=1, metrics=metrics)
    return Message(compat.fitres_to_recorddict(res, keep_input=False), reply_to=msg)


@app.evaluate("fcir")
def evaluate(msg: Message, context) -> Message:
    """Flower's evaluate stage: the program's evaluation on the node's evaluation data."""
    return evaluation.client(msg, context, runtime.load_leaves)
