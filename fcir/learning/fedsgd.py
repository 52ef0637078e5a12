"""FedSGD (McMahan et al. 2017; TFF's ``build_fed_sgd``): each member sends the mean
gradient of ``loss_fn`` at the server's model over its batches (no local steps), and
the server takes one ``server_optimizer`` step along their aggregate (weighted by
examples). The aggregator combines gradients: ``learning.dp`` clips each member's
gradient."""

from __future__ import annotations

import optax

from .fedopt import FedOpt

__all__ = ["fedsgd"]


class FedSGD(FedOpt):
    name = "fedsgd"
    sends = "gradient"
    local_training = False

    def client(self, sent, cstate, data, count, spec):
        gradient, metrics = self.mean_gradient(sent, data, count)
        return {"value": gradient, "metrics": metrics}

    def update(self, state, gradient, means, members):
        return self.step(state, gradient)


def fedsgd(loss_fn, *, server_optimizer=None, aggregator=None):
    """FedSGD: ``server_optimizer`` (default ``optax.sgd(0.1)``, TFF's) steps along the
    members' aggregated gradient; ``state = {"params", "round", "opt_state"}``."""
    if server_optimizer is None:
        server_optimizer = optax.sgd(0.1)
    return FedSGD(loss_fn, None, aggregator, server_optimizer)
