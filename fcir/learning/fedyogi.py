"""FedYogi: Flower's ``FedYogi`` (Reddi et al. 2021), the shared FedOpt step
(``adaptive.py``) with Yogi's second moment
``v = v - (1 - beta_2) * delta**2 * sign(v - delta**2)`` and step ``eta``."""

from __future__ import annotations

import jax.numpy as jnp

from .adaptive import AdaptiveFedOpt

__all__ = ["fedyogi"]


class FedYogi(AdaptiveFedOpt):
    name = "fedyogi"

    def __init__(self, loss_fn, client_optimizer, aggregator, eta, beta_1, beta_2, tau):
        super().__init__(loss_fn, client_optimizer, aggregator, eta, tau)
        self._betas(beta_1, beta_2)

    def second_moment(self, v, delta):
        sq = delta**2
        return v - (1.0 - self.beta_2) * sq * jnp.sign(v - sq)


def fedyogi(loss_fn, *, client_optimizer=None, eta: float = 1e-2, beta_1: float = 0.9,
            beta_2: float = 0.99, tau: float = 1e-3, aggregator=None):  # fmt: skip
    """FedYogi with Flower's defaults: ``eta > 0``, ``0 <= beta_1, beta_2 < 1``,
    ``tau > 0``. ``state = {"params", "round", "m", "v"}``."""
    return FedYogi(loss_fn, client_optimizer, aggregator, eta, beta_1, beta_2, tau)
