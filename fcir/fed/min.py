"""``fed.min``: the elementwise minimum over the members.

Derivative: the subgradient JAX uses for ``jnp.min``/``jnp.max``
(``lax._reduce_chooser_jvp_rule``): the tangent of the arg-min member; on ties the
tangent is the *average* of the tied members' tangents (so the cotangent is split
equally among them). Federated form: a known ``fed_map`` computes the per-member
indicator ``x == broadcast(ans)``, ``count = fed.sum(indicator)``; the tangent is
``fed.sum(map(g * indicator)) / count``. Integer inputs: zero. ``fed.max``
(``fcir.fed.max``) shares the rule (``chooser_jvp``).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np

from fcir.opkit import autodiff as AD
from fcir.opkit import placement as api
from fcir.opkit import primitives as P

from .base import Reduction, public
from .broadcast import broadcast_like
from .map import member_map
from .sum import sum_p

__all__ = ["Min", "chooser_jvp", "min_p", "reduce_min"]


def _indicator_region(dtype):
    def indicator(x, ans):
        return [(x == ans).astype(dtype)]

    return indicator


def _masked_region():
    def masked(g, ind):
        return [g * ind]

    return masked


def chooser_jvp(prim, primals, tangents, *, placement, n):
    """The JVP of ``fed.min`` and ``fed.max`` (``prim``)."""
    (x,), (g,) = primals, tangents
    ans = prim.bind(x, placement=placement, n=n)
    dtype = AD.typeof(x).dtype
    if AD.is_zero(g) or not AD.inexact(dtype):
        return ans, AD.zero_tangent(ans)
    # Same subgradient as lax._reduce_chooser_jvp_rule (jnp.min/jnp.max): average the
    # tangents of the members attaining the extremum. Everything per member happens in
    # fed_map regions; the division by the tie count happens on the server.
    ans_at_members = broadcast_like(ans, x, placement, n)
    (ind,) = member_map(_indicator_region, (np.dtype(dtype),), placement, n, x, ans_at_members)
    count = sum_p.bind(ind, placement=placement, n=n)
    (picked,) = member_map(_masked_region, (), placement, n, g, ind)
    return ans, sum_p.bind(picked, placement=placement, n=n) / count


min_p = P.define_reduction("fed_min", lambda x, *, n: jnp.min(x, axis=0), weak_type=True)
AD.def_jvp(min_p, functools.partial(chooser_jvp, min_p))


class Min(Reduction):
    """Elementwise minimum over members: ``{T}@child -> T``."""

    name = "fed.min"
    primitive = min_p


@public
def reduce_min(x):
    """Elementwise minimum over members: ``{T}@child -> T@p``."""
    return api._reduce(min_p, "fcir.reduce_min", x)
