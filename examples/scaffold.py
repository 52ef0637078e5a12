"""SCAFFOLD with ``fcir.learning``: per-client state that stays at the clients.

SCAFFOLD (Karimireddy et al., 2020) corrects client drift with control variates: the
server keeps a model ``x`` and a control ``c``; every client keeps its own control
``c_i``, which never leaves it. Each round (``learning.scaffold``'s round):

1. the server broadcasts ``x`` and ``c``                         ``fcir.broadcast``
2. each client takes ``LOCAL_STEPS`` steps ``y -= lr (g_i(y) - c_i + c)`` from ``x``,
   and updates its control ``c_i+ = c_i - c + (x - y) / (LOCAL_STEPS lr)``
   (option II of the paper)                                     ``fcir.map_fn``
3. the server averages the models and the control deltas          ``fcir.reduce_mean``

The whole training is one program: a ``lax.scan`` of ``ROUNDS`` of those rounds whose
carry, the algorithm's state, holds the server's ``(x, c)`` *and* the clients'
``{c_i}@clients``. On Flower
(``fcir export --target flower``) the app runs one Flower round per iteration; the
clients' controls are kept on their nodes, keyed by the run and the partition-id
(docs/flower.md, "Per-client state")::

    fcir flower data examples/scaffold.py:scaffold -o parts/
    fcir export --target flower examples/scaffold.py:scaffold -o app/ \\
        --inputs parts/server_inputs.npz
    fcir flower up --nodes 3 --data parts/ --dir /tmp/dep &
    FLWR_HOME=/tmp/dep/home-cli fcir flower run app/ --run-config 'output="/abs/out.npz"'

Run it in-process and watch the loss go down::

    python examples/scaffold.py
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax

import fcir
from fcir import learning

NUM_CLIENTS = 3
ROUNDS = 4
EXAMPLES = 16
DIM = 4
LOCAL_STEPS = 3
LR = 0.1


def loss_fn(w, batch):
    return jnp.mean(jnp.square(batch["x"] @ w - batch["y"]))


ALGO = learning.scaffold(loss_fn, client_optimizer=optax.sgd(LR))


def make_program(num_clients: int = NUM_CLIENTS, rounds: int = ROUNDS):
    one_round = ALGO.round(clients=num_clients)

    @fcir.program(placements={"clients": num_clients})
    def scaffold(model, control, client_controls, x, y):
        """``ROUNDS`` rounds of SCAFFOLD; returns the model, the server control and the
        mean client loss of every round (the clients' controls stay at the clients)."""
        state = {"params": model, "control": control, "client_controls": client_controls,
                 "round": jnp.int32(0)}  # fmt: skip
        state, metrics = jax.lax.scan(
            lambda state, _: one_round(state, {"x": x, "y": y}), state, None, length=rounds
        )
        return state["params"], state["control"], metrics["loss"]

    return scaffold


scaffold = make_program()


def make_example_args(num_clients: int = NUM_CLIENTS, seed: int = 0):
    """A zero model and zero controls; each client's linear teacher differs (drift). A
    client's data is one batch of ``EXAMPLES``, taken at each of its ``LOCAL_STEPS``
    steps (``x: [clients, LOCAL_STEPS, EXAMPLES, DIM]``)."""
    rng = np.random.default_rng(seed)
    teachers = rng.normal(size=(num_clients, DIM)) + rng.normal(size=DIM)
    x = rng.normal(size=(num_clients, EXAMPLES, DIM))
    y = np.einsum("ned,nd->ne", x, teachers) + 0.1 * rng.normal(size=(num_clients, EXAMPLES))

    def steps(a):
        return jnp.asarray(np.repeat(a[:, None], LOCAL_STEPS, axis=1), jnp.float32)

    zeros = np.zeros(DIM, np.float32)
    return (
        jnp.asarray(zeros),
        jnp.asarray(zeros),
        jnp.zeros((num_clients, DIM), jnp.float32),
        steps(x),
        steps(y),
    )


# Example arguments per program, for ``fcir compile FILE:FUNCTION`` without ``--args``.
EXAMPLE_ARGS = {"scaffold": make_example_args}


def by_hand(model, control, client_controls, x, y, participation=None):
    """The paper's rule in plain JAX, one client at a time, no fcir. ``participation``
    (a list of client index lists, one per round; default: every client every round):
    the rounds a client sits out leave its control as it was, and the means run over
    the clients that took part, as an exported app computes them on Flower."""
    n = x.shape[0]
    controls = [client_controls[i] for i in range(n)]
    grad = jax.grad(loss_fn)
    losses = []
    for r in range(ROUNDS):
        who = range(n) if participation is None else participation[r]
        outs = {}
        for i in who:
            w, seen = model, []
            for s in range(LOCAL_STEPS):
                batch = {"x": x[i, s], "y": y[i, s]}
                seen.append(loss_fn(w, batch))
                w = w - LR * (grad(w, batch) - controls[i] + control)
            c_new = controls[i] - control + (model - w) / (LOCAL_STEPS * LR)
            outs[i] = (w - model, c_new - controls[i], c_new, jnp.mean(jnp.stack(seen)))
        for i, (_, _, c_new, _) in outs.items():
            controls[i] = c_new
        model = model + jnp.mean(jnp.stack([o[0] for o in outs.values()]), axis=0)
        control = control + jnp.mean(jnp.stack([o[1] for o in outs.values()]), axis=0)
        losses.append(jnp.mean(jnp.stack([o[3] for o in outs.values()])))
    return model, control, jnp.stack(losses), jnp.stack(controls)


def main(argv: list[str] | None = None) -> list[float]:
    """Runs the program with jax.jit; prints and returns the loss of every round."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=NUM_CLIENTS)
    args = parser.parse_args(argv)
    _, _, losses = jax.jit(make_program(args.clients))(*make_example_args(args.clients))
    for r, loss in enumerate(np.asarray(losses), 1):
        print(f"round {r}/{ROUNDS} | loss {loss:.4f}")
    return [float(v) for v in losses]


if __name__ == "__main__":
    main()
