"""``fed.median`` / ``fed.trimmed_mean`` streamed: exact order statistics by passes over
the chunks, temp memory independent of the cohort size (``streaming.py``).

An order statistic needs every member's value, but not at once: the ``r``-th smallest
value is the smallest ``v`` with ``count(x <= v) > r``, and a count folds chunk by
chunk. :class:`OrderStatistic` is an accumulator of that shape, run for several
*passes* over the chunks (each pass recomputes the chunk's values, so nothing per
member is kept): ``init`` / ``step`` / ``combine`` per pass, ``advance`` between passes,
``finish`` at the end.

1. **Bisection** (``bits`` passes: 32 for f32, f16 and bf16, which are compared as f32,
   64 for f64): both thresholds ``lo = s[trim]`` and ``hi = s[n-1-trim]`` at once, by
   bisecting the float's ordered integer key (its bits, negatives reversed; ``-0`` keyed
   as ``+0``, as ``jnp.sort`` ranks them) on ``count(key <= mid)``. The same passes
   count NaN members.
2. **The band's sum, in sorted order** (only when more than two values are kept):
   each pass finds the next distinct value above the last one and how many members
   hold it (a minimum with its count), and adds it that many times. The unstreamed op
   (``fcir.fed.trimmed_mean.l_estimate``) adds the kept sorted values one by one from
   the smallest too, so the float adds are the same ones in the same order: the result
   is bit for bit the unstreamed one. Passes: the number of distinct kept values, so a
   trimmed mean that keeps many members costs many passes; the median none.

Not differentiable here: a cotangent reaching a streamed order statistic is an
InterpreterError (compile without ``clients_per_step`` to differentiate it).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = ["OrderStatistic", "streamed"]


def _key_dtypes(dtype) -> tuple:
    """(float dtype compared, its unsigned bits dtype, bit count)."""
    if np.dtype(dtype) == np.float64:
        return np.dtype(np.float64), np.dtype(np.uint64), 64
    return np.dtype(np.float32), np.dtype(np.uint32), 32


def to_key(x, dtype):
    """Ordered unsigned keys of ``x`` (member values): ``a < b`` iff ``key(a) < key(b)``
    for numbers, ``-0`` and ``+0`` one key, NaN the largest key."""
    fdt, udt, bits = _key_dtypes(dtype)
    f = x.astype(fdt)
    f = jnp.where(f == 0, jnp.zeros_like(f), f)
    u = lax.bitcast_convert_type(f, udt)
    top = jnp.asarray(1, udt) << (bits - 1)
    key = jnp.where((u & top) != 0, ~u, u | top)
    return jnp.where(jnp.isnan(f), jnp.asarray(np.iinfo(udt).max, udt), key)


def from_key(k, dtype):
    fdt, udt, bits = _key_dtypes(dtype)
    top = jnp.asarray(1, udt) << (bits - 1)
    u = jnp.where((k & top) != 0, k & ~top, ~k)
    return lax.bitcast_convert_type(u.astype(udt), fdt)


@dataclasses.dataclass(frozen=True)
class OrderStatistic:
    """The streamed trimmed mean of ``n`` members keeping ``n - 2 trim`` (the median:
    ``trim = (n - 1) // 2``) of member shape ``shape`` and dtype ``dtype``."""

    n: int
    trim: int
    shape: tuple
    dtype: np.dtype

    @property
    def kept(self) -> int:
        return self.n - 2 * self.trim

    def _u(self):
        return _key_dtypes(self.dtype)[1]

    # -- pass kind 1: bisection on both thresholds, counting NaN ---------------------------

    def bisect_init(self):
        z = jnp.zeros(self.shape, jnp.int32)
        return (z, z, z)  # count(key <= mid_lo), count(key <= mid_hi), count(NaN)

    def bisect_step(self, mids, acc, x, valid):
        key = to_key(x, self.dtype)
        ok = jnp.ones(key.shape[:1], bool) if valid is None else valid
        ok = ok.reshape(ok.shape + (1,) * len(self.shape))
        lo, hi, nan = acc
        lo = lo + jnp.sum(ok & (key <= mids[0]), axis=0, dtype=jnp.int32)
        hi = hi + jnp.sum(ok & (key <= mids[1]), axis=0, dtype=jnp.int32)
        nan = nan + jnp.sum(ok & jnp.isnan(x), axis=0, dtype=jnp.int32)
        return lo, hi, nan

    # -- pass kind 2: the next distinct value above ``cur`` and how many hold it ------------

    def next_init(self):
        u = self._u()
        return (jnp.full(self.shape, np.iinfo(u).max, u), jnp.zeros(self.shape, jnp.int32))

    def next_step(self, cur, acc, x, valid):
        u = self._u()
        key = to_key(x, self.dtype)
        ok = (
            (key > cur[None])
            if valid is None
            else (key > cur[None]) & valid.reshape(valid.shape + (1,) * len(self.shape))
        )
        cand = jnp.where(ok, key, jnp.asarray(np.iinfo(u).max, u))
        m = jnp.min(cand, axis=0)
        c = jnp.sum(ok & (cand == m[None]), axis=0, dtype=jnp.int32)
        return self.next_combine(acc, (m, c))

    @staticmethod
    def next_combine(a, b):
        (ma, ca), (mb, cb) = a, b
        return jnp.minimum(ma, mb), jnp.where(ma < mb, ca, 0) + jnp.where(mb < ma, cb, 0) + (
            jnp.where(ma == mb, ca + cb, 0)
        )

    # -- the whole run ------------------------------------------------------------------------

    def run(self, over_chunks):
        """The result, given ``over_chunks(step, acc0)``: ``acc0`` folded by
        ``step(acc, x_chunk, valid)`` over every chunk of the members (one pass)."""
        u = self._u()
        bits = _key_dtypes(self.dtype)[2]
        r = (self.trim, self.n - 1 - self.trim)
        full = jnp.full(self.shape, np.iinfo(u).max, u)
        zero = jnp.zeros(self.shape, u)

        def bisect(_, state):
            lo1, hi1, lo2, hi2, _ = state
            mid1 = lo1 + (hi1 - lo1) // 2
            mid2 = lo2 + (hi2 - lo2) // 2
            c1, c2, nan = over_chunks(
                lambda acc, x, valid: self.bisect_step((mid1, mid2), acc, x, valid),
                self.bisect_init(),
            )
            up1, up2 = c1 > r[0], c2 > r[1]
            return (
                jnp.where(up1, lo1, mid1 + 1),
                jnp.where(up1, mid1, hi1),
                jnp.where(up2, lo2, mid2 + 1),
                jnp.where(up2, mid2, hi2),
                nan,
            )

        init = (zero, full, zero, full, jnp.zeros(self.shape, jnp.int32))
        k_lo, _, k_hi, _, nan = lax.fori_loop(0, bits, bisect, init)
        acc_dt = np.result_type(self.dtype, np.float32)
        a = from_key(k_lo, self.dtype).astype(self.dtype).astype(acc_dt)
        total = jnp.zeros(self.shape, acc_dt) + a
        if self.kept == 2:
            total = total + from_key(k_hi, self.dtype).astype(self.dtype).astype(acc_dt)
        elif self.kept > 2:
            total = self._walk(over_chunks, k_lo, acc_dt)
        mean = total / jnp.asarray(self.kept, acc_dt)
        return jnp.where(nan > 0, jnp.nan, mean).astype(self.dtype)

    def _walk(self, over_chunks, k_lo, acc_dt):
        """The kept values added one by one from the smallest: one pass per distinct
        value (the first pass counts the smallest's copies below ``n - trim``)."""
        end = self.n - self.trim
        below = k_lo - jnp.ones_like(k_lo)

        def add(total, v, times):
            def body(c):
                j, t = c
                return j + 1, jnp.where(j < times, t + v, t)

            return lax.while_loop(lambda c: c[0] < jnp.max(times), body, (0, total))[1]

        def cond(state):
            _, pos, _ = state
            return jnp.any(pos < end)

        def body(state):
            cur, pos, total = state
            nxt, count = over_chunks(
                lambda acc, x, valid: self.next_step(cur, acc, x, valid), self.next_init()
            )
            # Positions before ``trim`` (values below the kept band) are skipped, the
            # rest added; a coordinate already complete adds nothing.
            start = jnp.maximum(pos, self.trim)
            stop = jnp.minimum(pos + count, end)
            times = jnp.where(pos < end, jnp.maximum(stop - start, 0), 0)
            v = from_key(nxt, self.dtype).astype(self.dtype).astype(acc_dt)
            total = add(total, v, times)
            return jnp.where(pos < end, nxt, cur), jnp.where(pos < end, pos + count, pos), total

        # Start just below s[trim] (no member's key is 0: that is a NaN's bits, keyed
        # largest), at the position of the members below it (one counting pass).
        def below_step(acc, x, valid):
            hit = to_key(x, self.dtype) < k_lo[None]
            if valid is not None:
                hit = hit & valid.reshape(valid.shape + (1,) * len(self.shape))
            return acc + jnp.sum(hit, axis=0, dtype=jnp.int32)

        pos0 = over_chunks(below_step, jnp.zeros(self.shape, jnp.int32))
        state = (below, pos0, jnp.zeros(self.shape, acc_dt))
        return lax.while_loop(cond, body, state)[2]


def streamed(op_cls, attrs: dict, n: int, shape, dtype, over_chunks):
    """``op_cls`` (``fed.median`` / ``fed.trimmed_mean``) of the members that
    ``over_chunks`` folds, by :class:`OrderStatistic`."""
    trim = op_cls.trim_for(n, attrs)
    return OrderStatistic(n, trim, tuple(shape), np.dtype(dtype)).run(over_chunks)
