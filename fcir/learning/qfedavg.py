"""q-FedAvg (Li et al., Fair Resource Allocation in Federated Learning, 2020):
Flower's ``QFedAvg``, which weighs the members with a higher loss more (``q = 0`` is
FedAvg-like, larger ``q`` fairer).

Member ``k`` trains locally from ``w`` to ``w_k``, and with ``F_k`` its mean loss at
``w`` (the model sent, over its batches) and ``L = 1 / client_learning_rate``
computes, as Flower's ``compute_delta_and_h``::

    g_k = (w - w_k) * L
    delta_k = (F_k + 1e-10) ** q * g_k
    h_k = q * (F_k + 1e-10) ** (q - 1) * ||g_k||^2 + L * (F_k + 1e-10) ** q

The server takes ``w - sum(delta_k) / sum(h_k)``: two sums (``fcir.reduce_sum``), which
the members' own arithmetic makes small, where Flower's server computes them from the
models. The rule is its own aggregation: q-FedAvg takes no ``aggregator``, and weighs
members by loss, not by examples (a member with count 0 adds nothing).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import fcir
from fcir.errors import LearningError

from . import arguments
from .aggregators import _Mean
from .algorithm import Algorithm, _mean

__all__ = ["qfedavg"]


class QFedAvg(Algorithm):
    name = "qfedavg"

    def __init__(self, loss_fn, client_optimizer, aggregator, q, client_learning_rate):
        if aggregator is not None and not isinstance(aggregator, _Mean):
            raise LearningError(
                f"learning.qfedavg: aggregator must be left out: q-FedAvg's update is its "
                f"own weighted sum over the members, got {aggregator!r}"
            )
        super().__init__(loss_fn, client_optimizer, None)
        self.q = arguments.number(self.who, "q", q, low=0.0)
        if client_learning_rate is None:
            raise LearningError(
                "learning.qfedavg: client_learning_rate is required (> 0): q-FedAvg "
                "estimates the Lipschitz constant as L = 1 / client_learning_rate, as "
                "Flower's QFedAvg does; give the client optimizer's learning rate"
            )
        self.lipschitz = 1.0 / arguments.number(
            self.who, "client_learning_rate", client_learning_rate, low=0.0, low_open=True
        )

    def client(self, sent, cstate, data, count, spec):
        trained, metrics, _ = self.train(sent, data, count)
        f = self.measure(sent, data, count)["loss"] + 1e-10
        lip, q = self.lipschitz, self.q
        g = jax.tree.map(lambda w, wk: (w - wk) * lip, sent, trained)
        norm = sum(jnp.sum(jnp.square(x)) for x in jax.tree.leaves(g))
        fq = f**q
        delta = jax.tree.map(lambda x: x * fq.astype(x.dtype), g)
        h = q * f ** (q - 1) * norm + lip * fq
        if count is not None:  # a padding member adds nothing
            on = count > 0
            delta = jax.tree.map(lambda x: jnp.where(on, x, jnp.zeros_like(x)), delta)
            h = jnp.where(on, h, jnp.zeros_like(h))
        return {"delta": delta, "h": h, "metrics": metrics}

    def _server(self, state, outs, weights, key, t, n):
        total_h = fcir.reduce_sum(outs["h"])
        total_delta = fcir.reduce_sum(outs["delta"])
        params = jax.tree.map(
            lambda w, d: w - d / total_h.astype(d.dtype), state["params"], total_delta
        )
        return {"params": params, "round": t + 1}, _mean(outs["metrics"], weights)


def qfedavg(loss_fn, *, client_optimizer=None, q: float = 0.1,
            client_learning_rate: float | None = None, aggregator=None):  # fmt: skip
    """q-FedAvg with fairness ``q >= 0``; ``client_learning_rate > 0`` (required) is
    the local learning rate, as Flower's ``QFedAvg(client_learning_rate, q)``."""
    return QFedAvg(loss_fn, client_optimizer, aggregator, q, client_learning_rate)
