"""``fed.bulyan_select``: Bulyan's choice of ``theta = n - 2f`` members by repeated
Krum (El Mhamdi et al. 2018), and the public function ``reduce_bulyan``.

Flower's ``aggregate_bulyan`` (``flwr.server.strategy.aggregate``, with
``aggregate_krum``): ``theta`` times, the Krum member of those not chosen yet (scores
over their ``r - f - 2`` nearest others, ``r`` the members left, at least 1) joins the
chosen set; it needs ``n >= 4f + 3``. The op's result is the chosen members' values in
the order chosen: ``{fN[s]}@child -> fN[theta, s]``. ``reduce_bulyan`` then finishes
at the server, per coordinate: the median of the chosen values (``np.median``), and the
mean of the ``beta = theta - 2f`` chosen values closest to it (ties in distance to the
smaller value, where Flower's ``argpartition`` leaves them unspecified).

Flower 1.42's newer ``flwr.serverapp.strategy.Bulyan`` picks the ``theta`` members by
one Multi-Krum ranking (``select_multikrum``) instead; on most inputs both choose the
same set, not on all: this op follows the paper and ``aggregate_bulyan``.

Not secure: whoever aggregates sees every member's value. Derivative: the choice is
piecewise constant; the chosen values carry their members' tangents
(``fcir.fed.krum.selection_jvp``), and the server's median band is plain JAX.
"""

from __future__ import annotations

import numpy as np

from .base import public
from .krum import Krum, define_selection, flatten_members, int_arg, scores_numpy

__all__ = ["BulyanSelect", "bulyan_select_p", "reduce_bulyan"]


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

    @staticmethod
    def server_aggregate(x, *, f):
        """The ``n - 2f`` replies repeated Krum chooses, in the order chosen, as a Flower
        ServerApp computes them (self-contained: the app copies this source)."""
        import jax
        import jax.numpy as jnp
        import numpy as np

        n = x.shape[0]
        flat = x.reshape(n, -1).astype(np.result_type(x.dtype, np.float32))
        d = jax.lax.map(lambda row: jnp.sum(jnp.square(flat - row), axis=1), flat)
        pos = jnp.arange(n)

        def step(i, carry):
            taken, order = carry
            q = jnp.maximum(1, n - i - f - 2)
            rows = jnp.sort(jnp.where(taken[None, :], jnp.inf, d), axis=1)
            near = (pos >= 1) & (pos <= q)
            scores = jnp.sum(jnp.where(near[None, :], rows, 0.0), axis=1)
            scores = jnp.where(taken, jnp.nan, jnp.where(jnp.isnan(scores), jnp.inf, scores))
            best = jnp.argsort(scores, stable=True)[0]
            return taken.at[best].set(True), order.at[i].set(best)

        init = (jnp.zeros(n, bool), jnp.zeros(n - 2 * f, jnp.int32))
        _, order = jax.lax.fori_loop(0, n - 2 * f, step, init)
        return jnp.take(x, order, axis=0)

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


# The Flower app's copy of the op (server_aggregate) is the op's one definition.
bulyan_select_p = define_selection(BulyanSelect, lambda x, *, n, f: BulyanSelect.server_aggregate(x, f=f))


def closest_mean(chosen, beta: int):
    """Per coordinate, the mean of the ``beta`` values of ``chosen`` (axis 0) closest to
    their median; ties in distance to the smaller value. Plain jnp at the server."""
    import jax.numpy as jnp

    acc = np.result_type(chosen.dtype, np.float32)
    s = jnp.sort(chosen.astype(acc), axis=0)
    t = s.shape[0]
    median = (s[(t - 1) // 2] + s[t // 2]) / 2
    order = jnp.argsort(jnp.abs(s - median), axis=0, stable=True)[:beta]
    return jnp.mean(jnp.take_along_axis(s, order, axis=0), axis=0)


@public
def reduce_bulyan(x, f: int):
    """Bulyan (El Mhamdi et al. 2018) over members: ``{T}@child -> T@p``.

    ``theta = n - 2f`` members chosen by repeated Krum (scores over every leaf of the
    pytree together), then per coordinate the mean of the ``beta = theta - 2f`` chosen
    values closest to their median. Needs ``n >= 4f + 3`` and float leaves (Flower's
    ``aggregate_bulyan``). A robust aggregate, not a secure one: whoever aggregates
    sees every member's value. The gradient reaches the chosen members' averaged
    values; the choices themselves have none.
    """
    what = "fcir.reduce_bulyan"
    f = int_arg(what, "f", f)
    flat, name, n, unflatten = flatten_members(x, what)
    chosen = bulyan_select_p.bind(flat, placement=name, n=n, f=f)
    beta = n - 4 * f
    return unflatten(closest_mean(chosen, beta).astype(chosen.dtype), 0)
