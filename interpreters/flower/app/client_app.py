"""The ClientApp: one client's work of the round, from its jax.export artifact.

Messages of type ``train.fcir`` carry, in the ``fcir`` ConfigRecord, which exchange of
the round they belong to, and in the ``values`` ArrayRecord what the server sends. The
client reads its data from the ``.npz`` its node config names (``data-path``: leaves
``arr_0``, ``arr_1``, ... in the order of the round's flattened client arguments, one
client's slice) and replies with its client outputs. Every message starts a fresh
process, so nothing is cached between messages except what ``context.state`` holds.
"""

from __future__ import annotations

import flwr.compat.common.recorddict_compat as compat
import numpy as np
from flwr.app import ConfigRecord, Message, RecordDict
from flwr.client.mod import secaggplus_mod
from flwr.clientapp import ClientApp
from flwr.common import Code, FitRes, Status, ndarrays_to_parameters

from . import runtime

app = ClientApp()


def client_data(context) -> list:
    plan = runtime.plan()
    specs = plan["client_inputs"]
    if not specs:
        return []
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
    return runtime.load_leaves(path, specs, f"node {context.node_id} {what}")


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


def compute(step_index: int, values: dict, context) -> dict:
    """The client work of exchange ``step_index`` on the node's data and the values the
    server sent: ``"group/name" -> array`` of the client outputs."""
    plan = runtime.plan()
    step = plan["steps"][step_index]
    # A program's loop body is the round: its parameter "round_leaf" holds the
    # program's client argument "leaf".
    env = {
        ("arg", str(s.get("round_leaf", s["leaf"]))): x
        for s, x in zip(plan["client_inputs"], client_data(context))
    }
    for key, x in values.items():
        group, _, name = key.partition("/")
        env[(group, name)] = x
    if "iree" in step["client"]:  # --device-runtime iree: no jax on this node
        from . import iree_runtime

        requested = context.node_config.get("device-target")
        iree_runtime.call(step["client"], env, runtime.artifact_bytes, requested)
    else:
        runtime.call(step["client"], env)
    return {f"{g}/{n}": env[(g, n)] for g, n in step["client"]["results"]}


@app.train("fcir")
def work(msg: Message, context) -> Message:
    outputs = compute(int(msg.content["fcir"]["step"]), runtime.from_record(msg.content["values"]), context)
    content = RecordDict({"values": runtime.to_record(outputs), "fcir": ConfigRecord({"partition": partition(context)})})
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
    outputs = compute(step_index, runtime.unpack(ins.config, "v:"), context)
    by_name = {k.partition("/")[2]: (k, v) for k, v in outputs.items()}
    sums = runtime.secure_inputs(step)  # [(client output name, bitwidth)], plan order
    chunks = [runtime.to_chunks(by_name[name][1], bw) for name, bw in sums]
    plain = dict(by_name[name] for name in runtime.plain_inputs(step))
    metrics = {"partition": partition(context), **runtime.pack(plain, "v:")}
    for name, _ in sums:  # the server rebuilds each sum in its input's dtype
        metrics[f"dtype:{name}"] = str(np.asarray(by_name[name][1]).dtype)
    res = FitRes(Status(Code.OK, ""), ndarrays_to_parameters(chunks), num_examples=1, metrics=metrics)
    return Message(compat.fitres_to_recorddict(res, keep_input=False), reply_to=msg)
