"""How the server combines the members' updates: ``aggregator=`` of every algorithm.

Each aggregator is a small object around one of fcir's fed reductions, so the round's
IR shows the reduction itself (``fed.median``, ``fed.krum``, ``fed.dp_mean``) and every
backend, the privacy checker and the accountant see what they see in a hand-written
round:

====================================  ==========================================  ==============
aggregator                            reduction                                   Flower 1.42
====================================  ==========================================  ==============
``mean()`` (the default)              ``reduce_weighted_mean`` by examples, or    ``FedAvg``
                                      ``reduce_mean`` when all weigh alike
``median()``                          ``reduce_median``                           ``FedMedian``
``trimmed_mean(beta)``                ``reduce_trimmed_mean(trim=int(beta n))``   ``FedTrimmedAvg``
``krum(f)``                           ``reduce_krum``                             ``Krum``
``multi_krum(f, m)``                  ``reduce_multi_krum``                       ``MultiKrum``
``bulyan(f)``                         ``reduce_bulyan``                           ``Bulyan``
``geometric_median(iters, eps)``      ``reduce_geometric_median``                 (none)
``dp(clip_norm, noise_multiplier)``   ``dp_mean`` of the members' updates         server-side fixed clipping
``dp_adaptive(initial_clip, ...)``    ``dp_mean_adaptive``, the clip in the state server-side adaptive clipping
``ddp(clip_norm, noise_multiplier)``  ``ddp_mean`` (each client noises its own)   (none)
====================================  ==========================================  ==============

The mean and the robust rules combine the members' models, as Flower's strategies
do; the DP ones combine the members' updates (model minus the model sent), which is
what their clip bounds. The robust and DP rules weigh every member alike (Flower's
robust strategies do too); a padding member of a Poisson cohort (count 0) is a member
to them, one whose model is the model sent.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import fcir
from fcir.fed.dp_adaptive import default_count_stddev, update_noise_multiplier

from . import arguments

__all__ = [
    "Aggregator",
    "bulyan",
    "ddp",
    "dp",
    "dp_adaptive",
    "geometric_median",
    "krum",
    "mean",
    "median",
    "multi_krum",
    "trimmed_mean",
]


class Aggregator:
    """How a round combines the members' values: ``(values, weights, state, key) ->
    (aggregate, state, metrics)``, at the server.

    Class attributes say what the round must provide: ``relative`` (members send their
    update, not their model), ``private`` (a DP release: the round is
    ``fcir.program(private=True)`` and needs a ``key``), ``client_keys`` (the key is one
    PRNG key per client, client data), ``uses_weights`` (the members' example weights
    matter)."""

    name = "aggregator"
    relative = False
    private = False
    client_keys = False
    uses_weights = False

    def validate(self, who: str, clients: int) -> None:
        """Raises LearningError when the rule cannot run over ``clients`` members."""

    def init(self, params):
        """The aggregator's own server state (a pytree), or None."""
        del params
        return None

    def __call__(self, values, weights, state, key):
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"learning.{self.name}()"


class _Mean(Aggregator):
    name = "mean"
    uses_weights = True

    def __call__(self, values, weights, state, key):
        if weights is None:
            return fcir.reduce_mean(values), state, {}
        return fcir.reduce_weighted_mean(values, weights), state, {}


class _Median(Aggregator):
    name = "median"

    def __call__(self, values, weights, state, key):
        return fcir.reduce_median(values), state, {}


class _TrimmedMean(Aggregator):
    name = "trimmed_mean"

    def __init__(self, beta):
        self.beta = arguments.number(
            "learning.trimmed_mean", "beta", beta, low=0.0, high=0.5, high_open=True
        )

    def __call__(self, values, weights, state, key):
        n = jax.tree.leaves(values)[0].shape[0]
        return fcir.reduce_trimmed_mean(values, trim=int(self.beta * n)), state, {}

    def __repr__(self) -> str:
        return f"learning.trimmed_mean({self.beta:g})"


