"""Hierarchical FedAvg: the server talks to silos, each silo to its own clients.

Placements nest outermost first: ``{"silos": 3, "clients": 4}``. The server broadcasts
the model to the silos; inside each silo's ``map_fn`` body the silo broadcasts it on
to its clients, they train, and the silo averages their deltas; the server averages
the silos. Only silos talk to the server, and no client talks to another silo::

    python examples/hierarchical.py --rounds 20 --silos 3 --clients 4
    fcir show examples/hierarchical.py:hierarchical_round --format svg -o silos.svg
"""

from __future__ import annotations

import argparse

import _mlp as mlp
import jax
import jax.numpy as jnp
import numpy as np
from fcir.interpreters import xla

import fcir
from fcir.report.progress import RoundProgress

SILOS, CLIENTS_PER_SILO, LOCAL_STEPS, BATCH, LR = 3, 4, 4, 16, 0.1


def client_update(params, x, y):
    trained, loss = mlp.sgd(params, x, y, LR)
    return jax.tree.map(jnp.subtract, trained, params), loss


def silo_round(params, x, y):
    """One silo: FedAvg over its own clients; returns (mean delta, mean loss)."""
    deltas, losses = fcir.map_fn(client_update, (fcir.broadcast(params), x, y))
    return fcir.reduce_mean(deltas), fcir.reduce_mean(losses)


def make_round(silos: int, clients: int):
    @fcir.program(placements={"silos": silos, "clients": clients})
    def hierarchical_round(params, x, y):
        deltas, losses = fcir.map_fn(silo_round, (fcir.broadcast(params), x, y))
        params = jax.tree.map(jnp.add, params, fcir.reduce_mean(deltas))
        return params, fcir.reduce_mean(losses)

    return hierarchical_round


hierarchical_round = make_round(SILOS, CLIENTS_PER_SILO)


def example_args(silos: int = SILOS, clients: int = CLIENTS_PER_SILO, rng=None):
    rng = rng if rng is not None else np.random.default_rng(0)
    return (mlp.init_params(), *mlp.client_data(rng, (silos, clients), LOCAL_STEPS, BATCH))


EXAMPLE_ARGS = {"hierarchical_round": example_args}


def main(argv: list[str] | None = None) -> list[float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--silos", type=int, default=SILOS)
    parser.add_argument("--clients", type=int, default=CLIENTS_PER_SILO, help="per silo")
    args = parser.parse_args(argv)

    rng = np.random.default_rng(0)
    params, x, y = example_args(args.silos, args.clients, rng)
    module = fcir.capture(make_round(args.silos, args.clients), params, x, y)
    step = xla.compile(module)
    progress = RoundProgress(args.rounds, module=module)
    for _ in progress:
        x, y = mlp.client_data(rng, (args.silos, args.clients), LOCAL_STEPS, BATCH)
        params, loss = step(params, x, y)
        progress.log(loss=loss)
    return [h["loss"] for h in progress.history]


if __name__ == "__main__":
    main()
