"""Meta-learning through a federated round: differentiate the loss *after* one FedAvg
round with respect to the server learning rate and the initial model.

One round: the server broadcasts the model, every client runs a few local SGD steps
(a ``lax.scan`` inside the ``map_fn`` body) and sends back its model delta, the server
averages the deltas and applies them with its learning rate. The meta-objective is the
clients' mean loss of the post-round model. ``jax.grad`` of that objective goes back
through the server update, the mean, every client's local training (second-order:
the gradient of an SGD step) and the broadcasts; the backward pass stays federated
(``fed_map`` regions, ``fed_broadcast``/``fed_sum``), so it could itself be deployed.

Run ``python examples/meta_learning.py``: it prints a few meta-steps in which the
post-round loss goes down while the server learning rate and the initial model adapt.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

import fcir

NUM_CLIENTS = 8
EXAMPLES = 16
DIM, HIDDEN = 4, 8
LOCAL_STEPS = 3
CLIENT_LR = 0.1
META_LR = 0.05


def local_loss(params, x, y):
    """Mean squared error of a one-hidden-layer tanh network."""
    pred = jnp.tanh(x @ params["w1"]) @ params["w2"]
    return jnp.mean(jnp.square(pred - y))


def client_update(params, x, y):
    """``LOCAL_STEPS`` full-batch SGD steps; returns the model delta."""

    def step(p, _):
        grads = jax.grad(local_loss)(p, x, y)
        return jax.tree.map(lambda w, g: w - CLIENT_LR * g, p, grads), None

    trained, _ = jax.lax.scan(step, params, None, length=LOCAL_STEPS)
    return jax.tree.map(lambda new, old: new - old, trained, params)


def make_program(num_clients: int = NUM_CLIENTS):
    """The post-round loss as an ``fcir.program`` over ``num_clients`` clients."""

    @fcir.program(placements={"clients": num_clients})
    def post_round_loss(meta, x, y):
        """``meta = {"params": initial model, "log_server_lr": scalar}``; ``x, y`` placed."""
        params = meta["params"]
        server_lr = jnp.exp(meta["log_server_lr"])
        deltas = fcir.map_fn(client_update, (fcir.broadcast(params), x, y))
        mean_delta = fcir.reduce_mean(deltas)
        new_params = jax.tree.map(lambda p, d: p + server_lr * d, params, mean_delta)
        losses = fcir.map_fn(local_loss, (fcir.broadcast(new_params), x, y))
        return fcir.reduce_mean(losses)

    return post_round_loss


post_round_loss = make_program(NUM_CLIENTS)


def make_args(num_clients: int = NUM_CLIENTS, examples: int = EXAMPLES, seed: int = 0):
    """Initial meta-parameters and heterogeneous client data (each client its own teacher)."""
    rng = np.random.default_rng(seed)
    params = {
        "w1": rng.normal(size=(DIM, HIDDEN)) / np.sqrt(DIM),
        "w2": rng.normal(size=(HIDDEN, 1)) / np.sqrt(HIDDEN),
    }
    meta = {
        "params": jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), params),
        "log_server_lr": jnp.float32(0.0),
    }
    shared = rng.normal(size=(DIM, 1))
    teachers = shared + 0.3 * rng.normal(size=(num_clients, DIM, 1))
    x = rng.normal(size=(num_clients, examples, DIM))
    y = np.tanh(x @ teachers) + 0.05 * rng.normal(size=(num_clients, examples, 1))
    return meta, jnp.asarray(x, jnp.float32), jnp.asarray(y, jnp.float32)


# Example arguments of the function whose gradient is taken (for tools such as
# ``fcir compile examples/meta_learning.py:post_round_loss``).
EXAMPLE_ARGS = {"post_round_loss": make_args}


def run(
    num_clients: int = NUM_CLIENTS,
    meta_steps: int = 5,
    examples: int = EXAMPLES,
    meta_lr: float = META_LR,
    verbose: bool = True,
) -> list[float]:
    """Runs ``meta_steps`` meta-gradient steps; returns the post-round loss before each
    step and after the last one."""
    program = post_round_loss if num_clients == NUM_CLIENTS else make_program(num_clients)
    meta, x, y = make_args(num_clients, examples)

    @functools.partial(jax.jit, donate_argnums=())
    def meta_step(meta, x, y):
        loss, grads = jax.value_and_grad(program)(meta, x, y)
        new_meta = jax.tree.map(lambda m, g: m - meta_lr * g, meta, grads)
        return new_meta, loss

    losses = []
    for i in range(meta_steps):
        lr = float(jnp.exp(meta["log_server_lr"]))
        meta, loss = meta_step(meta, x, y)
        losses.append(float(loss))
        if verbose:
            print(f"meta-step {i}: post-round loss {losses[-1]:.5f}  (server lr {lr:.4f})")
    losses.append(float(jax.jit(program)(meta, x, y)))
    if verbose:
        lr = float(jnp.exp(meta["log_server_lr"]))
        print(
            f"after {meta_steps} meta-steps: post-round loss {losses[-1]:.5f}  (server lr {lr:.4f})"
        )
    return losses


if __name__ == "__main__":
    run()
