"""FedAdagrad: Flower's ``FedAdagrad`` (Reddi et al. 2021), the shared FedOpt step
(``adaptive.py``) with ``beta_1 = 0`` (Flower's FedAdagrad fixes it: ``m`` is the
round's delta) and ``v = v + delta**2``, step ``eta``."""

from __future__ import annotations

from .adaptive import AdaptiveFedOpt

__all__ = ["fedadagrad"]


class FedAdagrad(AdaptiveFedOpt):
    name = "fedadagrad"
    beta_1 = 0.0

    def second_moment(self, v, delta):
        return v + delta**2


def fedadagrad(loss_fn, *, client_optimizer=None, eta: float = 1e-1, tau: float = 1e-3,
               aggregator=None):  # fmt: skip
    """FedAdagrad with Flower's defaults: ``eta > 0``, ``tau > 0``.
    ``state = {"params", "round", "m", "v"}``."""
    return FedAdagrad(loss_fn, client_optimizer, aggregator, eta, tau)
