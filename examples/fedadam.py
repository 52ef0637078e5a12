"""FedAdam with ``fcir.learning``: clients run local SGD, the server applies Adam to the
mean client update, as Flower's ``FedAdam`` computes it (Reddi et al., Adaptive
Federated Optimization, 2021). ``learning.fedopt(..., server_optimizer=optax.adam(...))``
is the same with optax's own Adam::

    python examples/fedadam.py --rounds 30 --clients 8
    fcir compile examples/fedadam.py:fedadam_round -o out/
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

CLIENTS, LOCAL_STEPS, BATCH = 8, 5, 16


def loss_fn(params, batch):
    return mlp.loss(params, batch["x"], batch["y"])


ALGO = learning.fedadam(loss_fn, client_optimizer=optax.sgd(0.1), eta=0.05)
fedadam_round = ALGO.round(clients=CLIENTS)  # an @fcir.program: (state, data) -> (state, metrics)


def client_data(rng, clients: int) -> dict:
    """A round's data: leaves [clients, local steps, batch, ...]."""
    x, y = mlp.client_data(rng, (clients,), LOCAL_STEPS, BATCH)
    return {"x": x, "y": y}


def example_args(clients: int = CLIENTS, rng=None):
    rng = rng if rng is not None else np.random.default_rng(0)
    return ALGO.init(mlp.init_params()), client_data(rng, clients)


EXAMPLE_ARGS = {"fedadam_round": example_args}


def main(argv: list[str] | None = None) -> list[float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--clients", type=int, default=CLIENTS)
    args = parser.parse_args(argv)

    rng = np.random.default_rng(0)
    state, data = example_args(args.clients, rng)
    module = fcir.capture(ALGO.round(clients=args.clients), state, data)
    step = xla.compile(module)
    progress = RoundProgress(args.rounds, module=module)
    for _ in progress:
        state, metrics = step(state, client_data(rng, args.clients))
        progress.log(loss=metrics["loss"])
    return [h["loss"] for h in progress.history]


if __name__ == "__main__":
    main()
