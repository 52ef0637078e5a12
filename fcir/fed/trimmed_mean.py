"""``fed.trimmed_mean``: per coordinate, the mean of the members' values without the
``trim`` largest and the ``trim`` smallest (a robust aggregate).

Everything about the op is here: its class and constraints, its primitive with its
abstract evaluation, lowering and batching, its numpy semantics (the reference
interpreter's rule) and its derivative. ``fed.median`` (``fcir.fed.median``) is the
same estimator with ``trim = (n - 1) // 2`` and shares these rules.

Derivative (a subgradient, in the spirit of ``jnp.min``'s): the result is
``sum_j c_j s_j`` over the sorted values ``s`` with ``c_j = 1/m`` for the ``m = n - 2
trim`` kept positions. Members whose value lies strictly between the thresholds
``lo = s_trim`` and ``hi = s_{n-1-trim}`` pass their tangent with weight ``1/m``; the
kept positions holding ``lo`` (and ``hi``) share their weight equally among the tied
members. Everything per member happens in ``fed_map`` regions and every sum over
members is a ``fed.sum``, so the derivative stays federated. The thresholds come from
``trim + 1`` rounds of ``fed.min`` (``fed.max``) over the values above (below) the
previous one: the gradient program grows with ``trim``.

NaN: a coordinate where any member's value is NaN comes out NaN (as ``np.median``,
``jnp.median`` and ``scipy.stats.trim_mean`` give; a sort alone would rank NaN as the
largest value and trim it away unseen), and its derivative is zero for every member
(as ``jax.grad`` of ``jnp.median`` gives there). The derivative counts NaN members
with a ``fed.sum``, not from the thresholds (``fed.min``/``fed.max`` propagate NaN).
Other coordinates are unaffected. To drop a bad client's update rather than let it
poison the coordinate, filter or clip it on the client first.
"""

from __future__ import annotations

import numpy as np

from fcir.errors import PlacementError
from fcir.ir.types import TensorType, dtype_name
from fcir.opkit import autodiff as AD
from fcir.opkit import placement as api
from fcir.opkit import primitives as P
from fcir.opkit.sharding import gather_members

from .base import Reduction, public
from .broadcast import broadcast_like
from .map import member_map
from .max import max_p
from .min import min_p
from .sum import sum_p

__all__ = ["TrimmedMean", "reduce_trimmed_mean", "trimmed_mean_p"]


def _accumulator(dtype) -> np.dtype:
    return np.result_type(np.dtype(dtype), np.float32)


def l_estimate(x, *, n: int, trim: int):
    """The trimmed mean over axis 0 (jnp ops: the primitive's impl and lowering)."""
    import jax.numpy as jnp

    s = jnp.sort(gather_members(x), axis=0)  # NaN sorts last: a NaN member makes the last row NaN
    mean = band_sum(s, trim, n - trim) / jnp.asarray(n - 2 * trim, _accumulator(x.dtype))
    return jnp.where(jnp.isnan(s[n - 1]), jnp.nan, mean).astype(x.dtype)


def band_sum(s, start: int, stop: int):
    """``s[start] + ... + s[stop - 1]`` added one by one from zero, in the accumulator
    dtype: a fixed order of float adds (``jnp.sum`` leaves it to XLA), the one a streamed
    order statistic reproduces pass by pass (interpreters/xla/streaming_order.py)."""
    import jax
    import jax.numpy as jnp

    acc = _accumulator(s.dtype)
    zero = jnp.zeros(s.shape[1:], acc)
    return jax.lax.fori_loop(start, stop, lambda i, t: t + s[i].astype(acc), zero)


def l_estimate_numpy(x: np.ndarray, trim: int) -> np.ndarray:
    """The same in numpy: the reference interpreter's semantics."""
    x = np.asarray(x)
    n = x.shape[0]
    s = np.sort(x, axis=0)  # NaN sorts last
    acc = _accumulator(x.dtype)
    total = np.zeros(x.shape[1:], acc)
    for row in s[trim : n - trim]:  # one by one from the smallest, as l_estimate
        total = (total + row.astype(acc)).astype(acc)
    mean = total / acc.type(n - 2 * trim)
    return np.where(np.isnan(s[n - 1]), np.nan, mean).astype(x.dtype)


