"""FedAvg (McMahan et al. 2017): the members train locally, the server takes their
aggregate as the new model.

With the default aggregator this is Flower's ``FedAvg`` (the members' models
averaged, weighted by examples: ``counts``) and TFF's weighted FedAvg with server SGD
at learning rate 1; with ``aggregator=learning.median()``, ``trimmed_mean(beta)``,
``krum(f)``, ``multi_krum(f, m)`` or ``bulyan(f)`` it is Flower's ``FedMedian``,
``FedTrimmedAvg``, ``Krum``, ``MultiKrum``, ``Bulyan``.
"""

from __future__ import annotations

import jax

from .algorithm import Algorithm

__all__ = ["fedavg"]


class FedAvg(Algorithm):
    name = "fedavg"

    def update(self, state, model, means, members):
        params = state["params"]
        return {"params": jax.tree.map(lambda p, m: m.astype(p.dtype), params, model)}


def fedavg(loss_fn, *, client_optimizer=None, aggregator=None) -> Algorithm:
    """FedAvg: ``state = {"params", "round"}``; each round the aggregate of the members'
    locally trained models (``client_optimizer``, one step per local-steps entry)."""
    return FedAvg(loss_fn, client_optimizer, aggregator)
