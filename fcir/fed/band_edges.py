"""``fed.band_edges``: the edges of a trimmed mean's kept band, recorded by one sort for
the derivatives of ``fed.trimmed_mean`` and ``fed.median`` (``fcir.fed.trimmed_mean``).

``{fN[s]}@child -> aN[9, s]`` (``aN`` float32 or wider: every row holds its numbers
exactly), per coordinate, over the members sorted (NaN last, ``-0`` as ``+0``):

====  =========================================================================
row   what
====  =========================================================================
0, 1  ``lo = s[trim]`` and ``hi = s[n - 1 - trim]``, the band's edge values
2, 3  the lowest member index holding ``lo``, and ``hi`` (``n`` when none does)
4, 5  how many members are below ``lo``, and at it
6, 7  how many are above ``hi``, and at it
8     how many are NaN
====  =========================================================================

A coordinate with a NaN member records only that (rows 0 to 7 are 0): its derivative
is zero, as ``jnp.median``'s is there.

A derivative that passes a tangent to the member at an edge finds it by the index
recorded here (``fed.member_index``) where it is the only one there, not by comparing
a recomputed value with the edge: a backward pass, or another fusion of the same
program, may compute a member's value with other last bits than the sort saw (XLA at
optimization level 0 did, and the member lost its whole gradient). Members tied at an
edge share its weight, found by equality as before. Every row is read off the sort
(its values, and the member positions sorted with them), none by comparing the
operand with an edge again, so the counts and indices agree with the edges however
XLA computes the operand for each of its readers (compiled at optimization level 0 on
an 8-device mesh, counting the operand's members at an edge again found none there).
Not secure: the aggregator sees every value (a reduction in the clear, as the order
statistics).
"""

from __future__ import annotations

import numpy as np

from .base import Reduction
from .krum import _float, _int_attr, define_gathered, verify_gathered

__all__ = ["BandEdges", "ROWS", "band_edges_p"]

ROWS = 9  # lo, hi, lo_index, hi_index, below, at_lo, above, at_hi, nan


class BandEdges(Reduction):
    """The kept band's edges of a trimmed mean of ``trim``, the members at them and the
    counts around them: ``{fN[s]}@child -> aN[9, s]``. Not secure: the aggregator sees
    every value."""

    name = "fed.band_edges"
    attributes = {"trim": int}
    constraints = {
        **Reduction.constraints,
        "C3": "result must be aN[9, *member shape], aN float32 or wider, local to the "
        "current placement",
        "C4": "operand must be a floating-point tensor",
        "C5": "attribute 'trim' must be an int with 0 <= 2*trim < the cardinality of the "
        "placement reduced over",
    }

    @staticmethod
    def server_aggregate(x, *, trim):
        """The record over the members stacked on axis 0 (self-contained), every row
        read off the one sort (see the module's docstring)."""
        import jax
        import jax.numpy as jnp
        import numpy as np

        n = x.shape[0]
        acc = np.result_type(x.dtype, np.float32)
        pos = jax.lax.broadcasted_iota(jnp.int32, x.shape, 0)
        # jnp.sort's order: NaN last, -0 and +0 equal.
        s, member = jax.lax.sort((x.astype(acc), pos), dimension=0, num_keys=1)
        lo, hi = (jnp.where(e == 0, jnp.zeros_like(e), e) for e in (s[trim], s[n - 1 - trim]))

        def first(at):
            return jnp.min(jnp.where(at, member, n), axis=0)

        def count(at):
            return jnp.sum(at, axis=0)

        nan = count(jnp.isnan(s))
        rows = [lo, hi, first(s == lo), first(s == hi), count(s < lo), count(s == lo)]
        rows += [count(s > hi), count(s == hi)]
        return jnp.stack([*(jnp.where(nan > 0, 0, r).astype(acc) for r in rows), nan.astype(acc)])

    @classmethod
    def problem(cls, dtype: str, n: int | None, attrs: dict) -> tuple[str, str] | None:
        if not _float(dtype):
            return "C4", f"operand member dtype {dtype}"
        k = attrs.get("trim")
        if not _int_attr(k) or k < 0 or (n is not None and 2 * k >= n):
            return "C5", f"trim={k!r} over {n} members"
        return None

    @classmethod
    def result_shape(cls, shape: tuple, attrs: dict, n: int | None = None) -> tuple:
        return (ROWS, *shape)

    @classmethod
    def verify(cls, op, ctx):
        verify_gathered(cls, op, ctx, lambda dtype: "f64" if dtype == "f64" else "f32")

    @classmethod
    def reference(cls, x: np.ndarray, attrs: dict) -> np.ndarray:
        x = np.asarray(x)
        n, trim = x.shape[0], attrs["trim"]
        v = x.astype(np.result_type(x.dtype, np.float32))
        s = np.sort(v, axis=0)
        lo, hi = s[trim] + 0.0, s[n - 1 - trim] + 0.0  # -0 as +0
        pos = np.arange(n).reshape((n,) + (1,) * (x.ndim - 1))

        def first(at):
            return np.min(np.where(at, pos, n), axis=0)

        nan = np.isnan(v).sum(0)
        rows = [lo, hi, first(v == lo), first(v == hi), (v < lo).sum(0), (v == lo).sum(0)]
        rows += [(v > hi).sum(0), (v == hi).sum(0)]
        rows = [np.where(nan > 0, 0, r) for r in rows]
        return np.stack([np.asarray(r, v.dtype) for r in (*rows, nan)])


band_edges_p = define_gathered(
    BandEdges, jvp=None, result_dtype=lambda dtype: np.result_type(dtype, np.float32)
)
