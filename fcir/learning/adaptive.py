"""What Flower's FedOpt family (``FedAdam``, ``FedYogi``, ``FedAdagrad``; Reddi et al.,
Adaptive Federated Optimization, 2021) shares: the server keeps moments ``m`` and
``v`` (zeros at first, as Flower starts them) and each round takes

    delta = agg - x                       (the aggregate minus the model sent)
    m = beta_1 * m + (1 - beta_1) * delta
    v = <the algorithm's second moment>(v, delta)
    x = x + step * m / (sqrt(v) + tau)

in that order of operations (``flwr/serverapp/strategy/fedopt.py`` and its
subclasses). ``step`` is ``eta``, FedAdam's bias-corrected ``eta_norm``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from . import arguments
from .algorithm import Algorithm

__all__ = ["AdaptiveFedOpt"]


class AdaptiveFedOpt(Algorithm):
    state_keys = ("m", "v")
    beta_1 = 0.0

    def __init__(self, loss_fn, client_optimizer, aggregator, eta, tau):
        super().__init__(loss_fn, client_optimizer, aggregator)
        self.eta = arguments.number(self.who, "eta", eta, low=0.0, low_open=True)
        self.tau = arguments.number(self.who, "tau", tau, low=0.0, low_open=True)

    def _betas(self, beta_1, beta_2):
        self.beta_1 = arguments.number(self.who, "beta_1", beta_1, low=0.0, high=1.0,
                                       high_open=True)  # fmt: skip
        self.beta_2 = arguments.number(self.who, "beta_2", beta_2, low=0.0, high=1.0,
                                       high_open=True)  # fmt: skip

    def server_state(self, params):
        zeros = jax.tree.map(lambda p: p * 0, params)
        return {"m": zeros, "v": zeros}

    def second_moment(self, v, delta):
        raise NotImplementedError

    def step(self, round_done):
        """The step size of the round after ``round_done`` rounds."""
        del round_done
        return self.eta

    def update(self, state, model, means, members):
        x = state["params"]
        delta = jax.tree.map(lambda a, p: a.astype(p.dtype) - p, model, x)
        b1 = self.beta_1
        m = jax.tree.map(lambda m, d: b1 * m + (1 - b1) * d, state["m"], delta)
        v = jax.tree.map(self.second_moment, state["v"], delta)
        eta = self.step(state["round"])
        tau = self.tau

        def new(p, m, v):
            return p + jnp.asarray(eta, p.dtype) * m / (jnp.sqrt(v) + tau)

        return {"params": jax.tree.map(new, x, m, v), "m": m, "v": v}