class _Krum(Aggregator):
    name = "krum"

    def __init__(self, f, m=None):
        who = f"learning.{self.name}"
        self.f = arguments.count(who, "f", f, 0)
        self.m = None if m is None else arguments.count(who, "m", m, 1)

    def validate(self, who, clients):
        arguments.count(
            f"{who} with {self!r}", "f", self.f, 0, clients - 3,
            f" (Krum scores need n >= f + 3 members; the round has n = {clients})",
        )  # fmt: skip
        if self.m is not None:
            arguments.count(f"{who} with {self!r}", "m", self.m, 1, clients,
                            f" (it picks m of the round's {clients} members)")  # fmt: skip

    def __call__(self, values, weights, state, key):
        if self.m is None:
            return fcir.reduce_krum(values, self.f), state, {}
        return fcir.reduce_multi_krum(values, self.f, self.m), state, {}

    def __repr__(self) -> str:
        m = "" if self.m is None else f", {self.m}"
        return f"learning.{self.name}({self.f}{m})"


class _MultiKrum(_Krum):
    name = "multi_krum"


class _Bulyan(Aggregator):
    name = "bulyan"

    def __init__(self, f):
        self.f = arguments.count("learning.bulyan", "f", f, 0)

    def validate(self, who, clients):
        arguments.count(
            f"{who} with {self!r}", "f", self.f, 0, (clients - 3) // 4,
            f" (Bulyan needs n >= 4f + 3 members; the round has n = {clients})",
        )  # fmt: skip

    def __call__(self, values, weights, state, key):
        return fcir.reduce_bulyan(values, self.f), state, {}

    def __repr__(self) -> str:
        return f"learning.bulyan({self.f})"


class _GeometricMedian(Aggregator):
    name = "geometric_median"

    def __init__(self, iters, eps):
        who = "learning.geometric_median"
        self.iters = arguments.count(who, "iters", iters, 1)
        self.eps = arguments.number(who, "eps", eps, low=0.0, low_open=True)

    def __call__(self, values, weights, state, key):
        return fcir.reduce_geometric_median(values, self.iters, self.eps), state, {}


class _DP(Aggregator):
    name = "dp"
    relative = True
    private = True

    def __init__(self, clip_norm, noise_multiplier):
        who = f"learning.{self.name}"
        self.clip_norm = arguments.number(who, "clip_norm", clip_norm, low=0.0, low_open=True)
        self.noise_multiplier = arguments.number(
            who, "noise_multiplier", noise_multiplier, low=0.0, low_open=True
        )

    def __call__(self, values, weights, state, key):
        return fcir.dp_mean(values, self.clip_norm, self.noise_multiplier, key), state, {}

    def __repr__(self) -> str:
        return f"learning.{self.name}({self.clip_norm:g}, {self.noise_multiplier:g})"


class _DDP(_DP):
    name = "ddp"
    client_keys = True

    def __init__(self, clip_norm, noise_multiplier, bits):
        super().__init__(clip_norm, noise_multiplier)
        self.bits = arguments.count("learning.ddp", "bits", bits, 2, 32)

    def __call__(self, values, weights, state, key):
        # key: one key per member, placed at the clients.
        mean = fcir.ddp_mean(values, self.clip_norm, self.noise_multiplier, key, bits=self.bits)
        return mean, state, {}

    def __repr__(self) -> str:
        return f"learning.ddp({self.clip_norm:g}, {self.noise_multiplier:g}, bits={self.bits})"


