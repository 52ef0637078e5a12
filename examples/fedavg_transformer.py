"""FedAvg on a small transformer language model over synthetic token streams.

Every round the server broadcasts the model, each client takes a few SGD steps on its
own token streams, and the server adds the mean of the clients' model deltas::

    python examples/fedavg_transformer.py --rounds 20 --clients 4
    fcir show examples/fedavg_transformer.py:fedavg_transformer_round --format svg -o round.svg
    fcir compile examples/fedavg_transformer.py:fedavg_transformer_round -o out/
"""

from __future__ import annotations

import argparse

import _transformer as lm
import jax
import jax.numpy as jnp
import numpy as np
from fcir.interpreters import xla

import fcir
from fcir.report.progress import RoundProgress

CLIENTS, LOCAL_STEPS, BATCH, LR = 4, 4, 8, 0.25


def client_update(params, tokens):
    """One client: SGD over ``tokens[steps, batch, seq + 1]``; returns (delta, mean loss)."""

    def step(p, batch):
        value, grads = jax.value_and_grad(lm.loss)(p, batch)
        return jax.tree.map(lambda w, g: w - LR * g, p, grads), value

    trained, losses = jax.lax.scan(step, params, tokens)
    return jax.tree.map(jnp.subtract, trained, params), losses.mean()


def make_round(clients: int):
    @fcir.program(placements={"clients": clients})
    def fedavg_transformer_round(params, tokens):
        deltas, losses = fcir.map_fn(client_update, (fcir.broadcast(params), tokens))
        params = jax.tree.map(jnp.add, params, fcir.reduce_mean(deltas))
        return params, fcir.reduce_mean(losses)

    return fedavg_transformer_round


fedavg_transformer_round = make_round(CLIENTS)


def example_args(clients: int = CLIENTS, rng=None):
    rng = rng if rng is not None else np.random.default_rng(0)
    return lm.init_params(), lm.token_streams(rng, clients, LOCAL_STEPS, BATCH)


EXAMPLE_ARGS = {"fedavg_transformer_round": example_args}


def main(argv: list[str] | None = None) -> list[float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--clients", type=int, default=CLIENTS)
    args = parser.parse_args(argv)

    rng = np.random.default_rng(0)
    params, tokens = example_args(args.clients, rng)
    module = fcir.capture(make_round(args.clients), params, tokens)
    step = xla.compile(module)
    progress = RoundProgress(args.rounds, module=module)
    for _ in progress:
        params, loss = step(params, lm.token_streams(rng, args.clients, LOCAL_STEPS, BATCH))
        progress.log(loss=loss)
    return [h["loss"] for h in progress.history]


if __name__ == "__main__":
    main()
