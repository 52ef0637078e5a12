"""DiLoCo with ``fcir.learning``: many local AdamW steps per client, Nesterov momentum
on the server.

Each client starts from the broadcast model with a fresh inner AdamW state and runs
``--inner-steps`` steps; the server treats ``model - mean(client models)`` as an outer
gradient for SGD with Nesterov momentum (Douillard et al., DiLoCo, 2023; learning rate
0.7, momentum 0.9, ``learning.diloco``'s default). Few rounds, much local work: the
communication per unit of compute is low::

    python examples/diloco.py --rounds 10 --inner-steps 20
    fcir compile examples/diloco.py:diloco_round -o out/
"""

from __future__ import annotations

import argparse

import _mlp as mlp
import numpy as np
import optax
from fcir.interpreters import xla

import fcir
from fcir import learning
from fcir.report.progress import RoundProgress

CLIENTS, INNER_STEPS, BATCH = 4, 20, 16


def loss_fn(params, batch):
    return mlp.loss(params, batch["x"], batch["y"])


ALGO = learning.diloco(loss_fn, client_optimizer=optax.adamw(3e-3, weight_decay=1e-4))
diloco_round = ALGO.round(clients=CLIENTS)


def client_data(rng, clients: int, inner_steps: int) -> dict:
    x, y = mlp.client_data(rng, (clients,), inner_steps, BATCH)
    return {"x": x, "y": y}


def example_args(clients: int = CLIENTS, inner_steps: int = INNER_STEPS, rng=None):
    rng = rng if rng is not None else np.random.default_rng(0)
    return ALGO.init(mlp.init_params()), client_data(rng, clients, inner_steps)


EXAMPLE_ARGS = {"diloco_round": example_args}


def main(argv: list[str] | None = None) -> list[float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--clients", type=int, default=CLIENTS)
    parser.add_argument("--inner-steps", type=int, default=INNER_STEPS)
    args = parser.parse_args(argv)

    rng = np.random.default_rng(0)
    state, data = example_args(args.clients, args.inner_steps, rng)
    module = fcir.capture(ALGO.round(clients=args.clients), state, data)
    step = xla.compile(module)
    progress = RoundProgress(args.rounds, module=module)
    for _ in progress:
        state, metrics = step(state, client_data(rng, args.clients, args.inner_steps))
        progress.log(loss=metrics["loss"])
    return [h["loss"] for h in progress.history]


if __name__ == "__main__":
    main()
