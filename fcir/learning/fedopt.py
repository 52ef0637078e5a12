"""FedOpt (Reddi et al. 2021) as TFF builds it: FedAvg's members, and any optax
``server_optimizer`` stepping the model along the pseudo-gradient ``x - agg`` (the
negated mean update). TFF's ``build_weighted_fed_avg(client_optimizer_fn,
server_optimizer_fn)``; ``optax.sgd(1.0)`` gives FedAvg, ``optax.adam(...)`` Adam's own
FedAdam (bias correction at Adam's step count; ``learning.fedadam`` is Flower's)."""

from __future__ import annotations

import jax
import optax

from fcir.errors import LearningError

from . import arguments
from .algorithm import Algorithm

__all__ = ["fedopt"]


class FedOpt(Algorithm):
    name = "fedopt"
    state_keys = ("opt_state",)

    def __init__(self, loss_fn, client_optimizer, aggregator, server_optimizer):
        super().__init__(loss_fn, client_optimizer, aggregator)
        if server_optimizer is None:
            raise LearningError(
                f"{self.who}: server_optimizer is required: an optax optimizer for the "
                "server's step along the pseudo-gradient, e.g. optax.adam(1e-2)"
            )
        self.server_optimizer = arguments.optimizer(self.who, "server_optimizer", server_optimizer)

    def server_state(self, params):
        return {"opt_state": self.server_optimizer.init(params)}

    def update(self, state, model, means, members):
        x = state["params"]
        pseudo = jax.tree.map(lambda p, a: p - a.astype(p.dtype), x, model)
        return self.step(state, pseudo)

    def step(self, state, gradient):
        x = state["params"]
        updates, opt_state = self.server_optimizer.update(gradient, state["opt_state"], x)
        return {"params": optax.apply_updates(x, updates), "opt_state": opt_state}


def fedopt(loss_fn, *, client_optimizer=None, server_optimizer=None, aggregator=None):
    """FedOpt with an optax ``server_optimizer`` (required) on the pseudo-gradient;
    ``state = {"params", "round", "opt_state"}``, the optimizer's state as optax
    keeps it."""
    return FedOpt(loss_fn, client_optimizer, aggregator, server_optimizer)
