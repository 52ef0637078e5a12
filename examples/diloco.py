"""DiLoCo: many local AdamW steps per client, Nesterov momentum on the server.

Each client starts from the broadcast model with a fresh inner AdamW state and runs
``--inner-steps`` steps; the server treats ``model - mean(client models)`` as an outer
gradient for SGD with Nesterov momentum (Douillard et al., DiLoCo, 2023). Few rounds,
much local work: the communication per unit of compute is low::

    python examples/diloco.py --rounds 10 --inner-steps 20
    fcir compile examples/diloco.py:diloco_round -o out/
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

CLIENTS, INNER_STEPS, BATCH = 4, 20, 16
INNER_OPT = optax.adamw(learning_rate=3e-3, weight_decay=1e-4)
OUTER_OPT = optax.sgd(learning_rate=0.7, momentum=0.9, nesterov=True)


def inner_loop(params, x, y):
    def step(carry, batch):
        p, state = carry
        value, grads = jax.value_and_grad(mlp.loss)(p, *batch)
        updates, state = INNER_OPT.update(grads, state, p)
        return (optax.apply_updates(p, updates), state), value

    (trained, _), losses = jax.lax.scan(step, (params, INNER_OPT.init(params)), (x, y))
    return jax.tree.map(jnp.subtract, params, trained), losses.mean()


def make_round(clients: int):
    @fcir.program(placements={"clients": clients})
    def diloco_round(params, momentum, x, y):
        outer_grads, losses = fcir.map_fn(inner_loop, (fcir.broadcast(params), x, y))
        updates, momentum = OUTER_OPT.update(fcir.reduce_mean(outer_grads), momentum, params)
        return optax.apply_updates(params, updates), momentum, fcir.reduce_mean(losses)

    return diloco_round


diloco_round = make_round(CLIENTS)


def example_args(clients: int = CLIENTS, inner_steps: int = INNER_STEPS, rng=None):
    rng = rng if rng is not None else np.random.default_rng(0)
    params = mlp.init_params()
    return (params, OUTER_OPT.init(params), *mlp.client_data(rng, (clients,), inner_steps, BATCH))


EXAMPLE_ARGS = {"diloco_round": example_args}


def main(argv: list[str] | None = None) -> list[float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--clients", type=int, default=CLIENTS)
    parser.add_argument("--inner-steps", type=int, default=INNER_STEPS)
    args = parser.parse_args(argv)

    rng = np.random.default_rng(0)
    params, momentum, x, y = example_args(args.clients, args.inner_steps, rng)
    module = fcir.capture(make_round(args.clients), params, momentum, x, y)
    step = xla.compile(module)
    progress = RoundProgress(args.rounds, module=module)
    for _ in progress:
        x, y = mlp.client_data(rng, (args.clients,), args.inner_steps, BATCH)
        params, momentum, loss = step(params, momentum, x, y)
        progress.log(loss=loss)
    return [h["loss"] for h in progress.history]


if __name__ == "__main__":
    main()
