"""Client: one local epoch of SGD on the node's partition from the received model;
replies with the delta and the mean loss."""

import jax
import numpy as np
from flwr.app import Array, ArrayRecord, Message, RecordDict
from flwr.clientapp import ClientApp

from .cnn import client_update

app = ClientApp()
local_update = jax.jit(client_update)


@app.train()
def train(msg: Message, context) -> Message:
    node = int(context.node_config["partition-id"])
    with np.load(f"{context.run_config['data-dir']}/node{node}.npz") as f:
        x, y = f["arr_0"], f["arr_1"]
    params = {k: v.numpy() for k, v in msg.content["params"].items()}
    delta, loss = local_update(params, x, y)
    out = {k: np.asarray(v) for k, v in delta.items()}
    out["loss"] = np.asarray(loss)
    return Message(
        RecordDict({"update": ArrayRecord({k: Array(v) for k, v in out.items()})}), reply_to=msg
    )
