"""Krum, Multi-Krum, Bulyan and the geometric median streamed: passes over the chunks
after the stream's loop, as the order statistics' (``streaming_order.py``), so that a
byzantine-robust round of a large cohort fits on one device.

- :class:`ChosenMembers` (``fed.krum``, ``fed.multi_krum``, ``fed.bulyan_select``,
  ``fed.bulyan``): the members' squared distances fill an ``n x n`` matrix block by
  block, chunk ``a`` against every chunk ``b >= a`` (the block and its transpose), in
  one loop whose every step computes one chunk's values: ``c (c + 1) / 2`` chunk
  computations for ``c`` chunks, where the unstreamed op computes each member once.
  The op's own ``choose`` picks the members from the matrix (Krum's scores, Bulyan's
  repeated Krum: the server's computation, on ``n**2`` scalars), then passes gather the
  chosen members' values by their index, a block of coordinates at a time, and the op's
  ``from_chosen`` finishes each block (Multi-Krum's mean, Bulyan's mean around the
  median: both per coordinate).
- :class:`WeiszfeldPasses` (``fed.geometric_median``): ``iters + 1`` passes (the mean,
  then each Weiszfeld step), each folding ``(sum_i w_i x_i, sum_i w_i)`` member by member
  (``fcir.fed.geometric_median.weiszfeld_fold``).

Bit for bit the unstreamed op, given the same member values: a distance or a norm sums
a member's coordinates in ``fcir.fed.krum.row_sums``'s order, which does not depend on
how many members are summed at once (XLA's own reduction's does), Weiszfeld's sums add
the members one by one in member order in both, and the choice and the finishing step
are the op's own functions on the same numbers. Members that a chunk's vmap computes
may differ in their last bits from the unchunked vmap's (docs/backends/streaming.md).

Temporaries: the distance matrix (``n**2`` scalars in float32 or wider and what the
op's ``choose`` makes of it), two chunks' values and their distance block, and the
chosen members' values of a block of coordinates (no more than one chunk's worth:
Bulyan's mean around the median needs every chosen value of a coordinate, so its
``n - 2f`` chosen members take about ``(n - 2f) / k`` passes, a block each): flat in the
cohort apart from the ``n**2`` scalars. Not differentiable here, as the order
statistics (a cotangent reaching them is refused).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from fcir.fed.geometric_median import weiszfeld_fold
from fcir.fed.krum import sq_distances

from .streaming_order import ByPasses

__all__ = ["ChosenMembers", "WeiszfeldPasses"]


def _each_chunk(count: int, body, init):
    """``init`` through ``body(i, carry)`` for chunks ``i = 0 .. count - 1``: a while
    loop, as the stream's own forward loop (nothing for partial evaluation to hoist)."""

    def step(c):
        return c[0] + 1, body(c[0], c[1])

    return lax.while_loop(lambda c: c[0] < count, step, (jnp.zeros((), jnp.int32), init))[1]


def _write(d, block, row, col, row_valid, col_valid):
    """``d`` with ``block`` written at ``(row, col)``, except where a row or column is a
    member another chunk holds (the ragged last chunk's overlap)."""
    k = block.shape[0]
    if row_valid is not None or col_valid is not None:
        ok = jnp.ones((k,), bool)
        rows = ok if row_valid is None else row_valid
        cols = ok if col_valid is None else col_valid
        old = lax.dynamic_slice(d, (row, col), (k, k))
        block = jnp.where(rows[:, None] & cols[None, :], block, old)
    return lax.dynamic_update_slice(d, block, (row, col))


