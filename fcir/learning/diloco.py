"""DiLoCo (Douillard et al., Distributed Low-Communication Training, 2023): many inner
steps of ``client_optimizer`` (the paper's AdamW) on each member from the server's
model, each round from a fresh inner state, then an outer step of
``server_optimizer`` (the paper's SGD with Nesterov momentum, learning rate 0.7,
momentum 0.9: the default) along the outer gradient ``x - mean(x_i)``. FedOpt's
round with DiLoCo's outer optimizer by default; the inner state is not kept between
rounds (a client may not take part in the next)."""

from __future__ import annotations

import optax

from .fedopt import FedOpt

__all__ = ["diloco"]


class DiLoCo(FedOpt):
    name = "diloco"


def diloco(loss_fn, *, client_optimizer=None, server_optimizer=None, aggregator=None):
    """DiLoCo: ``client_optimizer`` the inner optimizer (required; the paper's is
    ``optax.adamw``), ``server_optimizer`` the outer one (default
    ``optax.sgd(0.7, momentum=0.9, nesterov=True)``)."""
    if server_optimizer is None:
        server_optimizer = optax.sgd(0.7, momentum=0.9, nesterov=True)
    return DiLoCo(loss_fn, client_optimizer, aggregator, server_optimizer)