class _DPAdaptive(Aggregator):
    name = "dp_adaptive"
    relative = True
    private = True

    def __init__(self, initial_clip, noise_multiplier, target_quantile, learning_rate,
                 count_stddev):  # fmt: skip
        who = "learning.dp_adaptive"
        self.initial_clip = arguments.number(
            who, "initial_clip", initial_clip, low=0.0, low_open=True
        )
        self.noise_multiplier = arguments.number(
            who, "noise_multiplier", noise_multiplier, low=0.0, low_open=True
        )
        self.target_quantile = arguments.number(
            who, "target_quantile", target_quantile, low=0.0, high=1.0
        )
        self.learning_rate = arguments.number(
            who, "learning_rate", learning_rate, low=0.0, low_open=True
        )
        self.count_stddev = (
            None if count_stddev is None
            else arguments.number(who, "count_stddev", count_stddev, low=0.0, low_open=True)
        )  # fmt: skip

    def validate(self, who, clients):
        sigma_b = default_count_stddev(clients) if self.count_stddev is None else self.count_stddev
        update_noise_multiplier(self.noise_multiplier, sigma_b, f"{who} with {self!r}")

    def init(self, params):
        dtype = jnp.result_type(*jax.tree.leaves(params), jnp.float32)
        return {"clip": jnp.asarray(self.initial_clip, dtype)}

    def __call__(self, values, weights, state, key):
        mean, clip = fcir.dp_mean_adaptive(
            values, state["clip"], self.noise_multiplier, key,
            target_quantile=self.target_quantile, learning_rate=self.learning_rate,
            count_stddev=self.count_stddev,
        )  # fmt: skip
        return mean, {"clip": clip}, {"clip": clip}

    def __repr__(self) -> str:
        return f"learning.dp_adaptive({self.initial_clip:g}, {self.noise_multiplier:g})"


def mean() -> Aggregator:
    """The members' models averaged, weighted by their examples when the round has
    counts (Flower's FedAvg), else alike."""
    return _Mean()


def median() -> Aggregator:
    """Coordinate-wise median of the members' models (Flower's FedMedian)."""
    return _Median()


def trimmed_mean(beta: float = 0.2) -> Aggregator:
    """Coordinate-wise mean after dropping the ``int(beta * n)`` largest and smallest
    values, ``0 <= beta < 0.5`` (Flower's FedTrimmedAvg)."""
    return _TrimmedMean(beta)


def krum(f: int) -> Aggregator:
    """The member model with the lowest Krum score, ``f`` the byzantine members
    tolerated: needs ``n >= f + 3`` (Flower's Krum)."""
    return _Krum(f)


def multi_krum(f: int, m: int) -> Aggregator:
    """The mean of the ``m`` member models with the lowest Krum scores (Flower's
    MultiKrum with ``num_nodes_to_select=m``)."""
    return _MultiKrum(f, m)


def bulyan(f: int) -> Aggregator:
    """Bulyan over the member models: needs ``n >= 4f + 3`` (Flower's Bulyan)."""
    return _Bulyan(f)


def geometric_median(iters: int = 8, eps: float = 1e-8) -> Aggregator:
    """The geometric median of the member models by ``iters`` Weiszfeld steps."""
    return _GeometricMedian(iters, eps)


def dp(clip_norm: float, noise_multiplier: float) -> Aggregator:
    """Central DP: each member's update clipped to L2 norm ``clip_norm``, their mean
    released with Gaussian noise of std ``noise_multiplier * clip_norm / n``
    (``fcir.dp_mean``). The round is private and takes a ``key``."""
    return _DP(clip_norm, noise_multiplier)


def dp_adaptive(
    initial_clip: float,
    noise_multiplier: float,
    *,
    target_quantile: float = 0.5,
    learning_rate: float = 0.2,
    count_stddev: float | None = None,
) -> Aggregator:
    """Central DP with adaptive clipping (Andrew et al. 2021, ``fcir.dp_mean_adaptive``):
    the clip norm is server state (``state["aggregator"]["clip"]``, starting at
    ``initial_clip``) moved each round towards the ``target_quantile`` of the members'
    update norms; the round reports it as metric ``clip``."""
    return _DPAdaptive(initial_clip, noise_multiplier, target_quantile, learning_rate,
                       count_stddev)  # fmt: skip


def ddp(clip_norm: float, noise_multiplier: float, bits: int = 20) -> Aggregator:
    """Distributed DP (``fcir.ddp_mean``): each client clips, quantizes and noises its
    own update, and only a secure sum modulo ``2**bits`` reaches the server. The
    round's ``key`` is one PRNG key per client (client data)."""
    return _DDP(clip_norm, noise_multiplier, bits)
