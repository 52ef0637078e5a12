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

The walk starts at the position of the members below ``s[trim]``: the bisection's own
count when it last raised the lower threshold. A separate count of ``key < lo`` (as
before) came out wrong compiled at XLA backend optimization level 0, on both JAX
versions: a member whose key equals ``lo`` was counted below it, and the walk then
dropped the largest kept value (root cause inside XLA not isolated; the bisection's
``<=`` counts and the walk's ``>`` agree with the values).

Not differentiable here: a cotangent reaching a streamed order statistic is an
InterpreterError (compile without ``clients_per_step`` to differentiate it).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = ["BandEdgesPasses", "ByPasses", "OrderStatistic"]


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
        ``step(acc, x_chunk, valid, start)`` over every chunk of the members (one pass;
        ``start``: the cohort index of the chunk's first row).

        Every pass is one iteration of a single loop whose one chunk step folds every
        pass kind's accumulator: the member values are then computed by the same
        instructions in every pass. Recomputed in separately compiled loops they could
        differ in a last bit (XLA fuses each loop body its own way; at optimization
        level 0 they did), and a count taken in one pass would not match the values of
        the next."""
        u = self._u()
        bits = _key_dtypes(self.dtype)[2]
        r = (self.trim, self.n - 1 - self.trim)
        end = self.n - self.trim
        acc_dt = np.result_type(self.dtype, np.float32)
        top = jnp.full(self.shape, np.iinfo(u).max, u)
        zero_u = jnp.zeros(self.shape, u)
        zero_i = jnp.zeros(self.shape, jnp.int32)
        # Phases: 0 bisection (``bits`` passes), 2 walk the kept band's distinct values,
        # 3 done.
        walk = self.kept > 2

        def mids(st):
            return st["lo1"] + (st["hi1"] - st["lo1"]) // 2, st["lo2"] + (
                st["hi2"] - st["lo2"]
            ) // 2

        def one_pass(st):
            mid = mids(st)

            def step(acc, x, valid, start=None):
                c1, c2, nan = self.bisect_step(mid, acc[:3], x, valid)
                m, c = self.next_step(st["cur"], acc[3:], x, valid)
                return c1, c2, nan, m, c

            c1, c2, nan, m, count = over_chunks(step, (zero_i, zero_i, zero_i, *self.next_init()))
            phase = st["phase"]
            out = dict(st)
            # phase 0: one bisection step on both thresholds
            up1, up2 = c1 > r[0], c2 > r[1]
            bis = phase == 0
            out["lo1"] = jnp.where(bis & ~up1, mid[0] + 1, st["lo1"])
            out["hi1"] = jnp.where(bis & up1, mid[0], st["hi1"])
            out["lo2"] = jnp.where(bis & ~up2, mid[1] + 1, st["lo2"])
            out["hi2"] = jnp.where(bis & up2, mid[1], st["hi2"])
            out["nan"] = jnp.where(bis, nan, st["nan"])
            # The members below s[trim]: count(key <= mid) when lo1 was last raised to
            # mid + 1 (no member's key is 0, a NaN's bits keyed largest, so it is). A
            # count of key < lo1 in a pass of its own came out wrong at XLA optimization
            # level 0 (an equal key counted below) and is not needed.
            out["below"] = jnp.where(bis & ~up1, c1, st["below"])
            # After the last bisection step the walk starts just below s[trim], at the
            # position of the members below it.
            first = bis & (st["i"] + 1 >= bits)
            out["cur"] = jnp.where(first, out["lo1"] - jnp.ones_like(st["lo1"]), st["cur"])
            out["pos"] = jnp.where(first, out["below"], st["pos"])
            # phase 2: add the next distinct value as often as it is kept
            pos = st["pos"]
            active = (phase == 2) & (pos < end)
            start = jnp.maximum(pos, self.trim)
            stop = jnp.minimum(pos + count, end)
            times = jnp.where(active, jnp.maximum(stop - start, 0), 0)
            v = from_key(m, self.dtype).astype(self.dtype).astype(acc_dt)
            out["total"] = _add_times(st["total"], v, times)
            out["cur"] = jnp.where(active, m, out["cur"])
            out["pos"] = jnp.where(active, pos + count, out["pos"])
            done_walk = jnp.all(out["pos"] >= end)
            out["phase"] = jnp.where(
                bis,
                jnp.where(st["i"] + 1 < bits, 0, 2 if walk else 3),
                jnp.where(done_walk, 3, phase),
            )
            out["i"] = st["i"] + 1
            return out

        init = {
            "phase": jnp.zeros((), jnp.int32),
            "i": jnp.zeros((), jnp.int32),
            "lo1": zero_u,
            "hi1": top,
            "lo2": zero_u,
            "hi2": top,
            "nan": zero_i,
            "below": zero_i,
            "cur": zero_u,
            "pos": zero_i,
            "total": jnp.zeros(self.shape, acc_dt),
        }
        st = lax.while_loop(lambda st: st["phase"] < 3, one_pass, init)
        if walk:
            total = st["total"]
        else:
            total = jnp.zeros(self.shape, acc_dt) + from_key(st["lo1"], self.dtype).astype(
                self.dtype
            ).astype(acc_dt)
            if self.kept == 2:
                total = total + from_key(st["lo2"], self.dtype).astype(self.dtype).astype(acc_dt)
        mean = total / jnp.asarray(self.kept, acc_dt)
        return jnp.where(st["nan"] > 0, jnp.nan, mean).astype(self.dtype)

    # -- the band's edges (fed.band_edges) ---------------------------------------------------

    def edges(self, over_chunks):
        """``fed.band_edges``'s record (``[9, *shape]``: the edges ``lo``/``hi``, the
        lowest member index at each, the counts below, at, above and NaN) of the members
        ``over_chunks`` folds (as :meth:`run`'s). The bisection passes find the edges and,
        from their own counts, how many members lie below and at each (as :meth:`run`
        takes the band's start); one more pass finds the lowest member index at each
        edge. One loop, so every pass computes the member values alike."""
        u = self._u()
        bits = _key_dtypes(self.dtype)[2]
        r = (self.trim, self.n - 1 - self.trim)
        acc_dt = np.result_type(self.dtype, np.float32)
        shape = self.shape
        zero_i = jnp.zeros(shape, jnp.int32)
        every = nobody = jnp.full(shape, self.n, jnp.int32)  # (names for the two uses)

        def one_pass(st):
            mid = st["lo1"] + (st["hi1"] - st["lo1"]) // 2, st["lo2"] + (st["hi2"] - st["lo2"]) // 2

            def step(acc, x, valid, start):
                c1, c2, nan = self.bisect_step(mid, acc[:3], x, valid)
                key = to_key(x, self.dtype)
                ok = jnp.ones(key.shape[:1], bool) if valid is None else valid
                ok = ok.reshape(ok.shape + (1,) * len(shape))
                at = (start + jnp.arange(key.shape[0], dtype=jnp.int32)).reshape(ok.shape)

                def first(edge, so_far):
                    return jnp.minimum(
                        so_far, jnp.min(jnp.where(ok & (key == edge), at, self.n), 0)
                    )

                return c1, c2, nan, first(st["lo1"], acc[3]), first(st["lo2"], acc[4])

            c1, c2, nan, first_lo, first_hi = over_chunks(
                step, (zero_i, zero_i, zero_i, nobody, nobody)
            )
            bis = st["i"] < bits
            up1, up2 = c1 > r[0], c2 > r[1]
            out = dict(st)
            out["lo1"] = jnp.where(bis & ~up1, mid[0] + 1, st["lo1"])
            out["hi1"] = jnp.where(bis & up1, mid[0], st["hi1"])
            out["lo2"] = jnp.where(bis & ~up2, mid[1] + 1, st["lo2"])
            out["hi2"] = jnp.where(bis & up2, mid[1], st["hi2"])
            # count(key <= mid) when an edge's lower bound was last raised to mid + 1 is
            # the count below the edge; when its upper bound was last lowered to mid,
            # the count up to the edge (its bounds end on it).
            out["below_lo"] = jnp.where(bis & ~up1, c1, st["below_lo"])
            out["upto_lo"] = jnp.where(bis & up1, c1, st["upto_lo"])
            out["below_hi"] = jnp.where(bis & ~up2, c2, st["below_hi"])
            out["upto_hi"] = jnp.where(bis & up2, c2, st["upto_hi"])
            out["nan"] = jnp.where(bis, nan, st["nan"])
            out["first_lo"] = jnp.where(bis, st["first_lo"], first_lo)  # the last pass
            out["first_hi"] = jnp.where(bis, st["first_hi"], first_hi)
            out["i"] = st["i"] + 1
            return out

        zero_u = jnp.zeros(shape, u)
        top = jnp.full(shape, np.iinfo(u).max, u)
        init = {"i": jnp.zeros((), jnp.int32), "lo1": zero_u, "hi1": top, "lo2": zero_u}
        init.update(hi2=top, below_lo=zero_i, upto_lo=every, below_hi=zero_i, upto_hi=every)
        init.update(nan=zero_i, first_lo=nobody, first_hi=nobody)
        st = lax.while_loop(lambda st: st["i"] <= bits, one_pass, init)
        lo, hi = (
            from_key(st[k], self.dtype).astype(self.dtype).astype(acc_dt) for k in ("lo1", "lo2")
        )
        rows = [lo, hi, st["first_lo"], st["first_hi"], st["below_lo"]]
        rows += [st["upto_lo"] - st["below_lo"], self.n - st["upto_hi"]]
        rows += [st["upto_hi"] - st["below_hi"]]
        rows = [jnp.where(st["nan"] > 0, 0, v).astype(acc_dt) for v in rows]
        return jnp.stack([*rows, st["nan"].astype(acc_dt)])


def _add_times(total, v, times):
    """``total + v + v + ...``, ``times`` adds per coordinate, one by one."""

    def body(c):
        j, t = c
        return j + 1, jnp.where(j < times, t + v, t)

    return lax.while_loop(lambda c: c[0] < jnp.max(times), body, (0, total))[1]


class ByPasses:
    """Streaming's family for the order statistics (its table entry for ``fed.median``
    and ``fed.trimmed_mean``): not an :class:`~.accumulators.Accumulator`, which folds
    each chunk once, but passes over the chunks after the stream's loop, each
    recomputing the chunk's values. The robust aggregates' families
    (``streaming_robust.py``) are passes too, and subclass it."""

    def member_operands(self, op) -> list:
        return list(op.operands)

    def server_operands(self, op) -> list:
        return []

    def run(self, op_cls, attrs: dict, chunks, shape, dtype):
        """``op_cls`` (``fed.median`` / ``fed.trimmed_mean``) of the members ``chunks``
        (``streaming.Chunks``) holds, of member shape ``shape`` and dtype ``dtype``, by
        :class:`OrderStatistic`."""
        trim = op_cls.trim_for(chunks.n, attrs)
        return OrderStatistic(chunks.n, trim, tuple(shape), np.dtype(dtype)).run(chunks.fold)

    def __str__(self) -> str:
        return "exact, by passes over the chunks (streaming_order.py)"


class BandEdgesPasses(ByPasses):
    """Streaming's family for ``fed.band_edges`` (the order statistics' derivatives'
    record): :meth:`OrderStatistic.edges`, the bisection passes and one more."""

    def run(self, op_cls, attrs: dict, chunks, shape, dtype):
        stat = OrderStatistic(chunks.n, attrs["trim"], tuple(shape), np.dtype(dtype))
        return stat.edges(chunks.fold)

    def __str__(self) -> str:
        return "exact, by passes over the chunks (streaming_order.py)"
