"""FedAdam: clients run local SGD, the server applies Adam to the mean client delta.

The server state (model and optax Adam state) goes in and comes out of every round;
the negated mean delta is the server's "gradient" (Reddi et al., Adaptive Federated
Optimization, 2021)::

    python examples/fedadam.py --rounds 30 --clients 8
    fcir compile examples/fedadam.py:fedadam_round -o out/
"""

from __future__ import annotations

import argparse

import _mlp as mlp
import jax
import jax.numpy as jnp
import numpy as np
import optax
from fcir.interpreters import xla

import fcir
from fcir.report.progress import RoundProgress

CLIENTS, LOCAL_STEPS, BATCH, CLIENT_LR = 8, 5, 16, 0.1
SERVER_OPT = optax.adam(learning_rate=0.05)


def client_update(params, x, y):
    trained, loss = mlp.sgd(params, x, y, CLIENT_LR)
    return jax.tree.map(jnp.subtract, trained, params), loss


def make_round(clients: int):
    @fcir.program(placements={"clients": clients})
    def fedadam_round(params, opt_state, x, y):
        deltas, losses = fcir.map_fn(client_update, (fcir.broadcast(params), x, y))
        pseudo_grad = jax.tree.map(jnp.negative, fcir.reduce_mean(deltas))
        updates, opt_state = SERVER_OPT.update(pseudo_grad, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, fcir.reduce_mean(losses)

    return fedadam_round


fedadam_round = make_round(CLIENTS)


def example_args(clients: int = CLIENTS, rng=None):
    rng = rng if rng is not None else np.random.default_rng(0)
    params = mlp.init_params()
    return (params, SERVER_OPT.init(params), *mlp.client_data(rng, (clients,), LOCAL_STEPS, BATCH))


EXAMPLE_ARGS = {"fedadam_round": example_args}


def main(argv: list[str] | None = None) -> list[float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--clients", type=int, default=CLIENTS)
    args = parser.parse_args(argv)

    rng = np.random.default_rng(0)
    params, opt_state, x, y = example_args(args.clients, rng)
    module = fcir.capture(make_round(args.clients), params, opt_state, x, y)
    step = xla.compile(module)
    progress = RoundProgress(args.rounds, module=module)
    for _ in progress:
        x, y = mlp.client_data(rng, (args.clients,), LOCAL_STEPS, BATCH)
        params, opt_state, loss = step(params, opt_state, x, y)
        progress.log(loss=loss)
    return [h["loss"] for h in progress.history]


if __name__ == "__main__":
    main()