def distance_matrix(chunks, size: int, dtype):
    """The members' squared distances (``[n, n]``, ``fcir.fed.krum.sq_distances``'s bits),
    block by block: chunk ``a`` is loaded (its values kept, its diagonal block written),
    then compared with each chunk after it; each block is written with its transpose."""
    n, k, count = chunks.n, chunks.k, chunks.count
    acc = np.result_type(dtype, np.float32)

    def step(carry):
        a, b, d, xa = carry
        load = b < 0
        i = jnp.where(load, a, b)
        x, valid, start = chunks.at(i)
        x = x.reshape(k, size)
        xa = jnp.where(load, x, xa)
        block = sq_distances(xa, x)
        a_start, a_valid = chunks.bounds(a)
        d = _write(d, block, a_start, start, a_valid, valid)
        d = _write(d, block.T, start, a_start, valid, a_valid)
        b = jnp.where(load, a + 1, b + 1)
        last = b >= count
        return jnp.where(last, a + 1, a), jnp.where(last, -1, b), d, xa

    zero = jnp.zeros((), jnp.int32)
    init = (zero, zero - 1, jnp.zeros((n, n), acc), jnp.zeros((k, size), dtype))
    return lax.while_loop(lambda c: c[0] < count, step, init)[2]


def finish_by_blocks(chunks, order, size: int, dtype, finish):
    """``finish`` (per coordinate) of the values of the members ``order`` names (cohort
    indices), stacked in that order, a block of coordinates at a time: each block one
    pass, each chunk filling the slots of the chosen members it holds. A block holds
    as many coordinates as make the chosen values no more than one chunk's (``k`` x
    ``size``): Bulyan's ``n - 2f`` chosen members take that many passes over ``k``."""
    k, m = chunks.k, order.shape[0]
    width = max(1, min(size, (k * size) // m))

    def one_block(b, out):
        # The last block may overlap the one before: its coordinates come out the same.
        col = jnp.minimum(b * width, size - width)

        def fill(i, chosen):
            x, valid, start = chunks.at(i)
            x = lax.dynamic_slice_in_dim(x.reshape(k, size), col, width, axis=1)
            pos = order - start
            inside = (pos >= 0) & (pos < k)
            pos = jnp.clip(pos, 0, k - 1)
            if valid is not None:
                inside = inside & valid[pos]
            return jnp.where(inside[:, None], jnp.take(x, pos, axis=0), chosen)

        chosen = _each_chunk(chunks.count, fill, jnp.zeros((m, width), dtype))
        return lax.dynamic_update_slice_in_dim(out, finish(chosen), col, axis=-1)

    shape = jax.eval_shape(finish, jax.ShapeDtypeStruct((m, size), dtype))
    out = jnp.zeros(shape.shape, shape.dtype)
    return _each_chunk(-(-size // width), one_block, out)


class ChosenMembers(ByPasses):
    """Streaming's family for the ops that choose members by their distances
    (``fed.krum``, ``fed.multi_krum``, ``fed.bulyan_select``, ``fed.bulyan``)."""

    def run(self, op_cls, attrs: dict, chunks, shape, dtype):
        size = int(np.prod(shape, dtype=int))
        order = op_cls.choose(distance_matrix(chunks, size, dtype), attrs)
        out = finish_by_blocks(chunks, order, size, dtype, lambda c: op_cls.from_chosen(c, attrs))
        return out.reshape(out.shape[:-1] + tuple(shape))

    def __str__(self) -> str:
        return (
            "exact, by passes over the chunks: the n x n distances, then the chosen members "
            "(streaming_robust.py)"
        )


class WeiszfeldPasses(ByPasses):
    """Streaming's family for ``fed.geometric_median``: the mean, then ``iters``
    Weiszfeld steps, each a pass over the chunks."""

    def run(self, op_cls, attrs: dict, chunks, shape, dtype):
        k, size = chunks.k, int(np.prod(shape, dtype=int))
        acc = np.result_type(dtype, np.float32)
        zero = (jnp.zeros((size,), acc), jnp.zeros((), acc))

        def one_pass(carry):
            p, z = carry

            def step(total, x, valid, start):
                rows = x.reshape(k, size).astype(acc)
                return weiszfeld_fold(total, rows, z, p, attrs["eps"], valid)

            total, weight = chunks.fold(step, zero)
            return p + 1, total / weight

        init = (jnp.zeros((), jnp.int32), zero[0])
        _, z = lax.while_loop(lambda c: c[0] <= attrs["iters"], one_pass, init)
        return z.reshape(shape).astype(dtype)

    def __str__(self) -> str:
        return "exact, a pass over the chunks per Weiszfeld step (streaming_robust.py)"
