"""The ClientApp: one client's work of the round, from its jax.export artifact.

Messages of type ``train.fcir`` carry, in the ``fcir`` ConfigRecord, which exchange of
the round they belong to, and in the ``values`` ArrayRecord what the server sends. The
client reads its data from the ``.npz`` its node config names (``data-path``: leaves
``arr_0``, ``arr_1``, ... in the order of the round's flattened client arguments, one
client's slice) and replies with its client outputs. Every message starts a fresh
process, so nothing is cached between messages except what ``context.state`` holds.
"""

from __future__ import annotations

from flwr.app import ConfigRecord, Message, RecordDict
from flwr.clientapp import ClientApp

from . import runtime

app = ClientApp()


def client_data(context) -> list:
    plan = runtime.plan()
    specs = plan["client_inputs"]
    if not specs:
        return []
    path = context.node_config.get("data-path")
    if not path:
        raise runtime.AppError(
            f"node {context.node_id}: @{plan['round']} needs client data: start the "
            "SuperNode with --node-config \"data-path='/path/to/client.npz'\""
        )
    # "{round}" in data-path names the round, so one SuperNode can serve several apps.
    path = str(path).replace("{round}", plan["round"])
    return runtime.load_leaves(path, specs, f"node {context.node_id} data-path")


def partition(context) -> int:
    """The node's ``partition-id`` (node config), which orders the server's sums; -1
    when the node has none."""
    try:
        return int(context.node_config.get("partition-id", -1))
    except (TypeError, ValueError):
        return -1


@app.train("fcir")
def work(msg: Message, context) -> Message:
    plan = runtime.plan()
    step = plan["steps"][int(msg.content["fcir"]["step"])]
    env = {("arg", str(s["leaf"])): x for s, x in zip(plan["client_inputs"], client_data(context))}
    for key, x in runtime.from_record(msg.content["values"]).items():
        group, _, name = key.partition("/")
        env[(group, name)] = x
    runtime.call(step["client"], env)
    outputs = {f"{g}/{n}": env[(g, n)] for g, n in step["client"]["results"]}
    content = RecordDict({"values": runtime.to_record(outputs), "fcir": ConfigRecord({"partition": partition(context)})})
    return Message(content, reply_to=msg)
