"""What a stream does with a reduction: one :class:`Accumulator` per family of fed ops.

``streaming.py``'s table maps each fed op class to one of these objects (or to an
``Unsupported``); the stream's loop only calls their methods, so an op's streamed
meaning is its table entry. The families:

- :class:`Linear`: the sum-like ops (``fed.sum``, ``mean``, ``secure_sum``; with
  :class:`Weighted`, ``weighted_mean``): a running sum in the accumulation dtype of the
  result dtype (f32 for f16/bf16, as the reference and ``jnp.sum``), finished once at
  the end (rounded, divided by the cohort or the weight sum, wrapped to the bitwidth);
- :class:`Extremum`: ``fed.min`` / ``fed.max``, the running extremum, the count of
  members at it (the gradient is shared among them, as ``jnp.min``'s is) and the first
  of them (where it is the only one, the gradient goes to it by its index);
- :class:`Gaussian`: the central DP aggregates, each member clipped and summed, the
  noise drawn once at the end from the key that lives with the result;
- ``streaming_ddp.Distributed``: the distributed DP aggregates.

Every method takes the op (its operands, attributes and declared result types) and
works on lists of arrays, one per *part* of the accumulator. ``members`` (``step``,
``part_cotangent``) holds the cohort indices of the chunk's ``k`` rows (int32).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from fcir.fed.dp_sum import exact_params_of
from fcir.ir import Op, Value
from fcir.ir.types import PlacedType
from fcir.mechanisms import lattice
from fcir.mechanisms.clipping import clip_member
from fcir.mechanisms.gaussian import dp_noise
from fcir.opkit import primitives as P

__all__ = [
    "Accumulator",
    "Extremum",
    "Gaussian",
    "Linear",
    "Weighted",
    "as_result",
    "declared_dtype",
    "divided_by_cohort",
    "divided_by_weight",
    "masked",
    "wrapped_to_bitwidth",
]


def declared_dtype(op: Op, i: int = 0) -> np.dtype:
    """The dtype of result ``i`` of ``op``, as its IR type declares it."""
    t = op.results[i].type
    while isinstance(t, PlacedType):
        t = t.member
    return t.np_dtype


def masked(y, valid, fill):
    """``y`` with the members an earlier chunk already counted replaced by ``fill``."""
    if valid is None:
        return y
    return jnp.where(valid.reshape((-1,) + (1,) * (y.ndim - 1)), y, fill)


class Accumulator:
    """How a stream folds one reduction ``k`` members at a time.

    ``init`` -> ``step`` per chunk -> ``combine`` of the per-device partials (stacked on
    a leading axis) -> ``finish`` once. For reverse mode, ``contribution`` is what a
    chunk adds (the linear part the gradient flows through), ``seed`` what each chunk's
    contribution is pulled back with, and ``part_cotangent`` that seed for one chunk."""

    def parts(self, op: Op) -> int:
        """How many arrays the accumulator holds."""
        return 1

    def member_operands(self, op: Op) -> list[Value]:
        """The operands read member by member (sliced a chunk at a time)."""
        return list(op.operands)

    def server_operands(self, op: Op) -> list[Value]:
        """The operands read once, where the result lives (a DP op's key)."""
        return []

    def init(self, op: Op, shapes: dict, n: int) -> list:
        raise NotImplementedError

    def contribution(self, op: Op, vals: dict, valid) -> list:
        raise NotImplementedError

    def step(self, op: Op, acc: list, vals: dict, valid, n: int, *, members=None) -> list:
        return [a + p for a, p in zip(acc, self.contribution(op, vals, valid))]

    def combine(self, op: Op, partial: list) -> list:
        return [jnp.sum(a, axis=0, dtype=a.dtype) for a in partial]

    def finish(self, op: Op, acc: list, n: int, server: dict) -> list:
        """The op's results (``server``: the stream's unbatched values by Value)."""
        raise NotImplementedError

    def seed(self, op: Op, acc: list, cts: list, n: int) -> list:
        """From the cotangents of the op's results (arrays, none symbolic)."""
        raise NotImplementedError

    def part_cotangent(self, op: Op, seed: list, part: list, valid, *, members=None) -> list:
        return seed


# Finishing steps of the sum-like family: the result (dtype ``dt``) from the running
# sums ``acc`` of a cohort of ``n``.


def as_result(acc: list, n: int, dt, op: Op):
    """The sum, rounded to the result dtype."""
    return acc[0].astype(dt)


def divided_by_cohort(acc: list, n: int, dt, op: Op):
    """The mean: divided by the cohort size in the accumulation dtype, then rounded."""
    return (acc[0] / jnp.asarray(n, acc[0].dtype)).astype(dt)


def divided_by_weight(acc: list, n: int, dt, op: Op):
    """The weighted mean: the weighted sum over the weight sum, in the result dtype."""
    return acc[0].astype(dt) / acc[1].astype(dt)


def wrapped_to_bitwidth(acc: list, n: int, dt, op: Op):
    """The secure sum: the integer sum (exact modulo its dtype's width) modulo
    ``2**bitwidth``."""
    total, bits = acc[0], op.attrs["bitwidth"]
    if bits < np.dtype(total.dtype).itemsize * 8:
        total = jnp.bitwise_and(total, jnp.asarray((1 << bits) - 1, total.dtype))
    return total


class Linear(Accumulator):
    """A sum-like reduction: ``total(acc, n, result dtype, op)`` gives the result from
    the running sum, whose dtype is the accumulation dtype of ``result_dtype(member
    dtype)``. Rounding to the result dtype happens once, there: a bf16 or f16 running
    sum rounded every chunk drops small terms and overflows (the f16 mean of five
    20000s was inf)."""

    def __init__(self, result_dtype=np.dtype, total=as_result):
        self.result_dtype = result_dtype
        self.total = total

    def _acc_dtype(self, op: Op, dtype) -> np.dtype:
        return P.accumulation_dtype(self.result_dtype(dtype))

    def init(self, op, shapes, n):
        x = shapes[op.operands[0]]
        a = self._acc_dtype(op, x.dtype)
        return [jnp.full(x.shape[1:], np.zeros((), a), a)]

    def contribution(self, op, vals, valid):
        x = vals[op.operands[0]]
        a = self._acc_dtype(op, x.dtype)
        return [jnp.sum(masked(x.astype(a), valid, 0), axis=0, dtype=a)]

    def finish(self, op, acc, n, server):
        return [self.total(acc, n, declared_dtype(op), op)]

    def seed(self, op, acc, cts, n):
        dt = declared_dtype(op)
        _, pull = jax.vjp(lambda a: self.total(a, n, dt, op), acc)
        (ct_acc,) = pull(cts[0])
        return list(ct_acc)


def _weights(x, w):
    dt = P.mean_result_dtype(x.dtype)
    return x.astype(dt), w.astype(dt).reshape(w.shape + (1,) * (x.ndim - w.ndim))


class Weighted(Linear):
    """``fed.weighted_mean``: the weighted sum and the weight sum, products in the
    result dtype and sums in its accumulation dtype (the reference's)."""

    def parts(self, op):
        return 2

    def init(self, op, shapes, n):
        x, w = shapes[op.operands[0]], shapes[op.operands[1]]
        dt = self._acc_dtype(op, x.dtype)
        w_shape = w.shape[1:] + (1,) * (len(x.shape) - len(w.shape))
        return [jnp.zeros(x.shape[1:], dt), jnp.zeros(w_shape, dt)]

    def contribution(self, op, vals, valid):
        xs, ws = _weights(vals[op.operands[0]], vals[op.operands[1]])
        a = P.accumulation_dtype(xs.dtype)
        return [
            jnp.sum(masked((xs * ws).astype(a), valid, 0), axis=0),
            jnp.sum(masked(ws.astype(a), valid, 0), axis=0),
        ]


class Extremum(Accumulator):
    """``fed.min`` (``smallest=True``) or ``fed.max``: the running extremum, the count of
    members at it, which shares the gradient among them, and the cohort index of the
    first member at it.

    The backward loop recomputes each chunk's values, and a recomputed value need not
    have the forward's bits (XLA fuses and vectorizes the two programs differently:
    measured at LLVM -O0, a member's value a few ulps off made ``x == extremum`` false
    and dropped its whole gradient). So where one member is at the extremum (the usual
    case) the gradient goes to it by its index; only ties are found by equality."""

    #: The index part's value before any member is seen (no member has it).
    NO_MEMBER = np.iinfo(np.int32).max

    def __init__(self, *, smallest: bool):
        self.smallest = smallest
        self.fold, self.reduce = (jnp.minimum, jnp.min) if smallest else (jnp.maximum, jnp.max)

    def parts(self, op):
        return 3

    def identity(self, dtype):
        """The value a masked-out member contributes: leaves the extremum unchanged."""
        dtype = np.dtype(dtype)
        if dtype == np.bool_:
            return np.array(self.smallest)
        if jnp.issubdtype(dtype, jnp.floating):
            return np.array(np.inf if self.smallest else -np.inf, dtype)
        info = jnp.iinfo(dtype)
        return np.array(info.max if self.smallest else info.min, dtype)

    def init(self, op, shapes, n):
        x = shapes[op.operands[0]]
        dt, shape = np.dtype(x.dtype), x.shape[1:]
        return [
            jnp.full(shape, self.identity(dt), dt),
            jnp.zeros(shape, jnp.int32),
            jnp.full(shape, self.NO_MEMBER, jnp.int32),
        ]

    def contribution(self, op, vals, valid):
        return [vals[op.operands[0]]]  # the members' values: the gradient picks among them

    def _first(self, at, members):
        """Per element, the smallest index among the members where ``at``."""
        idx = jnp.broadcast_to(members.reshape((-1,) + (1,) * (at.ndim - 1)), at.shape)
        return jnp.min(jnp.where(at, idx, self.NO_MEMBER), axis=0)

    def step(self, op, acc, vals, valid, n, *, members=None):
        x = vals[op.operands[0]]
        part = masked(x, valid, self.identity(x.dtype))
        m = self.reduce(part, axis=0)
        at = part == m
        if valid is not None:
            at = masked(at, valid, False)
        new = self.fold(acc[0], m)
        kept, arrived = acc[0] == new, m == new
        count = jnp.where(kept, acc[1], 0) + jnp.where(
            arrived, jnp.sum(at, axis=0, dtype=jnp.int32), 0
        )
        first = jnp.minimum(
            jnp.where(kept, acc[2], self.NO_MEMBER),
            jnp.where(arrived, self._first(at, members), self.NO_MEMBER),
        )
        return [new, count, first]

    def combine(self, op, partial):
        m = self.reduce(partial[0], axis=0)
        at = partial[0] == m
        return [
            m,
            jnp.sum(jnp.where(at, partial[1], 0), axis=0, dtype=jnp.int32),
            jnp.min(jnp.where(at, partial[2], self.NO_MEMBER), axis=0),
        ]

    def finish(self, op, acc, n, server):
        return [acc[0].astype(declared_dtype(op))]

    def seed(self, op, acc, cts, n):
        return [acc[0], cts[0] / acc[1].astype(cts[0].dtype), acc[1], acc[2]]

    def part_cotangent(self, op, seed, part, valid, *, members=None):
        (x,) = part
        extremum, share, count, first = seed
        idx = jnp.broadcast_to(members.reshape((-1,) + (1,) * (x.ndim - 1)), x.shape)
        at = jnp.where(count == 1, idx == first, x == extremum)
        if valid is not None:
            at = masked(at, valid, False)
        return [jnp.where(at, share, jnp.zeros((), share.dtype))]


class Gaussian(Accumulator):
    """``fed.dp_sum`` / ``fed.dp_mean`` (``mean``): each member's pytree clipped and
    summed leaf by leaf in the accumulation dtype; the noise is drawn once, at the end,
    from the key (the last operand, a value where the result lives), leaf ``i`` with
    ``fold_in(key, i)`` in the leaf's declared dtype, as the unstreamed op draws it.
    The gradient treats the clipped sum as the result (noise and rounding constant)."""

    def __init__(self, *, mean: bool):
        self.mean = mean

    def parts(self, op):
        return len(op.operands) - 1

    def member_operands(self, op):
        return list(op.operands[:-1])

    def server_operands(self, op):
        return [op.operands[-1]]

    def init(self, op, shapes, n):
        exact = "gamma" in op.attrs  # exact mode: an int32 sum of grid points
        return [
            jnp.zeros(
                shapes[v].shape[1:],
                jnp.int32 if exact else P.accumulation_dtype(shapes[v].dtype),
            )
            for v in op.operands[:-1]
        ]

    def contribution(self, op, vals, valid):
        leaves = [vals[v] for v in op.operands[:-1]]
        clip = op.attrs["clip_norm"]
        clipped = jax.vmap(lambda *m: clip_member(m, clip))(*leaves)
        clipped = [c.astype(P.accumulation_dtype(c.dtype)) for c in clipped]
        return [jnp.sum(masked(c, valid, 0), axis=0) for c in clipped]

    def step(self, op, acc, vals, valid, n, *, members=None):
        if "gamma" not in op.attrs:
            return super().step(op, acc, vals, valid, n)
        # Exact mode (fcir.mechanisms.lattice): integers, so any chunking sums the same.
        leaves = [vals[v] for v in op.operands[:-1]]
        g = op.attrs["gamma"]
        clipped = jax.vmap(lambda *m: clip_member(m, op.attrs["clip_norm"]))(*leaves)
        grid = [masked(lattice.to_grid(c, g), valid, 0) for c in clipped]
        return [a + jnp.sum(q, axis=0, dtype=jnp.int32) for a, q in zip(acc, grid)]

    def finish(self, op, acc, n, server):
        key, a = server[op.operands[-1]], op.attrs
        if "gamma" in a:
            like = [v.type.member for v in op.operands[:-1]]
            p = exact_params_of(op, n)
            return [
                lattice.release(
                    t + lattice.noise(key, i, t.shape, p),
                    n,
                    self.mean,
                    a["gamma"],
                    like[i].np_dtype,
                )
                for i, t in enumerate(acc)
            ]
        out = []
        for i, total in enumerate(acc):
            total = total.astype(declared_dtype(op, i))  # the noise is added in it
            total = total + dp_noise(
                key, i, total.shape, total.dtype, a["clip_norm"], a["noise_multiplier"]
            )
            out.append(total / n if self.mean else total)
        return out

    def seed(self, op, acc, cts, n):
        return [c / n if self.mean else c for c in cts]
