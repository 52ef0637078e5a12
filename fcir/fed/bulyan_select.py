"""``fed.bulyan_select``: the ``theta = n - 2f`` members Bulyan (El Mhamdi et al. 2018)
chooses by repeated Krum, in the order chosen: ``{fN[s]}@child -> fN[theta, s]``.

Flower's ``aggregate_bulyan`` (``flwr.server.strategy.aggregate``, with
``aggregate_krum``): ``theta`` times, the Krum member of those not chosen yet (scores
over their ``r - f - 2`` nearest others, ``r`` the members left, at least 1) joins the
chosen set; it needs ``n >= 4f + 3``. ``fed.bulyan`` (``fcir.fed.bulyan``, what
``reduce_bulyan`` binds) finishes Bulyan from this choice; its derivative reaches the
members through this op's (``fcir.fed.krum.selection_jvp``).

Flower 1.42's newer ``flwr.serverapp.strategy.Bulyan`` picks the ``theta`` members by
one Multi-Krum ranking (``select_multikrum``) instead; on most inputs both choose the
same set, not on all: these ops follow the paper and ``aggregate_bulyan``.

Not secure: whoever aggregates sees every member's value.
"""

from __future__ import annotations

import numpy as np

from .krum import Krum, define_gathered, row_sums, scores_numpy, sq_distances

__all__ = ["BulyanSelect", "bulyan_order", "bulyan_select_p"]


def bulyan_order(d, f):
    """The ``n - 2f`` members repeated Krum chooses from the distance matrix ``d``, in
    the order chosen."""
    import jax
    import jax.numpy as jnp

    n = d.shape[0]
    pos = jnp.arange(n)

    def step(i, carry):
        taken, order = carry
        q = jnp.maximum(1, n - i - f - 2)
        rows = jnp.sort(jnp.where(taken[None, :], jnp.inf, d), axis=1)
        near = (pos >= 1) & (pos <= q)
        scores = row_sums(jnp.where(near[None, :], rows, 0.0))
        scores = jnp.where(taken, jnp.nan, jnp.where(jnp.isnan(scores), jnp.inf, scores))
        best = jnp.argsort(scores, stable=True)[0]
        return taken.at[best].set(True), order.at[i].set(best)

    init = (jnp.zeros(n, bool), jnp.zeros(n - 2 * f, jnp.int32))
    return jax.lax.fori_loop(0, n - 2 * f, step, init)[1]


class BulyanSelect(Krum):
    """The ``theta = n - 2f`` members Bulyan chooses by repeated Krum, in the order
    chosen: ``{fN[s]}@child -> fN[n - 2f, s]``. Not secure: the aggregator sees every
    value."""

    name = "fed.bulyan_select"
    attributes = {"f": int}
    constraints = {
        **Krum.constraints,
        "C3": "result must be fN[n - 2f, *member shape], local to the current placement",
        "C5": "attribute 'f' must be an int >= 0 with n >= 4f + 3, n the cardinality of "
        "the placement reduced over (Bulyan's assumption, as Flower checks it)",
    }
    del constraints["C6"]
    server_helpers = (row_sums, sq_distances, bulyan_order)

    @staticmethod
    def server_aggregate(x, *, f):
        """The ``n - 2f`` replies repeated Krum chooses, in the order chosen, as a Flower
        ServerApp computes them (self-contained, with ``server_helpers``)."""
        import jax.numpy as jnp

        flat = x.reshape(x.shape[0], -1)
        return jnp.take(x, bulyan_order(sq_distances(flat, flat), f), axis=0)

    @classmethod
    def choose(cls, d, attrs: dict):
        return bulyan_order(d, attrs["f"])

    @classmethod
    def min_replies(cls, attrs: dict) -> int:
        return 4 * attrs["f"] + 3

    @classmethod
    def problem(cls, dtype: str, n: int | None, attrs: dict) -> tuple[str, str] | None:
        from .krum import _float, _int_attr

        if not _float(dtype):
            return "C4", f"operand member dtype {dtype}; cast it (x.astype(jnp.float32)) first"
        f = attrs.get("f")
        if not _int_attr(f) or f < 0 or (n is not None and n < 4 * f + 3):
            return "C5", f"f={f!r} over {n} members"
        return None

    @classmethod
    def result_shape(cls, shape: tuple, attrs: dict, n: int | None = None) -> tuple | None:
        return None if n is None else (n - 2 * attrs["f"], *shape)

    @classmethod
    def reference(cls, x: np.ndarray, attrs: dict) -> np.ndarray:
        x = np.asarray(x)
        f = attrs["f"]
        left, chosen = list(range(x.shape[0])), []
        for _ in range(x.shape[0] - 2 * f):
            s = scores_numpy(x[left], max(1, len(left) - f - 2))
            s = np.where(np.isnan(s), np.inf, s)
            chosen.append(left.pop(int(np.argmin(s))))
        return x[chosen]


bulyan_select_p = define_gathered(BulyanSelect)
