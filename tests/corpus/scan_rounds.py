"""Several rounds in one program: ``lax.scan`` over FedAvg rounds with server momentum.

Each round broadcasts the model, every client takes one gradient step on its own data
(a tanh regression, so the backward pass keeps per-round client residuals), and the
server averages the client deltas into a momentum buffer and steps by ``server_lr``
times it. The scan carries the model and the momentum and stacks the mean client loss
of every round. ``server_lr`` is an argument, so the case differentiates with respect
to it (the meta-gradient of a server learning rate). Not exportable: a production round
is one broadcast/aggregate exchange, this is ``ROUNDS`` of them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import fcir

from . import loops
from .case import Case, sum_of_squares

NUM_CLIENTS = 3
ROUNDS = 3
EXAMPLES = 4
DIM = 3
CLIENT_LR = 0.1
BETA = 0.9


def client_loss(w, x, y):
    return jnp.mean(jnp.square(jnp.tanh(x @ w) - y))


def client_update(w, x, y):
    loss, grad = jax.value_and_grad(client_loss)(w, x, y)
    return -CLIENT_LR * grad, loss


def build(api=fcir):
    @api.program(placements={"clients": NUM_CLIENTS})
    def scan_rounds(w, momentum, server_lr, x, y):
        def one_round(carry, _):
            w, m = carry
            deltas, losses = api.map_fn(client_update, (api.broadcast(w), x, y))
            m = BETA * m + api.reduce_mean(deltas)
            return (w + server_lr * m, m), api.reduce_mean(losses)

        (w, m), losses = jax.lax.scan(one_round, (w, momentum), None, length=ROUNDS)
        return w, m, losses

    return scan_rounds


def make_args():
    rng = np.random.default_rng(11)
    w = jnp.asarray(rng.normal(size=DIM), jnp.float32)
    momentum = jnp.asarray(0.05 * rng.normal(size=DIM), jnp.float32)
    x = jnp.asarray(rng.normal(size=(NUM_CLIENTS, EXAMPLES, DIM)), jnp.float32)
    y = jnp.asarray(0.5 * rng.normal(size=(NUM_CLIENTS, EXAMPLES)), jnp.float32)
    return w, momentum, jnp.float32(0.7), x, y


# Plain jax.jit, not oracle_jit: under the server-lr gradient the first round's model is
# still concrete while the enclosing computation is traced, and compiler options are
# only allowed on an outermost jit.
@jax.jit
def _oracle_client(w, x, y, i):
    # The gradient of mean((tanh(x w) - y)^2) written out, independent of jax.grad.
    t = jnp.tanh(x[i] @ w)
    r = t - y[i]
    grad = x[i].T @ (2.0 * r * (1.0 - t * t)) / r.size
    return -CLIENT_LR * grad, jnp.mean(jnp.square(r))


def oracle(w, momentum, server_lr, x, y):
    losses = []
    for _ in range(ROUNDS):
        deltas, round_losses = zip(*[_oracle_client(w, x, y, i) for i in range(NUM_CLIENTS)])
        momentum = BETA * momentum + loops.mean(list(deltas))
        w = w + server_lr * momentum
        losses.append(loops.mean(list(round_losses)))
    return w, momentum, jnp.stack(losses)


CASE = Case(
    name="scan_rounds",
    fn=build(),
    make_args=make_args,
    oracle=oracle,
    grad_argnums=(2,),
    loss=sum_of_squares,
    exportable=False,
)
