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

    python examples/fedavg.py --rounds 8 --clients 8

or sample a cohort of ``--clients`` each round from a population of 1,000 clients
(``fcir.Population``), the rounds run by ``xla.simulate`` (docs/population.md)::

    python examples/fedavg.py --rounds 8 --clients 8 --population 1000
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from fcir.interpreters import xla

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


def make_round(num_clients: int):
    """The FedAvg round for ``num_clients`` clients (the cardinality is part of the program)."""

    @fcir.program(placements={"clients": num_clients})
    def fedavg_round(model, client_data):
        """One FedAvg round: ``(f32[16,1]@server, {(f32[32,16], f32[32,1])}@clients)
        -> (f32[16,1]@server, f32[]@server)``, the new model and the mean client loss."""
        model_at_clients = fcir.broadcast(model)
        new_models, losses = fcir.map_fn(local_train, (model_at_clients, client_data))
        return fcir.reduce_mean(new_models), fcir.reduce_mean(losses)

    return fedavg_round


fedavg_round = make_round(NUM_CLIENTS)


def make_example_args(num_clients: int = NUM_CLIENTS, seed: int = 0):
    """A zero model and synthetic client data from a shared linear teacher."""
    rng = np.random.default_rng(seed)
    teacher = rng.normal(size=(DIM, 1))
    x = rng.normal(size=(num_clients, EXAMPLES_PER_CLIENT, DIM))
    # Each client's labels are shifted a little: client data are not identically distributed.
    shift = rng.normal(scale=0.3, size=(num_clients, 1, 1))
    y = x @ teacher + shift + 0.1 * rng.normal(size=(num_clients, EXAMPLES_PER_CLIENT, 1))
    model = np.zeros((DIM, 1), np.float32)
    return jnp.asarray(model), (jnp.asarray(x, jnp.float32), jnp.asarray(y, jnp.float32))


# Example arguments per program, for ``fcir compile FILE:FUNCTION`` without ``--args``.
EXAMPLE_ARGS = {"fedavg_round": make_example_args}


def main(argv: list[str] | None = None) -> list[float]:
    """Runs ``--rounds`` rounds, printing the mean client loss; returns the losses."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--clients", type=int, default=NUM_CLIENTS)
    parser.add_argument("--population", type=int, default=None,
                        help="clients in all, of which each round samples --clients")
    args = parser.parse_args(argv)
    if args.population is not None:
        return population_main(args)

    model, client_data = make_example_args(args.clients)
    # An fcir program is an ordinary JAX function: jax.jit compiles the whole round.
    run_round = jax.jit(make_round(args.clients))
    losses = []
    for r in range(1, args.rounds + 1):
        model, loss = run_round(model, client_data)
        losses.append(float(loss))
        print(f"round {r}/{args.rounds} | loss {losses[-1]:.4f}")
    return losses


def population_main(args) -> list[float]:
    """``--rounds`` rounds over cohorts of ``--clients`` from ``--population`` clients."""
    model, client_data = make_example_args(args.population)
    population = fcir.Population(tuple(np.asarray(d) for d in client_data))  # on the host
    cohorts = population.uniform(args.clients, seed=0)
    fedavg = make_round(cohorts.size)
    losses = []

    def report(r, model, loss):
        losses.append(float(loss))
        print(f"round {r + 1}/{args.rounds} | loss {losses[-1]:.4f} | cohort of "
              f"{cohorts.size} from {population.size} clients")

    # Every client has the same number of examples: the round ignores the counts.
    xla.simulate(lambda m, data, counts: fedavg(m, data), model, cohorts, args.rounds,
                 loop="host", callback=report)  # fmt: skip
    return losses


if __name__ == "__main__":
    main()
