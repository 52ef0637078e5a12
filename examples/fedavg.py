"""Federated averaging (FedAvg) written with fcir.

One round of FedAvg (McMahan et al., 2017) on linear regression:

1. the server broadcasts its model to every client          ``fcir.broadcast``
2. each client runs a few SGD steps on its own data            ``fcir.map_fn``
3. the server averages the clients' new models                 ``fcir.reduce_mean``

``fedavg_round`` is an ordinary JAX function: ``jax.jit`` compiles it, ``jax.grad``
differentiates it, and ``fcir.capture`` turns it into fcir IR. The per-client function
``local_train`` sees one client's data with unbatched shapes; fcir keeps it as the body
of a ``fed.map`` region rather than inlining a batched copy.

Compile it to IR, HLO and a cost report (the arguments come from ``EXAMPLE_ARGS``)::

    fcir compile examples/fedavg.py:fedavg_round -o out/

or give the argument types explicitly::

    fcir compile examples/fedavg.py:fedavg_round --args 'f32[16,1]' '(f32[8,32,16], f32[8,32,1])'

Run a few rounds and watch the loss go down::

    python examples/fedavg.py
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import fcir

NUM_CLIENTS = 8
EXAMPLES_PER_CLIENT = 32
DIM = 16
BATCH = 8  # each client takes EXAMPLES_PER_CLIENT // BATCH local SGD steps per round
LEARNING_RATE = 0.05


def loss_fn(model, x, y):
    """Mean squared error of the linear model ``x @ model`` on one batch."""
    return jnp.mean(jnp.square(x @ model - y))


def local_train(model, client_data):
    """One client's work: SGD over its data in batches; returns (new model, mean loss).

    Shapes are one client's: ``model`` f32[DIM, 1], ``x`` f32[EXAMPLES, DIM],
    ``y`` f32[EXAMPLES, 1].
    """
    x, y = client_data
    batches = (
        x.reshape(-1, BATCH, x.shape[-1]),
        y.reshape(-1, BATCH, y.shape[-1]),
    )

    def sgd_step(model, batch):
        loss, grad = jax.value_and_grad(loss_fn)(model, *batch)
        return model - LEARNING_RATE * grad, loss

    model, losses = jax.lax.scan(sgd_step, model, batches)
    return model, jnp.mean(losses)


@fcir.program(placements={"clients": NUM_CLIENTS})
def fedavg_round(model, client_data):
    """One FedAvg round: ``(f32[16,1]@server, {(f32[32,16], f32[32,1])}@clients)
    -> (f32[16,1]@server, f32[]@server)``, the new model and the mean client loss."""
    model_at_clients = fcir.broadcast(model)
    new_models, losses = fcir.map_fn(local_train, (model_at_clients, client_data))
    return fcir.reduce_mean(new_models), fcir.reduce_mean(losses)


def make_example_args(seed: int = 0):
    """A zero model and synthetic client data from a shared linear teacher."""
    rng = np.random.default_rng(seed)
    teacher = rng.normal(size=(DIM, 1))
    x = rng.normal(size=(NUM_CLIENTS, EXAMPLES_PER_CLIENT, DIM))
    # Each client's labels are shifted a little: client data are not identically distributed.
    shift = rng.normal(scale=0.3, size=(NUM_CLIENTS, 1, 1))
    y = x @ teacher + shift + 0.1 * rng.normal(size=(NUM_CLIENTS, EXAMPLES_PER_CLIENT, 1))
    model = np.zeros((DIM, 1), np.float32)
    return jnp.asarray(model), (jnp.asarray(x, jnp.float32), jnp.asarray(y, jnp.float32))


# Example arguments per program, for ``fcir compile FILE:FUNCTION`` without ``--args``.
EXAMPLE_ARGS = {"fedavg_round": make_example_args}


def main(rounds: int = 8) -> None:
    model, client_data = make_example_args()
    run_round = jax.jit(fedavg_round)
    for r in range(rounds):
        model, loss = run_round(model, client_data)
        print(f"round {r}: mean client training loss {float(loss):.4f}")


if __name__ == "__main__":
    main()
