"""``fed.ddp_sum`` / ``fed.ddp_mean`` as streamed reductions (``streaming.py``): the
accumulator is the ``uint32[D]`` modular sum of the clients' encodings
(``fcir.mechanisms.ddgauss.encode``), chunk by chunk; the decoding runs once, at the end.

A client's encoding depends only on its own values and key, and uint32 adds are exact
modulo ``2**32`` in any order, so the streamed result is bit for bit the unstreamed
one (and the reference interpreter's)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fcir.mechanisms import ddgauss as ddp
from fcir.mechanisms.clipping import clip_member

from .accumulators import Accumulator, masked

__all__ = ["Distributed"]


def _params(op, shapes_or_vals, n: int) -> ddp.DdpParams:
    dim = ddp.member_dim(shapes_or_vals[v].shape[1:] for v in op.operands[:-1])
    return ddp.attr_params(op.attrs, dim, n, op.name)


class Distributed(Accumulator):
    """The distributed DP family (``mean``: ``fed.ddp_mean``): every operand, the keys
    included, is read per member; the gradient treats the clipped sum as the result
    (noise, quantization and rounding constant), as the op's own rule does."""

    def __init__(self, *, mean: bool):
        self.mean = mean

    def init(self, op, shapes, n):
        return [jnp.zeros((_params(op, shapes, n).padded_dim,), jnp.uint32)]

    def step(self, op, acc, vals, valid, n, *, members=None):
        p = _params(op, vals, n)
        leaves = [vals[v] for v in op.operands[:-1]]
        shares = ddp.encode_batch(leaves, vals[op.operands[-1]], p)
        if valid is not None:
            shares = jnp.where(valid[:, None], shares, jnp.uint32(0))
        return [acc[0] + jnp.sum(shares, axis=0, dtype=jnp.uint32)]

    def contribution(self, op, vals, valid):
        leaves = [vals[v] for v in op.operands[:-1]]
        clip = op.attrs["clip_norm"]
        clipped = jax.vmap(lambda *m: clip_member(m, clip))(*leaves)
        return [jnp.sum(masked(c, valid, 0), axis=0) for c in clipped]

    def finish(self, op, acc, n, server):
        like = [
            jax.ShapeDtypeStruct(v.type.member.shape, v.type.member.np_dtype)
            for v in op.operands[:-1]
        ]
        p = ddp.attr_params(op.attrs, ddp.member_dim(x.shape for x in like), n, op.name)
        total = jnp.bitwise_and(acc[0], jnp.uint32(p.modulus - 1))
        return ddp.decode(total, p, like, self.mean)

    def seed(self, op, acc, cts, n):
        return [c / n if self.mean else c for c in cts]
