"""``fed.median``: per coordinate, the median of the members' values (the mean of the
two middle values for an even number of members, as ``np.median``).

It is ``fed.trimmed_mean`` with ``trim = (n - 1) // 2``, and shares its impl, numpy
semantics and derivative (``fcir.fed.trimmed_mean.band_tangent``: the middle members
found by the index their sort recorded). NaN as there: a NaN member makes its
coordinate NaN (as ``np.median`` / ``jnp.median``) with a zero gradient.
"""

from __future__ import annotations

import numpy as np

from fcir.opkit import autodiff as AD
from fcir.opkit import placement as api
from fcir.opkit import primitives as P

from .base import Reduction, public
from .trimmed_mean import _check, band_tangent, float_problem, l_estimate, l_estimate_numpy

__all__ = ["Median", "median_p", "reduce_median"]


class Median(Reduction):
    """Per-coordinate median over members: ``{fN[...]}@child -> fN[...]``. Not secure:
    the aggregator sees every value."""

    name = "fed.median"
    constraints = {
        **Reduction.constraints,
        "C4": "operand must be a floating-point tensor",
    }

    @staticmethod
    def server_aggregate(x):
        """The median over axis 0 of the clients' replies, as a Flower ServerApp computes
        it (self-contained: the app copies this source, it cannot import fcir)."""
        import jax.numpy as jnp
        import numpy as np

        n = x.shape[0]
        k = (n - 1) // 2
        acc = np.result_type(x.dtype, np.float32)
        s = jnp.sort(x, axis=0)  # NaN sorts last: a NaN reply makes its coordinate NaN
        # The middle values added one by one from zero, as the primitive's band_sum.
        total = jnp.zeros(x.shape[1:], acc) + s[k].astype(acc)
        if n - 2 * k == 2:
            total = total + s[k + 1].astype(acc)
        mean = total / jnp.asarray(n - 2 * k, acc)
        return jnp.where(jnp.isnan(s[n - 1]), jnp.nan, mean).astype(x.dtype)

    @classmethod
    def trim_for(cls, n: int, attrs: dict) -> int:
        return (n - 1) // 2

    @classmethod
    def problem(cls, dtype: str, n: int, attrs: dict) -> tuple[str, str] | None:
        return float_problem(cls, dtype)

    @classmethod
    def extra(cls, op, t, ctx):
        found = cls.problem(getattr(t.member, "dtype", "tuple"), 0, op.attrs)
        if found is not None:
            cls.fail(*found)

    @classmethod
    def reference(cls, x: np.ndarray, attrs: dict) -> np.ndarray:
        return l_estimate_numpy(x, cls.trim_for(x.shape[0], attrs))


median_p = P.define_reduction(
    "fed_median", lambda x, *, n: l_estimate(x, n=n, trim=(n - 1) // 2), _check(Median)
)
Median.primitive = median_p


def _median_jvp(primals, tangents, *, placement, n):
    (x,), (t,) = primals, tangents
    ans = median_p.bind(x, placement=placement, n=n)
    if AD.is_zero(t):
        return ans, AD.zero_tangent(ans)
    return ans, band_tangent(x, t, placement=placement, n=n, trim=(n - 1) // 2)


AD.def_jvp(median_p, _median_jvp)


@public
def reduce_median(x):
    """Per-coordinate median over members: ``{fN[...]}@child -> fN[...]@p``.

    For an even number of members, the mean of the two middle values. A robust
    aggregate, not a secure one: whoever aggregates sees every member's value.

    A coordinate where any member is NaN is NaN (as ``np.median`` and ``jnp.median``),
    and its gradient is zero for every member (as ``jax.grad(jnp.median)``).
    """
    return api._reduce(median_p, "fcir.reduce_median", x)
