"""SCAFFOLD written with fcir: per-client state that stays at the clients between rounds.

SCAFFOLD (Karimireddy et al., 2020) corrects client drift with control variates: the
server keeps a model ``x`` and a control ``c``; every client keeps its own control
``c_i``, which never leaves it. Each round:

1. the server broadcasts ``x`` and ``c``                         ``fcir.broadcast``
2. each client takes ``LOCAL_STEPS`` steps ``y -= lr (g_i(y) - c_i + c)`` from ``x``,
   and updates its control ``c_i+ = c_i - c + (x - y) / (LOCAL_STEPS lr)``
   (option II of the paper)                                     ``fcir.map_fn``
3. the server averages the model deltas and the control deltas    ``fcir.reduce_mean``

The whole training is one program: a ``lax.scan`` over ``ROUNDS`` rounds whose carry
holds the server's ``(x, c)`` *and* the clients' ``{c_i}@clients``. On Flower
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

import fcir

NUM_CLIENTS = 3
ROUNDS = 4
EXAMPLES = 16
DIM = 4
LOCAL_STEPS = 3
LR = 0.1


def loss_fn(w, x, y):
    return jnp.mean(jnp.square(x @ w - y))


def client_update(x_server, c, c_i, x, y):
    """One client's SCAFFOLD update: (model delta, control delta, new control, loss)."""

    def step(w, _):
        g = jax.grad(loss_fn)(w, x, y)
        return w - LR * (g - c_i + c), None

    w, _ = jax.lax.scan(step, x_server, None, length=LOCAL_STEPS)
    c_new = c_i - c + (x_server - w) / (LOCAL_STEPS * LR)
    return w - x_server, c_new - c_i, c_new, loss_fn(x_server, x, y)


def make_program(num_clients: int = NUM_CLIENTS, rounds: int = ROUNDS):
    @fcir.program(placements={"clients": num_clients})
    def scaffold(model, control, client_controls, x, y):
        """``ROUNDS`` rounds of SCAFFOLD; returns the model, the server control and the
        mean client loss of every round (the clients' controls stay at the clients)."""

        def one_round(carry, _):
            model, control, client_controls = carry
            dw, dc, client_controls, losses = fcir.map_fn(
                client_update,
                (fcir.broadcast(model), fcir.broadcast(control), client_controls, x, y),
            )
            model = model + fcir.reduce_mean(dw)
            control = control + fcir.reduce_mean(dc)
            return (model, control, client_controls), fcir.reduce_mean(losses)

        (model, control, _), losses = jax.lax.scan(
            one_round, (model, control, client_controls), None, length=rounds
        )
        return model, control, losses

    return scaffold


scaffold = make_program()


def make_example_args(num_clients: int = NUM_CLIENTS, seed: int = 0):
    """A zero model and zero controls; each client's linear teacher differs (drift)."""
    rng = np.random.default_rng(seed)
    teachers = rng.normal(size=(num_clients, DIM)) + rng.normal(size=DIM)
    x = rng.normal(size=(num_clients, EXAMPLES, DIM))
    y = np.einsum("ned,nd->ne", x, teachers) + 0.1 * rng.normal(size=(num_clients, EXAMPLES))
    zeros = np.zeros(DIM, np.float32)
    return (
        jnp.asarray(zeros),
        jnp.asarray(zeros),
        jnp.zeros((num_clients, DIM), jnp.float32),
        jnp.asarray(x, jnp.float32),
        jnp.asarray(y, jnp.float32),
    )


# Example arguments per program, for ``fcir compile FILE:FUNCTION`` without ``--args``.
EXAMPLE_ARGS = {"scaffold": make_example_args}


def by_hand(model, control, client_controls, x, y, participation=None):
    """The same training in plain JAX, one client at a time, no fcir. ``participation``
    (a list of client index lists, one per round; default: every client every round):
    the rounds a client sits out leave its control as it was, and the means run over
    the clients that took part, as an exported app computes them on Flower."""
    n = x.shape[0]
    controls = [client_controls[i] for i in range(n)]
    losses = []
    for r in range(ROUNDS):
        who = range(n) if participation is None else participation[r]
        outs = {i: client_update(model, control, controls[i], x[i], y[i]) for i in who}
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
