"""FedProx (Li et al. 2020): FedAvg whose members add ``mu / 2 * ||w - w_t||^2`` to
their local objective, ``w_t`` the model the server sent (Flower's ``FedProx`` sends
``proximal-mu`` and leaves that term to the ClientApp; here it is in the round). The
server is FedAvg's: the aggregate is the new model. The reported loss is ``loss_fn``'s,
without the proximal term."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from . import arguments
from .fedavg import FedAvg

__all__ = ["fedprox"]


class FedProx(FedAvg):
    name = "fedprox"

    def __init__(self, loss_fn, client_optimizer, aggregator, mu):
        super().__init__(loss_fn, client_optimizer, aggregator)
        self.mu = arguments.number(self.who, "mu", mu, low=0.0)

    def client(self, sent, cstate, data, count, spec):
        def penalty(p):
            sq = sum(jnp.sum(jnp.square(a - b)) for a, b in zip(jax.tree.leaves(p),
                                                                jax.tree.leaves(sent)))  # fmt: skip
            return 0.5 * self.mu * sq

        trained, metrics, _ = self.train(sent, data, count, penalty=penalty)
        return {"value": self.to_send(trained, sent), "metrics": metrics}


def fedprox(loss_fn, *, client_optimizer=None, mu: float = 0.01, aggregator=None):
    """FedProx with proximal weight ``mu >= 0`` (``mu = 0`` is FedAvg)."""
    return FedProx(loss_fn, client_optimizer, aggregator, mu)
