"""Federated ops written out as loops over members, for the oracles.

These deliberately avoid ``jnp.sum(x, axis=0)`` and friends: members are visited one
at a time in member order, which is the semantics the reference interpreter promises.
Oracles call them inside a jitted server step, so one compile covers the whole
aggregation instead of one per elementwise op and leaf shape.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def member(tree, i: int):
    """Member ``i`` of a placed pytree (every leaf sliced on its leading axis)."""
    return jax.tree.map(lambda x: x[i], tree)


def total(values: list):
    """Sum of a list of pytrees, accumulated in list order."""
    return functools.reduce(lambda a, b: jax.tree.map(jnp.add, a, b), values)


def mean(values: list):
    """Unweighted mean of a list of pytrees; integer and bool leaves give float32."""
    n = len(values)
    as_float = [jax.tree.map(_to_float, v) for v in values]
    return jax.tree.map(lambda s: s / n, total(as_float))


def weighted_mean(values: list, weights: list):
    """``sum_i w_i * x_i / sum_i w_i`` with one scalar weight per member."""
    num = total([jax.tree.map(lambda x, w=w: x * w, v) for v, w in zip(values, weights)])
    den = functools.reduce(jnp.add, weights)
    return jax.tree.map(lambda s: s / den, num)


def minimum(values: list):
    return functools.reduce(lambda a, b: jax.tree.map(jnp.minimum, a, b), values)


def maximum(values: list):
    return functools.reduce(lambda a, b: jax.tree.map(jnp.maximum, a, b), values)


def _to_float(x):
    x = jnp.asarray(x)
    if jnp.issubdtype(x.dtype, jnp.integer) or x.dtype == jnp.bool_:
        return x.astype(jnp.float32)
    return x
