"""``fed.max``: the elementwise maximum over the members (its derivative is
``fed.min``'s subgradient rule, ``fcir.fed.min.chooser_jvp``)."""

from __future__ import annotations

import functools

import jax.numpy as jnp

from fcir.opkit import autodiff as AD
from fcir.opkit import placement as api
from fcir.opkit import primitives as P

from .base import Reduction, public
from .min import chooser_jvp

__all__ = ["Max", "max_p", "reduce_max"]

max_p = P.define_reduction("fed_max", lambda x, *, n: jnp.max(x, axis=0), weak_type=True)
AD.def_jvp(max_p, functools.partial(chooser_jvp, max_p))


class Max(Reduction):
    """Elementwise maximum over members: ``{T}@child -> T``."""

    name = "fed.max"
    primitive = max_p


@public
def reduce_max(x):
    """Elementwise maximum over members: ``{T}@child -> T@p``."""
    return api._reduce(max_p, "fcir.reduce_max", x)
