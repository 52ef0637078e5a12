"""FedAvgM (Hsu et al. 2019): FedAvg with server momentum, Flower's ``FedAvgM``.

The pseudo-gradient is the model sent minus the aggregate, ``g = x - agg``; with
momentum ``beta > 0`` the server keeps ``m = beta * m + g`` (``m = g`` in round 1, as
Flower starts it; the state's ``momentum`` starts at zeros, which is the same), and
steps ``x = x - server_learning_rate * m`` (PyTorch's SGD convention, no Nesterov).
With ``server_learning_rate == 1`` and ``server_momentum == 0`` Flower takes the
aggregate as it is, and so does this.
"""

from __future__ import annotations

import jax

from . import arguments
from .algorithm import Algorithm

__all__ = ["fedavgm"]


class FedAvgM(Algorithm):
    name = "fedavgm"
    state_keys = ("momentum",)

    def __init__(self, loss_fn, client_optimizer, aggregator, server_learning_rate,
                 server_momentum):  # fmt: skip
        super().__init__(loss_fn, client_optimizer, aggregator)
        self.server_learning_rate = arguments.number(
            self.who, "server_learning_rate", server_learning_rate, low=0.0, low_open=True
        )
        self.server_momentum = arguments.number(
            self.who, "server_momentum", server_momentum, low=0.0, high=1.0, high_open=True
        )

    def server_state(self, params):
        return {"momentum": jax.tree.map(lambda p: p * 0, params)}

    def update(self, state, model, means, members):
        x, m = state["params"], state["momentum"]
        lr, beta = self.server_learning_rate, self.server_momentum
        if lr == 1.0 and beta == 0.0:  # Flower's "server optimization: OFF"
            return {"params": jax.tree.map(lambda p, a: a.astype(p.dtype), x, model),
                    "momentum": m}  # fmt: skip
        g = jax.tree.map(lambda p, a: p - a.astype(p.dtype), x, model)
        if beta > 0.0:
            g = jax.tree.map(lambda m, g: beta * m + g, m, g)
        return {"params": jax.tree.map(lambda p, g: p - lr * g, x, g), "momentum": g}


def fedavgm(loss_fn, *, client_optimizer=None, server_learning_rate: float = 1.0,
            server_momentum: float = 0.9, aggregator=None) -> Algorithm:  # fmt: skip
    """FedAvgM: ``state = {"params", "round", "momentum"}``; ``server_learning_rate >
    0``, ``0 <= server_momentum < 1``."""
    return FedAvgM(loss_fn, client_optimizer, aggregator, server_learning_rate, server_momentum)
