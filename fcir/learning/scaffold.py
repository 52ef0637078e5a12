"""SCAFFOLD (Karimireddy et al., ICML 2020): local steps corrected for client drift by
control variates, each client's own kept at the client.

The server keeps the model ``x`` and its control ``c``; member ``i`` keeps ``c_i``
(``state["client_controls"]``, one per member: state placed at the clients, which
never travels). Each round the server broadcasts ``x`` and ``c``; member ``i`` takes
its local steps from ``x`` with corrected gradients ``g(y) - c_i + c`` and sets its new
control to the mean of its uncorrected gradients ``g(y)`` along the way, which for
SGD is the paper's option II, ``c_i - c + (x - y_i) / (K lr)``, and is defined for any
``client_optimizer``. It sends its model (or its update) and ``c_i+ - c_i``; the server
takes ``x + server_learning_rate * (agg - x)`` and ``c + (n / N) * mean(c_i+ - c_i)``,
``n`` the round's members and ``N`` = ``clients_total`` (default ``n``: every client
every round). A member with count 0 keeps its control.

Where the state lives on each backend: on ``reference`` / ``xla`` /
``xla.simulate`` the clients' controls are part of the state pytree (member ``i``'s
row ``i``: ``xla.simulate`` keeps them right only when every round's cohort is the
same clients in the same order, ``population.uniform(N)``); in a Flower app exported
from a ``lax.scan`` of rounds they stay on each node (docs/flower.md, "Per-client
state"), which handles partial participation. The controls are averaged in the
clear, so SCAFFOLD takes no DP aggregator.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fcir.errors import LearningError

from . import arguments
from .algorithm import Algorithm

__all__ = ["scaffold"]


class Scaffold(Algorithm):
    name = "scaffold"
    state_keys = ("control",)
    client_state = "client_controls"
    averaged = ("control_delta",)

    def __init__(self, loss_fn, client_optimizer, aggregator, server_learning_rate,
                 clients_total):  # fmt: skip
        super().__init__(loss_fn, client_optimizer, aggregator)
        if self.aggregator.private:
            raise LearningError(
                f"learning.scaffold: aggregator {self.aggregator!r} is a DP release, but "
                "SCAFFOLD averages the clients' control variates in the clear; use a "
                "non-private aggregator"
            )
        self.server_learning_rate = arguments.number(
            self.who, "server_learning_rate", server_learning_rate, low=0.0, low_open=True
        )
        self.clients_total = (
            None if clients_total is None
            else arguments.count(self.who, "clients_total", clients_total, 1)
        )  # fmt: skip

    def validate(self, clients):
        super().validate(clients)
        if self.clients_total is not None and clients > self.clients_total:
            raise LearningError(
                f"{self.who}: a round of {clients} clients is more than clients_total="
                f"{self.clients_total}, the number of clients there are"
            )

    def init(self, params, clients: int | None = None) -> dict:
        """The server state with zero controls, ``clients`` of them at the clients."""
        if clients is None:
            raise LearningError(
                f"{self.who}: init(params, clients=n): SCAFFOLD keeps one control variate "
                "per client, so the state needs the number of clients of the round"
            )
        n = arguments.count(f"{self.who}.init", "clients", clients, 1)
        state = super().init(params)
        state[self.client_state] = jax.tree.map(
            lambda p: jnp.zeros((n, *p.shape), p.dtype), state["params"]
        )
        return state

    def server_state(self, params):
        return {"control": jax.tree.map(lambda p: p * 0, params)}

    def sent(self, state):
        return {"params": state["params"], "control": state["control"]}

    def client(self, sent, c_i, data, count, spec):
        x, c = sent["params"], sent["control"]
        correction = jax.tree.map(jnp.subtract, c, c_i)
        trained, metrics, c_new = self.train(x, data, count, correction=correction,
                                             gradient=True)  # fmt: skip
        if count is not None:  # a member that took no step keeps its control
            c_new = jax.tree.map(lambda a, b: jnp.where(count > 0, a, b), c_new, c_i)
        return {
            "value": self.to_send(trained, x),
            "metrics": metrics,
            "control_delta": jax.tree.map(jnp.subtract, c_new, c_i),
            "client_state": c_new,
        }

    def update(self, state, model, means, members):
        x, c = state["params"], state["control"]
        lr = self.server_learning_rate
        if lr == 1.0:
            new = jax.tree.map(lambda p, a: a.astype(p.dtype), x, model)
        else:
            new = jax.tree.map(lambda p, a: p + lr * (a.astype(p.dtype) - p), x, model)
        share = 1.0 if self.clients_total is None else members / self.clients_total
        dc = means["control_delta"]
        control = jax.tree.map(lambda c, d: c + share * d if share != 1.0 else c + d, c, dc)
        return {"params": new, "control": control}


def scaffold(loss_fn, *, client_optimizer=None, server_learning_rate: float = 1.0,
             clients_total: int | None = None, aggregator=None):  # fmt: skip
    """SCAFFOLD: ``state = {"params", "round", "control", "client_controls"}`` from
    ``algo.init(params, clients=n)``; ``server_learning_rate > 0`` (the paper's global
    step), ``clients_total`` the number of clients sampled from (default: the round's)."""
    return Scaffold(loss_fn, client_optimizer, aggregator, server_learning_rate, clients_total)
