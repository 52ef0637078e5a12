"""Server: each round samples ``clients`` of the online nodes (uniformly, without
replacement), sends them the model, averages their deltas and losses and adds the mean
delta (FedAvg, server learning rate 1). Prints each round's time."""

import random
import time

import numpy as np
from flwr.app import Array, ArrayRecord, Message, RecordDict
from flwr.serverapp import ServerApp

from .cnn import init_params

app = ServerApp()


@app.main()
def main(grid, context) -> None:
    cfg = context.run_config
    params = init_params(int(cfg["seed"]))
    for rnd in range(1, int(cfg["num-server-rounds"]) + 1):
        start = time.perf_counter()
        nodes = sorted(grid.get_node_ids())
        cohort = random.Random(rnd).sample(nodes, min(int(cfg["clients"]), len(nodes)))
        record = ArrayRecord({k: Array(np.asarray(v)) for k, v in params.items()})
        messages = [
            Message(RecordDict({"params": record}), dst_node_id=n, message_type="train")
            for n in cohort
        ]
        replies = [r for r in grid.send_and_receive(messages) if not r.has_error()]
        updates = [{k: v.numpy() for k, v in r.content["update"].items()} for r in replies]
        mean = {k: np.mean([u[k] for u in updates], axis=0) for k in (*params, "loss")}
        params = {k: params[k] + mean[k] for k in params}
        print(
            f"[hand] round {rnd}/{cfg['num-server-rounds']}: {len(replies)}/{len(cohort)} clients "
            f"replied, {time.perf_counter() - start:.3f} s loss={float(mean['loss']):.6f}",
            flush=True,
        )
