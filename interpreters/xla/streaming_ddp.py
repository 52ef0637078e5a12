"""``fed.ddp_sum`` / ``fed.ddp_mean`` as streamed reductions (``streaming.py``): the
accumulator is the ``uint32[D]`` modular sum of the clients' encodings
(``fcir.mechanisms.ddgauss.encode``), chunk by chunk; the decoding runs once, at the end.

A client's encoding depends only on its own values and key, and uint32 adds are exact
modulo ``2**32`` in any order, so the streamed result is bit for bit the unstreamed
one (and the reference interpreter's)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fcir import fed as F
from fcir.mechanisms import ddgauss as ddp

__all__ = ["DDP_OPS", "acc_init", "acc_step", "finish"]

DDP_OPS = F.of_kind("ddp")


def _params(op, shapes_or_vals, n: int) -> ddp.DdpParams:
    dim = ddp.member_dim(shapes_or_vals[v].shape[1:] for v in op.operands[:-1])
    a = op.attrs
    return ddp.params(dim, n, a["clip_norm"], a["noise_multiplier"], a["bits"], op.name)


def acc_init(op, shapes, n: int) -> list:
    return [jnp.zeros((_params(op, shapes, n).padded_dim,), jnp.uint32)]


def acc_step(op, acc: list, vals: dict, valid, n: int) -> list:
    p = _params(op, vals, n)
    leaves = [vals[v] for v in op.operands[:-1]]
    shares = ddp.encode_batch(leaves, vals[op.operands[-1]], p)
    if valid is not None:
        shares = jnp.where(valid[:, None], shares, jnp.uint32(0))
    return [acc[0] + jnp.sum(shares, axis=0, dtype=jnp.uint32)]


def finish(op, acc: list, n: int) -> list:
    like = [
        jax.ShapeDtypeStruct(v.type.member.shape, v.type.member.np_dtype) for v in op.operands[:-1]
    ]
    p = ddp.params(
        ddp.member_dim(x.shape for x in like),
        n,
        op.attrs["clip_norm"],
        op.attrs["noise_multiplier"],
        op.attrs["bits"],
        op.name,
    )
    total = jnp.bitwise_and(acc[0], jnp.uint32(p.modulus - 1))
    return ddp.decode(total, p, like, op.name == "fed.ddp_mean")
