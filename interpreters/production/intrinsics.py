"""The TFF intrinsics a production round is written with: the one table of their names,
what each means, and how each aggregate lowers to ``federated_aggregate``.

A production bundle's Computation calls these by name (``Intrinsic.name``, TFF's URI);
production's split picks the intrinsic of each fed op (``splitting.OP_RULES``), the
Computation is built from this table (``computation.py``), and a Flower ServerApp
computes each aggregate with ``server`` over its nodes' replies. Notation: ``T@S`` a
value at the server, ``{T}@C`` one per client, ``<A -> B>`` a function.

Self-contained (numpy at import, jax.numpy inside the functions): an exported Flower
app copies this file beside its runtime, as it copies ``iree_runtime.py``: an app
imports nothing of fcir itself.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

__all__ = ["AGGREGATE", "INTRINSICS", "Intrinsic", "Lowering", "aggregates"]


@dataclasses.dataclass(frozen=True)
class Lowering:
    """An aggregate as ``federated_aggregate``: its accumulator over a client value of
    shape ``shape`` and dtype ``dtype`` (for a weighted mean, its weight is a scalar of
    that dtype), in jax.numpy on the accumulator's leaves.

    ``state``: the accumulator's leaves by name (a dict), or one unnamed leaf
    (``(None,)``); ``state_types`` their (shape, numpy dtype)s; ``inputs`` and
    ``input_types``: a client's value, as named leaves (``("value", "weight")``) or one
    unnamed leaf;
    ``zero() -> U``, ``accumulate(*U, *T) -> U``, ``merge(*U, *U) -> U``,
    ``report(*U) -> (result,)``, each over leaves."""

    state: tuple
    state_types: list
    inputs: tuple
    input_types: list
    zero: Callable
    accumulate: Callable
    merge: Callable
    report: Callable


@dataclasses.dataclass(frozen=True)
class Intrinsic:
    """One intrinsic: its name (TFF's URI), what it means, and, for an aggregate,
    ``server(x, w, *, bitwidth, attrs)``, the result over the clients' values ``x`` (and
    weights ``w``) stacked on axis 0, and ``lowering`` where
    ``aggregate_with="federated_aggregate"`` lowers it."""

    name: str
    meaning: str
    server: Callable | None = None
    lowering: Callable | None = None  # (shape, dtype) -> Lowering


def _mean_dtype(dtype) -> np.dtype:
    import jax.numpy as jnp

    dtype = np.dtype(dtype)
    return dtype if jnp.issubdtype(dtype, jnp.inexact) else np.dtype(np.float32)


# --- the aggregates over the clients' values stacked on axis 0 ------------------------
#
# The same jnp calls as fcir's primitives (fcir/opkit/primitives.py), over a leading axis
# of the replies a server has: with every client replying, the result is bit for bit the
# bundle's aggregation part (a Flower ServerApp takes what the nodes that replied sent).


def _sum(x, w, *, bitwidth, attrs):
    import jax.numpy as jnp

    dt = np.dtype(np.int32) if x.dtype == np.bool_ else x.dtype
    return jnp.sum(x, axis=0, dtype=dt)


def _mean(x, w, *, bitwidth, attrs):
    import jax.numpy as jnp

    dt = _mean_dtype(x.dtype)
    return jnp.mean(x.astype(dt) if x.dtype != dt else x, axis=0)


def _weighted_mean(x, w, *, bitwidth, attrs):
    import jax.numpy as jnp

    dt = _mean_dtype(x.dtype)
    x = x.astype(dt)
    w = w.astype(dt).reshape(w.shape + (1,) * (x.ndim - w.ndim))
    return jnp.sum(x * w, axis=0) / jnp.sum(w, axis=0)


def _min(x, w, *, bitwidth, attrs):
    import jax.numpy as jnp

    return jnp.min(x, axis=0)


def _max(x, w, *, bitwidth, attrs):
    import jax.numpy as jnp

    return jnp.max(x, axis=0)


def _secure_sum_bitwidth(x, w, *, bitwidth, attrs):
    import jax.numpy as jnp

    total = jnp.sum(x, axis=0, dtype=x.dtype)
    if bitwidth < np.dtype(x.dtype).itemsize * 8:
        total = jnp.bitwise_and(total, jnp.asarray((1 << bitwidth) - 1, x.dtype))
    return total


# --- their federated_aggregate lowerings -----------------------------------------------


def _sum_lowering(shape, dtype) -> Lowering:
    import jax.numpy as jnp

    return Lowering(
        state=(None,),
        state_types=[(shape, dtype)],
        inputs=(None,),
        input_types=[(shape, dtype)],
        zero=lambda: (jnp.zeros(shape, dtype),),
        accumulate=lambda u, t: (u + t,),
        merge=lambda a, b: (a + b,),
        report=lambda u: (u,),
    )


def _mean_lowering(shape, dtype) -> Lowering:
    import jax.numpy as jnp

    return Lowering(
        state=("count", "total"),
        state_types=[((), np.dtype(np.float32)), (shape, dtype)],
        inputs=(None,),
        input_types=[(shape, dtype)],
        zero=lambda: (jnp.zeros((), jnp.float32), jnp.zeros(shape, dtype)),
        accumulate=lambda n, s, t: (n + 1.0, s + t),
        merge=lambda n1, s1, n2, s2: (n1 + n2, s1 + s2),
        report=lambda n, s: ((s / n.astype(dtype)).astype(dtype),),
    )


def _weighted_mean_lowering(shape, dtype) -> Lowering:
    import jax.numpy as jnp

    return Lowering(
        state=("total", "weight"),
        state_types=[(shape, dtype), ((), dtype)],
        inputs=("value", "weight"),
        input_types=[(shape, dtype), ((), dtype)],
        zero=lambda: (jnp.zeros(shape, dtype), jnp.zeros((), dtype)),
        accumulate=lambda s, w, x, wx: (s + x * wx, w + wx),
        merge=lambda s1, w1, s2, w2: (s1 + s2, w1 + w2),
        report=lambda s, w: ((s / w).astype(dtype),),
    )


# --- the table ------------------------------------------------------------------------

# The names the other modules use, each spelled here only.
BROADCAST, MAP, APPLY = "federated_broadcast", "federated_map", "federated_apply"
VALUE_AT_SERVER, VALUE_AT_CLIENTS = "federated_value_at_server", "federated_value_at_clients"
ZIP_AT_SERVER, ZIP_AT_CLIENTS = "federated_zip_at_server", "federated_zip_at_clients"
SUM, MEAN, WEIGHTED_MEAN = "federated_sum", "federated_mean", "federated_weighted_mean"
MIN, MAX, SECURE_SUM = "federated_min", "federated_max", "federated_secure_sum_bitwidth"
AGGREGATE = "federated_aggregate"

_TABLE = (
    Intrinsic(BROADCAST, "T@S -> T@C, every client the same value"),
    Intrinsic(MAP, "(<T -> U>, {T}@C) -> {U}@C, the function at each client"),
    Intrinsic(APPLY, "(<T -> U>, T@S) -> U@S, the function at the server"),
    Intrinsic(VALUE_AT_SERVER, "T -> T@S, a value placed at the server"),
    Intrinsic(VALUE_AT_CLIENTS, "T -> T@C, a value placed at every client"),
    Intrinsic(ZIP_AT_SERVER, "<A@S, B@S, ...> -> <A, B, ...>@S"),
    Intrinsic(ZIP_AT_CLIENTS, "<{A}@C, {B}@C, ...> -> {<A, B, ...>}@C"),
    Intrinsic(SUM, "{T}@C -> T@S, the sum", _sum, _sum_lowering),
    Intrinsic(MEAN, "{T}@C -> T@S, the mean", _mean, _mean_lowering),
    Intrinsic(
        WEIGHTED_MEAN,
        "(<{T}@C, {W}@C>) -> T@S, the mean weighted by W (a scalar per client, or a "
        "prefix of T's shape)",
        _weighted_mean,
        _weighted_mean_lowering,
    ),
    Intrinsic(MIN, "{T}@C -> T@S, the elementwise minimum", _min),
    Intrinsic(MAX, "{T}@C -> T@S, the elementwise maximum", _max),
    Intrinsic(
        SECURE_SUM,
        "(<{T}@C, bitwidth>) -> T@S, the sum by secure aggregation of values in [0, 2**bitwidth)",
        _secure_sum_bitwidth,
    ),
    Intrinsic(
        AGGREGATE,
        "({T}@C, zero: U, <U, T -> U>, <U, U -> U>, <U -> R>) -> R@S, any aggregate by "
        "its accumulator: an op with no intrinsic of its own, or one lowered",
    ),
)
INTRINSICS: dict[str, Intrinsic] = {i.name: i for i in _TABLE}


def aggregates() -> dict[str, Callable]:
    """Each aggregate intrinsic's ``server``: what a server holding every client's
    value computes for it."""
    return {n: i.server for n, i in INTRINSICS.items() if i.server is not None}