def server_aggregate(x, *, trim):
    """The trimmed mean over axis 0 of the clients' replies, as a Flower ServerApp
    computes it (self-contained: the app copies this source, it cannot import fcir;
    the same jnp calls as ``l_estimate``, so all replies give the bundle's bits; NaN
    in a coordinate gives NaN)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    n = x.shape[0]
    acc = np.result_type(x.dtype, np.float32)
    s = jnp.sort(x, axis=0)
    zero = jnp.zeros(x.shape[1:], acc)
    total = jax.lax.fori_loop(trim, n - trim, lambda i, t: t + s[i].astype(acc), zero)
    mean = total / jnp.asarray(n - 2 * trim, acc)
    return jnp.where(jnp.isnan(s[n - 1]), jnp.nan, mean).astype(x.dtype)


def float_problem(cls, dtype: str) -> tuple[str, str] | None:
    if not (dtype.startswith("f") or dtype == "bf16"):
        return "C4", f"operand member dtype {dtype}; cast it (x.astype(jnp.float32)) first"
    return None


class TrimmedMean(Reduction):
    """Per-coordinate mean without the ``trim`` largest and smallest members:
    ``{fN[...]}@child -> fN[...]``. Not secure: the aggregator sees every value."""

    name = "fed.trimmed_mean"
    attributes = {"trim": int}
    constraints = {
        **Reduction.constraints,
        "C4": "operand must be a floating-point tensor",
        "C5": "attribute 'trim' must be an int with 0 <= 2*trim < the cardinality of the "
        "placement reduced over",
    }

    # The ServerApp's aggregation of the replies (interpreters/flower/app/runtime.py).
    server_aggregate = staticmethod(server_aggregate)

    @classmethod
    def trim_for(cls, n: int, attrs: dict) -> int:
        return attrs["trim"]

    @classmethod
    def problem(cls, dtype: str, n: int | None, attrs: dict) -> tuple[str, str] | None:
        """The violated constraint (code, detail) or None: asked while tracing and by
        the checker."""
        found = float_problem(cls, dtype)
        if found is not None:
            return found
        k = attrs.get("trim")
        bad_type = isinstance(k, bool) or not isinstance(k, int)
        if bad_type or k < 0 or (n is not None and 2 * k >= n):
            return "C5", f"trim={k!r} over {n} members"
        return None

    @classmethod
    def extra(cls, op, t, ctx):
        member = t.member
        if not isinstance(member, TensorType):
            cls.fail("C4", f"operand member type {member}")
        n = ctx.cardinality.get(t.placement)
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            n = None  # module/C2 reports the cardinality; only the dtype is checked
        found = cls.problem(member.dtype, n, op.attrs)
        if found is not None:
            cls.fail(*found)

    @classmethod
    def reference(cls, x: np.ndarray, attrs: dict) -> np.ndarray:
        return l_estimate_numpy(x, cls.trim_for(x.shape[0], attrs))


def _check(cls):
    def check(member, *, n, **params):

        found = cls.problem(dtype_name(member.dtype), n, params)
        if found is not None:
            raise cls.error(*found)

    return check


trimmed_mean_p = P.define_reduction(
    "fed_trimmed_mean", lambda x, *, n, trim: l_estimate(x, n=n, trim=trim), _check(TrimmedMean)
)
TrimmedMean.primitive = trimmed_mean_p


# --- derivative -------------------------------------------------------------------------


def _where_region(op: str, fill: float):
    def where(x, v):
        import jax.numpy as jnp

        keep = {"<": x < v, ">": x > v, "<=": x <= v, ">=": x >= v}[op]
        return [jnp.where(keep, x, jnp.asarray(fill, x.dtype))]

    return where


def _count_region(op: str):
    def count(x, v):
        import jax.numpy as jnp

        hit = {"<": x < v, ">": x > v, "==": x == v, "nan": jnp.isnan(x)}[op]
        return [hit.astype(jnp.float32)]

    return count


def _weighted_region():
    def weighted(x, lo, hi, c_lo, c_hi, c_mid, t):
        import jax.numpy as jnp

        w = (
            jnp.where((x > lo) & (x < hi), c_mid, 0.0)
            + jnp.where(x == lo, c_lo, 0.0)
            + jnp.where(x == hi, c_hi, 0.0)
        )
        return [t * w.astype(t.dtype)]

    return weighted


class _Fed:
    """The fed primitives a derivative rule binds, at one placement; its broadcasts are
    laid out like ``x``, the placed operand they meet member by member."""

    def __init__(self, placement: str, n: int, x):
        self.kw = {"placement": placement, "n": n}
        self.x = x

    def bcast(self, v):
        return broadcast_like(v, self.x, **self.kw)

    def map(self, builder, static, *placed):
        return member_map(builder, static, self.kw["placement"], self.kw["n"], *placed)[0]

    def sum(self, x):
        return sum_p.bind(x, **self.kw)

    def min(self, x):
        return min_p.bind(x, **self.kw)

    def max(self, x):
        return max_p.bind(x, **self.kw)

    def count(self, op: str, x, v):
        return self.sum(self.map(_count_region, (op,), x, self.bcast(v)))


def order_statistic(f: _Fed, x, k: int, *, largest: bool):
    """The ``k``-th smallest (``largest``: k-th largest) member value per coordinate,
    by ``k + 1`` rounds over the distinct values from the bottom (top)."""
    import jax.numpy as jnp

    pick, beyond, fill = (f.min, ">", np.inf) if not largest else (f.max, "<", -np.inf)
    v = pick(x)
    cum = f.count("==", x, v)
    stat = v
    for _ in range(k):
        v = pick(f.map(_where_region, (beyond, float(fill)), x, f.bcast(v)))
        stat = jnp.where(cum <= k, v, stat)
        cum = cum + f.count("==", x, v)
    return stat


def l_estimate_tangent(f: _Fed, x, t, n: int, k: int, lo, hi):
    """``sum_i w_i t_i`` (a ``fed.sum``) for the kept-position weights ``w`` given the
    thresholds ``lo = s_k`` and ``hi = s_{n-1-k}``; zero where a member is NaN (the
    value is NaN there: jnp.median's derivative)."""
    import jax.numpy as jnp

    m = n - 2 * k
    nan = f.count("nan", x, lo) > 0
    a, b = f.count("<", x, lo), f.count("==", x, lo)
    c, d = f.count(">", x, hi), f.count("==", x, hi)
    same = lo == hi
    c_lo = (jnp.minimum(a + b, n - k) - k) / (b * m)
    c_hi = jnp.where(same, 0.0, (jnp.minimum(c + d, n - k) - k) / (d * m))
    c_mid = jnp.full(jnp.shape(lo), 1.0 / m, jnp.float32)
    parts = [f.bcast(jnp.where(nan, 0.0, v).astype(jnp.float32)) for v in (c_lo, c_hi, c_mid)]
    return f.sum(f.map(_weighted_region, (), x, f.bcast(lo), f.bcast(hi), *parts, t))


def _trimmed_mean_jvp(primals, tangents, *, placement, n, trim):
    (x,), (t,) = primals, tangents
    ans = trimmed_mean_p.bind(x, placement=placement, n=n, trim=trim)
    if AD.is_zero(t):
        return ans, AD.zero_tangent(ans)
    f = _Fed(placement, n, x)
    lo = order_statistic(f, x, trim, largest=False)
    hi = order_statistic(f, x, trim, largest=True)
    return ans, l_estimate_tangent(f, x, t, n, trim, lo, hi)


AD.def_jvp(trimmed_mean_p, _trimmed_mean_jvp)


# --- the public function ----------------------------------------------------------------


@public
def reduce_trimmed_mean(x, *, trim: int):
    """Per-coordinate trimmed mean over members: ``{fN[...]}@child -> fN[...]@p``.

    Drops the ``trim`` largest and ``trim`` smallest member values of each coordinate
    and averages the rest (``0 <= 2*trim < n``). A robust aggregate, not a secure one:
    whoever aggregates sees every member's value (docs/adding_an_op.md).

    A coordinate where any member is NaN is NaN, whatever ``trim`` (as
    ``scipy.stats.trim_mean``), and its gradient is zero for every member; ``inf`` is
    an ordinary, largest value.
    """

    if isinstance(trim, bool) or not isinstance(trim, (int, np.integer)):
        raise PlacementError(f"fcir.reduce_trimmed_mean: trim must be an int, got {trim!r}")
    return api._reduce(trimmed_mean_p, "fcir.reduce_trimmed_mean", x, trim=int(trim))
