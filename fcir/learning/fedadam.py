"""FedAdam: Flower's ``FedAdam`` (Reddi et al. 2021), the shared FedOpt step
(``adaptive.py``) with ``v = beta_2 * v + (1 - beta_2) * delta**2`` and the
bias-corrected step of Flower 1.42::

    eta_norm = eta * sqrt(1 - beta_2 ** (t + 1)) / (1 - beta_1 ** (t + 1))

``t`` Flower's ``server_round``, counted from 1: ``state["round"] + 1``. (Flower
corrects by ``t + 1``, one round ahead of Adam's own ``t``; this follows Flower.)
"""

from __future__ import annotations

import jax.numpy as jnp

from .adaptive import AdaptiveFedOpt

__all__ = ["fedadam"]


class FedAdam(AdaptiveFedOpt):
    name = "fedadam"

    def __init__(self, loss_fn, client_optimizer, aggregator, eta, beta_1, beta_2, tau):
        super().__init__(loss_fn, client_optimizer, aggregator, eta, tau)
        self._betas(beta_1, beta_2)

    def second_moment(self, v, delta):
        return self.beta_2 * v + (1 - self.beta_2) * delta**2

    def step(self, round_done):
        power = (round_done + 2).astype(jnp.float32)  # server_round + 1, rounds from 1
        b1, b2 = jnp.float32(self.beta_1), jnp.float32(self.beta_2)
        return self.eta * jnp.sqrt(1 - b2**power) / (1 - b1**power)


def fedadam(loss_fn, *, client_optimizer=None, eta: float = 1e-1, beta_1: float = 0.9,
            beta_2: float = 0.99, tau: float = 1e-3, aggregator=None):  # fmt: skip
    """FedAdam with Flower's defaults: ``eta > 0``, ``0 <= beta_1, beta_2 < 1``,
    ``tau > 0``. ``state = {"params", "round", "m", "v"}``."""
    return FedAdam(loss_fn, client_optimizer, aggregator, eta, beta_1, beta_2, tau)
