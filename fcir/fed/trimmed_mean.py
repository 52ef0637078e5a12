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
kept positions holding ``lo`` (and ``hi``) pass it from the member there, found by the
index the sort recorded (``fed.band_edges``, ``fed.member_index``) where it is alone
at the edge, and share it equally among the tied members otherwise (found by
equality). A recomputed member value need not have the sort's last bits (another
fusion of the program, a streamed backward pass), so matching it to the edge by value
could miss the member, which then lost its whole gradient (seen compiled at XLA's
optimization level 0). Everything per member happens in ``fed_map`` regions and every
sum over members is a ``fed.sum``, so the derivative stays federated; its size does not
grow with ``trim``.

NaN: a coordinate where any member's value is NaN comes out NaN (as ``np.median``,
``jnp.median`` and ``scipy.stats.trim_mean`` give; a sort alone would rank NaN as the
largest value and trim it away unseen), and its derivative is zero for every member
(as ``jax.grad`` of ``jnp.median`` gives there): ``fed.band_edges`` counts the NaN
members. Other coordinates are unaffected. To drop a bad client's update rather than let it
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

from .band_edges import band_edges_p
from .base import Reduction, public
from .broadcast import broadcast_like
from .map import member_map
from .member_index import member_index
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


def _weighted_region(acc: str):
    def weighted(x, index, edges, c, t):
        import jax.numpy as jnp

        v = x.astype(acc)
        lo, hi, lo_index, hi_index, _, at_lo, _, at_hi, _ = edges
        i = index.astype(acc)
        # The member alone at an edge is the one the sort recorded; members tied at an
        # edge share its weight, found by equality.
        own_lo, own_hi = (at_lo == 1) & (i == lo_index), (at_hi == 1) & (i == hi_index)
        on_lo = jnp.where(at_lo == 1, own_lo, v == lo)
        on_hi = jnp.where(at_hi == 1, own_hi, v == hi)
        inside = (v > lo) & (v < hi) & ~own_lo & ~own_hi
        w = jnp.where(inside, c[2], 0.0) + jnp.where(on_lo, c[0], 0.0)
        return [t * (w + jnp.where(on_hi, c[1], 0.0)).astype(t.dtype)]

    return weighted


def band_tangent(x, t, *, placement: str, n: int, trim: int):
    """``sum_i w_i t_i`` (a ``fed.sum``) for the kept positions' weights ``w``: the
    band's edges, the members alone at them and the counts around them from one sort
    (``fed.band_edges``), the members told apart by ``fed.member_index``; zero where a
    member is NaN (the value is NaN there: jnp.median's derivative)."""
    import jax.numpy as jnp

    kw = {"placement": placement, "n": n}
    edges = band_edges_p.bind(x, trim=trim, **kw)
    lo, hi, _, _, below, at_lo, above, at_hi, nan = edges
    m, k = n - 2 * trim, trim
    c_lo = (jnp.minimum(below + at_lo, n - k) - k) / (at_lo * m)
    c_hi = jnp.where(lo == hi, 0.0, (jnp.minimum(above + at_hi, n - k) - k) / (at_hi * m))
    c_mid = jnp.full(jnp.shape(lo), 1.0 / m, edges.dtype)
    c = jnp.where(nan > 0, 0.0, jnp.stack([c_lo, c_hi, c_mid])).astype(jnp.float32)
    index = member_index(x, placement, n)
    (parts,) = member_map(
        _weighted_region,
        (np.dtype(edges.dtype).name,),
        placement,
        n,
        x,
        index,
        broadcast_like(edges, x, **kw),
        broadcast_like(c, x, **kw),
        t,
    )
    return sum_p.bind(parts, **kw)


def _trimmed_mean_jvp(primals, tangents, *, placement, n, trim):
    (x,), (t,) = primals, tangents
    ans = trimmed_mean_p.bind(x, placement=placement, n=n, trim=trim)
    if AD.is_zero(t):
        return ans, AD.zero_tangent(ans)
    return ans, band_tangent(x, t, placement=placement, n=n, trim=trim)


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
