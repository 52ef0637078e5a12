"""``fed.bulyan``: Bulyan (El Mhamdi et al. 2018) over the members, and the public
function ``reduce_bulyan``.

``theta = n - 2f`` members chosen by repeated Krum as ``fed.bulyan_select``
(``fcir.fed.bulyan_select``: Flower's ``aggregate_bulyan``, which needs ``n >= 4f +
3``), then per coordinate: the median of the chosen values (``np.median``), and the mean of the ``beta = theta - 2f`` chosen values closest to it
(ties in distance to the smaller value, where Flower's ``argpartition`` leaves them
unspecified): ``{fN[s]}@child -> fN[s]``. Its shape does not depend on ``n``, so a
server with fewer replies than the round was captured for computes Bulyan over those
(``theta`` and ``beta`` from their number), down to ``4f + 3`` (``min_replies``; below
it Flower's ``Bulyan`` skips the round, and so does ``flower.Strategy``).

Not secure: whoever aggregates sees every member's value. Derivative: the choice is
piecewise constant; the chosen values carry their members' tangents
(``fed.bulyan_select``'s, ``fcir.fed.krum.selection_jvp``), and the result those
through ``closest_mean`` (JAX's rules for its sort; ``fcir.fed.krum.aggregate_jvp``).
"""

from __future__ import annotations

import numpy as np

from .base import public
from .bulyan_select import BulyanSelect, bulyan_order, bulyan_select_p
from .krum import (
    aggregate_jvp,
    define_gathered,
    flatten_members,
    int_arg,
    ordered_mean,
    sq_distances,
)

__all__ = ["Bulyan", "bulyan_p", "closest_mean", "reduce_bulyan"]


def closest_mean(chosen, beta):
    """Per coordinate, the mean of the ``beta`` values of ``chosen`` (axis 0) closest to
    their median, ties in distance to the smaller value, in float32 or wider (added one
    by one from the closest: ``ordered_mean``) and rounded to ``chosen``'s dtype. Each
    coordinate's result is the same whatever coordinates are computed beside it."""
    import jax.numpy as jnp
    import numpy as np

    acc = np.result_type(chosen.dtype, np.float32)
    s = jnp.sort(chosen.astype(acc), axis=0)
    t = s.shape[0]
    median = (s[(t - 1) // 2] + s[t // 2]) / 2
    order = jnp.argsort(jnp.abs(s - median), axis=0, stable=True)[:beta]
    return ordered_mean(jnp.take_along_axis(s, order, axis=0)).astype(chosen.dtype)


class Bulyan(BulyanSelect):
    """Bulyan: per coordinate, the mean of the ``n - 4f`` values of the members
    ``fed.bulyan_select`` chooses closest to their median: ``{fN[s]}@child -> fN[s]``.
    Not secure: the aggregator sees every value."""

    name = "fed.bulyan"
    constraints = {
        **BulyanSelect.constraints,
        "C3": "result must be the operand's member type, local to the current placement",
    }
    server_helpers = (*BulyanSelect.server_helpers, ordered_mean, closest_mean)

    @staticmethod
    def server_aggregate(x, *, f):
        """Bulyan over the replies (``theta`` and ``beta`` from their number), as a
        Flower ServerApp computes it (self-contained, with ``server_helpers``)."""
        import jax.numpy as jnp

        n = x.shape[0]
        flat = x.reshape(n, -1)
        chosen = jnp.take(x, bulyan_order(sq_distances(flat, flat), f), axis=0)
        return closest_mean(chosen, n - 4 * f)

    @classmethod
    def from_chosen(cls, chosen, attrs: dict):
        return closest_mean(chosen, chosen.shape[0] - 2 * attrs["f"])

    @classmethod
    def result_shape(cls, shape: tuple, attrs: dict, n: int | None = None) -> tuple | None:
        return shape

    @classmethod
    def reference(cls, x: np.ndarray, attrs: dict) -> np.ndarray:
        chosen = BulyanSelect.reference(x, attrs)
        beta = chosen.shape[0] - 2 * attrs["f"]
        s = np.sort(chosen.astype(np.result_type(chosen.dtype, np.float32)), axis=0)
        t = s.shape[0]
        median = (s[(t - 1) // 2] + s[t // 2]) / 2
        order = np.argsort(np.abs(s - median), axis=0, kind="stable")[:beta]
        return np.take_along_axis(s, order, axis=0).mean(axis=0).astype(chosen.dtype)


bulyan_p = define_gathered(
    Bulyan,
    aggregate_jvp(lambda: bulyan_select_p, lambda c, *, n, f: closest_mean(c, n - 4 * f)),
)


@public
def reduce_bulyan(x, f: int):
    """Bulyan (El Mhamdi et al. 2018) over members: ``{T}@child -> T@p``.

    ``theta = n - 2f`` members chosen by repeated Krum (scores over every leaf of the
    pytree together), then per coordinate the mean of the ``beta = theta - 2f`` chosen
    values closest to their median. Needs ``n >= 4f + 3`` and float leaves (Flower's
    ``aggregate_bulyan``); a Flower server with fewer replies computes Bulyan over those,
    down to ``4f + 3``. A robust aggregate, not a secure one: whoever aggregates sees
    every member's value. The gradient reaches the chosen members' averaged values;
    the choices themselves have none.
    """
    what = "fcir.reduce_bulyan"
    f = int_arg(what, "f", f)
    flat, name, n, unflatten = flatten_members(x, what)
    return unflatten(bulyan_p.bind(flat, placement=name, n=n, f=f), 0)
