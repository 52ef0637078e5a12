"""Client: SGD on the node's batches from the received model; replies with the delta and
the mean loss (what fedavg_mlp's client work computes)."""

import jax
import jax.numpy as jnp
import numpy as np
from flwr.app import Array, ArrayRecord, Message, RecordDict
from flwr.clientapp import ClientApp

app = ClientApp()
LR = 0.05
NAMES = ("b1", "b2", "w1", "w2")


def mse(p, x, y):
    h = jax.nn.relu(x @ p["w1"] + p["b1"])
    return jnp.mean(jnp.square(h @ p["w2"] + p["b2"] - y))


@jax.jit
def local_update(params, x, y):
    def step(p, batch):
        value, grads = jax.value_and_grad(mse)(p, *batch)
        return jax.tree.map(lambda w, g: w - LR * g, p, grads), value

    trained, losses = jax.lax.scan(step, params, (x, y))
    return jax.tree.map(jnp.subtract, trained, params), jnp.mean(losses)


@app.train()
def train(msg: Message, context) -> Message:
    with np.load(str(context.node_config["data-path"]).replace("{round}", "fedavg_mlp")) as f:
        x, y = f["arr_0"], f["arr_1"]
    params = {k: msg.content["params"][k].numpy() for k in NAMES}
    delta, loss = local_update(params, x, y)
    out = {k: np.asarray(delta[k]) for k in NAMES}
    out["loss"] = np.asarray(loss)
    record = ArrayRecord({k: Array(v) for k, v in out.items()})
    return Message(RecordDict({"update": record}), reply_to=msg)
