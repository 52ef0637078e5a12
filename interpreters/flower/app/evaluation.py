"""Flower's evaluate stage for a program that declares an evaluation
(``program(evaluate=fn)``; plan.json ``evaluate``, exported from the captured
``evaluation(program)``).

After each round the ServerApp samples ``fraction-evaluate`` of the online nodes (at
least ``min-evaluate-nodes``, at most all), sends them the round's new server values in
an ``evaluate`` message (``arrays``, ``config`` with ``server-round``), and each
ClientApp runs the evaluation's client work on its evaluation data (node config
``eval-data-path``, else its ``data-path``) and replies with its client outputs
(``arrays``) and ``num-examples`` (``metrics``). The server aggregates them as the
evaluation program does (a mean weighted by each client's number of examples) and
returns the metrics by the program's names.
"""

from __future__ import annotations

import numpy as np
from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict

from . import runtime, training


def run(grid, nodes: list[int], plan: dict, inputs: list, rnd: int, timeout: float) -> tuple[dict, str]:
    """The evaluation of the server values ``inputs`` (the next round's) on ``nodes``
    (the ServerApp samples them, as for training): (metrics by name, the progress
    line's words)."""
    ev = plan["evaluate"]
    if not nodes:
        return {}, ""
    prepare, exchange, result = ev["steps"]
    env = {("arg", str(s["leaf"])): x for s, x in zip(ev["server_inputs"], inputs)}
    runtime.call(prepare["part"], env)
    sent = runtime.to_record({f"{d[0]}/{d[1]}": env[tuple(s)] for s, d in exchange["send"]})
    messages = [
        Message(
            RecordDict({"arrays": sent, "config": ConfigRecord({"server-round": rnd})}),
            dst_node_id=node, message_type="evaluate.fcir",
        )
        for node in nodes
    ]
    replies, failed = [], 0
    for reply in grid.send_and_receive(messages, timeout=timeout):
        if reply.has_error():
            failed += 1
            print(f"[fcir] round {rnd}: evaluation failed on node {reply.metadata.src_node_id}, "
                  f"left out: {reply.error.reason}", flush=True)
            continue
        outs = {k.partition("/")[2]: v for k, v in runtime.from_record(reply.content["arrays"]).items()}
        replies.append((reply.metadata.src_node_id, outs))
    if not replies:
        return {}, f"evaluate: 0/{len(nodes)} clients replied"
    replies = [out for _, out in sorted(replies, key=lambda r: r[0])]
    for name, value in runtime.aggregate(exchange["aggregations"], replies).items():
        env[(exchange.get("aggregated", "aggregated"), name)] = value
    runtime.call(result["part"], env)
    outs = [np.asarray(env[("output", str(j))]) for j in range(len(ev["outputs"]))]
    outs = [outs[j] for j in ev["output_order"]]
    metrics = {n: float(x.reshape(-1)[0]) for n, x in zip(training.output_names(ev), outs) if x.size == 1}
    shown = " ".join(f"{n}={np.array2string(np.float32(v), precision=6)}" for n, v in metrics.items())
    return metrics, f"evaluate: {len(replies)}/{len(nodes)} clients replied {shown}"


def client(msg: Message, context, load_leaves) -> Message:
    """One node's evaluation: its client outputs and ``num-examples``."""
    ev = runtime.plan()["evaluate"]
    part = ev["steps"][1]["client"]
    path = context.node_config.get("eval-data-path") or context.node_config.get("data-path")
    if not path:
        raise runtime.AppError(
            f"node {context.node_id}: the evaluation needs data: start the SuperNode with "
            "--node-config \"eval-data-path='/path/to/test.npz'\""
        )
    leaves = load_leaves(str(path), ev["client_inputs"], f"node {context.node_id} eval-data-path")
    env = {("arg", str(s["leaf"])): x for s, x in zip(ev["client_inputs"], leaves)}
    for key, x in runtime.from_record(msg.content["arrays"]).items():
        group, _, name = key.partition("/")
        env[(group, name)] = x
    runtime.call(part, env)
    outputs = {f"{g}/{n}": env[(g, n)] for g, n in part["results"]}
    examples = int(np.shape(leaves[0])[0]) if leaves and np.ndim(leaves[0]) else 1
    content = RecordDict({
        "arrays": runtime.to_record(outputs),
        "metrics": MetricRecord({"num-examples": examples}),
    })
    return Message(content, reply_to=msg)
