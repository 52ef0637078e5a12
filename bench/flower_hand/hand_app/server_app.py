"""Server: sends the model to every node, averages the deltas and losses, adds the mean
delta; writes params and mean loss as an .npz (inputs/output as fcir's app takes them)."""

import time

import numpy as np
from flwr.app import Array, ArrayRecord, Message, RecordDict
from flwr.serverapp import ServerApp

app = ServerApp()
NAMES = ("b1", "b2", "w1", "w2")


@app.main()
def main(grid, context) -> None:
    cfg = context.run_config
    with np.load(cfg["inputs"]) as f:
        params = dict(zip(NAMES, (f[f"arr_{i}"] for i in range(4))))
    for rnd in range(1, int(cfg["rounds"]) + 1):
        start = time.perf_counter()
        nodes = sorted(grid.get_node_ids())
        record = ArrayRecord({k: Array(np.asarray(v)) for k, v in params.items()})
        messages = [
            Message(RecordDict({"params": record}), dst_node_id=n, message_type="train")
            for n in nodes
        ]
        replies = [r for r in grid.send_and_receive(messages) if not r.has_error()]
        updates = [{k: v.numpy() for k, v in r.content["update"].items()} for r in replies]
        mean = {k: np.mean([u[k] for u in updates], axis=0) for k in (*NAMES, "loss")}
        params = {k: params[k] + mean[k] for k in NAMES}
        print(f"[hand] round {rnd}: {len(replies)}/{len(nodes)} replied, "
              f"{time.perf_counter() - start:.1f} s loss={float(mean['loss']):.6f}", flush=True)
    if cfg["output"]:
        np.savez(cfg["output"], *(params[k] for k in NAMES), mean["loss"])
