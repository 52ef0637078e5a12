"""``fed.multi_krum``: the mean of the ``m`` members with the lowest Krum scores
(Blanchard et al. 2017), and the public function ``reduce_multi_krum``.

Scores and choice as ``fed.krum`` (``fcir.fed.krum``); the result is the chosen
members' mean, in float32 or wider, rounded to the member dtype: ``{fN[s]}@child ->
fN[s]``. Its shape does not depend on the number of members, so a server that got
fewer replies than the round was captured for computes it over those; with fewer than
``m``, the mean of them all, as Flower's ``MultiKrum``. The mean adds the chosen members
one by one in score order (``fcir.fed.krum.ordered_mean``).

Not secure: whoever aggregates sees every member's value. Derivative: the mean of
``fed.krum``'s chosen members' tangents (``fcir.fed.krum.aggregate_jvp``).
"""

from __future__ import annotations

import numpy as np

from .base import public
from .krum import (
    Krum,
    aggregate_jvp,
    define_gathered,
    flatten_members,
    int_arg,
    krum_order,
    krum_p,
    ordered_mean,
    sq_distances,
)

__all__ = ["MultiKrum", "multi_krum_p", "reduce_multi_krum"]


class MultiKrum(Krum):
    """The mean of the ``m`` lowest-Krum-score members: ``{fN[s]}@child -> fN[s]``; over
    fewer than ``m`` members (a server short of replies), the mean of them all.
    Not secure: the aggregator sees every value."""

    name = "fed.multi_krum"
    constraints = {
        **Krum.constraints,
        "C3": "result must be the operand's member type, local to the current placement",
    }
    server_helpers = (*Krum.server_helpers, ordered_mean)

    @staticmethod
    def server_aggregate(x, *, f, m):
        """The mean of the ``m`` lowest-score replies (of all, when fewer came), as a
        Flower ServerApp computes it (self-contained, with ``server_helpers``)."""
        import jax.numpy as jnp

        flat = x.reshape(x.shape[0], -1)
        order = krum_order(sq_distances(flat, flat), f, min(m, x.shape[0]))
        return ordered_mean(jnp.take(x, order, axis=0))

    @classmethod
    def choose(cls, d, attrs: dict):
        return krum_order(d, attrs["f"], min(attrs["m"], d.shape[0]))

    @classmethod
    def from_chosen(cls, chosen, attrs: dict):
        return ordered_mean(chosen)

    @classmethod
    def result_shape(cls, shape: tuple, attrs: dict, n: int | None = None) -> tuple | None:
        return shape

    @classmethod
    def reference(cls, x: np.ndarray, attrs: dict) -> np.ndarray:
        chosen = Krum.reference(x, {**attrs, "m": min(attrs["m"], x.shape[0])})
        acc = np.result_type(chosen.dtype, np.float32)
        return chosen.astype(acc).mean(axis=0).astype(chosen.dtype)


multi_krum_p = define_gathered(
    MultiKrum, aggregate_jvp(lambda: krum_p, lambda c, *, n, f, m: ordered_mean(c))
)


@public
def reduce_multi_krum(x, f: int, m: int):
    """The mean of the ``m`` members with the lowest Krum scores: ``{T}@child -> T@p``.

    Scores as :func:`reduce_krum` (``m = 1`` gives Krum's member); the mean is taken
    at the server in float32 or wider (Flower's ``MultiKrum`` with equal example
    counts). Needs ``n >= f + 3`` and ``1 <= m <= n``. A Flower server with fewer than
    ``m`` replies takes the mean of them all, as ``MultiKrum`` does. Not secure:
    whoever aggregates sees every member's value.
    """
    what = "fcir.reduce_multi_krum"
    f, m = int_arg(what, "f", f), int_arg(what, "m", m)
    flat, name, n, unflatten = flatten_members(x, what)
    return unflatten(multi_krum_p.bind(flat, placement=name, n=n, f=f, m=m), 0)
