"""fcir's local-op attribute schema, independent of the running JAX.

A ``jax.<name>`` op in the IR carries fcir's attribute set: the parameters JAX 0.10.2
gave the primitive ``<name>``, which is what every IR written so far holds. Capture
translates the running JAX's parameters into that set (:func:`to_fcir`) and the
checker and backends translate it back (:func:`to_jax`). docs/ops.md tabulates the
schema (tools/gen_ops_doc.py writes it from :data:`SCHEMA` and this module's tables).

Differences handled here:

- ``scan``: JAX 0.12 describes the operand groups with FlatTrees ``ft_in`` (consts,
  carry, xs) and ``ft_out`` (carry, ys); fcir keeps the counts ``num_consts`` and
  ``num_carry``.
- ``jit``: JAX 0.12's ``inline`` is an ``Inline`` enum; fcir keeps a bool (``true``:
  inlined into the caller, JAX's ``JAX_EARLY``/``JAX_LATE``; ``false``: anything else).
  A 0.12 ``jit`` with ``Inline.JAX_LATE`` and no shardings is what ``jit(inline=True)``
  traces to; JAX 0.10 inlined those while tracing, so capture inlines them
  (:func:`inlined_while_tracing`), which keeps the IR the same on both.
- Region parameters: JAX 0.12 has no ClosedJaxpr type, so whether a region attribute
  is closed (carries constants) comes from :data:`OPEN_REGIONS`, JAX 0.10's split.
"""

from __future__ import annotations

import functools
from typing import Any

from fcir import jaxcompat as _jc
from fcir.jaxcompat import named_sharding

# (primitive, param) pairs that hold an open jaxpr (no constants) in fcir's schema; every
# other jaxpr-valued param is closed. "*" matches any primitive.
OPEN_REGIONS = frozenset(
    {("*", "update_jaxpr"), ("remat2", "jaxpr"), ("checkpoint", "jaxpr"), ("shard_map", "jaxpr")}
)

# Attributes whose form fcir fixes (the rest are JAX's params, the same across supported
# versions): primitive -> {attribute: description}.
SCHEMA: dict[str, dict[str, str]] = {
    "scan": {
        "num_consts": "int: leading operands passed to every iteration unchanged",
        "num_carry": "int: operands after the consts that form the loop carry",
        "length": "int: number of iterations",
        "reverse": "bool: iterate from the end",
        "unroll": "int or bool: XLA unroll factor",
        "jaxpr": "closed region (consts, carry, x slices) -> (carry, y slices)",
        "_split_transpose": "bool, optional: JAX's split-transpose flag",
    },
    "jit": {
        "inline": "bool: the call is inlined into its caller when lowered",
        "jaxpr": "closed region: the called function",
    },
}


# Params a newer JAX added to a primitive, with the value that means what the older JAX
# did without them: fcir's schema leaves them out when they hold that value, and gives
# them back to a JAX whose primitive takes them. (prim, param) -> (default, probe), where
# ``probe()`` traces a small jaxpr holding ``prim`` to learn whether the running JAX has
# it (once per probe: the params of one primitive answer for each of its added params).
def _probe_eqn(prim: str, fn, *example):
    """The params of the first ``prim`` eqn in ``fn``'s jaxpr at ``example()``."""

    @functools.cache
    def probe():
        import jax

        jaxpr = jax.make_jaxpr(fn)(*(e() for e in example))
        return next(e.params for e in jaxpr.eqns if e.primitive.name == prim)

    return probe


def _reduce(name: str):
    def reduce(x):
        import jax

        return getattr(jax.lax, name)(x, (0,))

    return reduce


def _bits(key):
    import jax

    return jax.random.bits(key, (2,))


def _key():
    import jax

    return jax.random.key(0)


def _take(x):
    import jax.numpy as jnp

    return x[jnp.asarray([1, 0])]


def _scatter(method: str):
    def update(x):
        import jax.numpy as jnp

        return getattr(x.at[jnp.asarray([1, 0])], method)(x[:1])

    return update


def _floats():
    import numpy as np

    return np.zeros((2, 3), np.float32)


_RANDOM_BITS = _probe_eqn("random_bits", _bits, _key)
ADDED_PARAMS: dict[tuple[str, str], tuple[Any, Any]] = {
    **{
        (prim, "out_sharding"): (None, _probe_eqn(prim, _reduce(prim), _floats))
        for prim in ("reduce_min", "reduce_max")
    },
    # JAX 0.12.1: random_bits can draw several streams at once, and says where its
    # result lives; one stream, placed as JAX decides, is what older JAX drew.
    ("random_bits", "num_streams"): (1, _RANDOM_BITS),
    ("random_bits", "out_sharding"): (None, _RANDOM_BITS),
    # JAX 0.12.1: gather and the scatters say where their result lives.
    ("gather", "out_sharding"): (None, _probe_eqn("gather", _take, _floats)),
    **{
        (prim, "out_sharding"): (None, _probe_eqn(prim, _scatter(method), _floats))
        for prim, method in (
            ("scatter", "set"),
            ("scatter-add", "add"),
            ("scatter-mul", "multiply"),
            ("scatter-min", "min"),
            ("scatter-max", "max"),
        )
    },
}
_HAS_PARAM: dict[tuple[str, str], bool] = {}


def _running_jax_has(prim: str, key: str) -> bool:
    known = _HAS_PARAM.get((prim, key))
    if known is None:
        known = _HAS_PARAM[(prim, key)] = key in ADDED_PARAMS[(prim, key)][1]()
    return known


_INLINE = getattr(__import__("jax._src.api", fromlist=["Inline"]), "Inline", None)


def region_is_closed(prim: str, key: str) -> bool:
    """Whether the jaxpr param ``key`` of ``prim`` is a closed region in fcir's schema."""
    return (prim, key) not in OPEN_REGIONS and ("*", key) not in OPEN_REGIONS


def region_kind(value, prim: str, key: str) -> bool | None:
    """For a jaxpr-valued param ``key`` of ``prim``: whether fcir's schema makes it a
    closed region (True) or an open one (False); None when ``value`` is no jaxpr."""
    if _jc._MERGED:
        if not isinstance(value, _jc.core.Jaxpr):
            return None
        closed = region_is_closed(prim, key)
        if not closed and value.consts:
            raise ValueError(f"param {key} of {prim} is an open jaxpr but carries constants")
        return closed
    if isinstance(value, _jc.core.ClosedJaxpr):
        return True
    if isinstance(value, _jc.core.Jaxpr):
        return False
    return None


def scan_counts(params: dict) -> tuple[int, int]:
    """``(num_consts, num_carry)`` of a scan eqn's params, in either JAX's form."""
    if "num_consts" in params:
        return int(params["num_consts"]), int(params["num_carry"])
    consts, carry, _ = params["ft_in"].unpack()
    return len(consts), len(carry)


def inlined_while_tracing(prim: str, params: dict) -> bool:
    """Whether JAX 0.10 would have inlined this call while tracing (``jit(inline=True)``
    without shardings or layouts), so that capture inlines it too."""
    if prim != "jit" or _INLINE is None or params.get("inline") is not _INLINE.JAX_LATE:
        return False
    unspecified = named_sharding.UnspecifiedValue
    return (
        all(isinstance(s, unspecified) for s in params["in_shardings"])
        and all(isinstance(s, unspecified) for s in params["out_shardings"])
        and all(x is None for x in params["in_layouts"])
        and all(x is None for x in params["out_layouts"])
    )


def _is_default(value, default) -> bool:
    """Whether a param holds its added default (None by identity; an int by value)."""
    if default is None:
        return value is None
    return type(value) is type(default) and value == default


def to_fcir(prim: str, params: dict[str, Any]) -> dict[str, Any]:
    """The running JAX's params of ``prim`` as fcir's attribute values (still Python)."""
    for (p, key), (default, _) in ADDED_PARAMS.items():
        if p == prim and key in params and _is_default(params[key], default):
            params = {k: v for k, v in params.items() if k != key}
    if prim == "scan" and "ft_in" in params:
        nc, nk = scan_counts(params)
        out = {k: v for k, v in params.items() if k not in ("ft_in", "ft_out")}
        return {**out, "num_consts": nc, "num_carry": nk}
    if prim == "jit" and _INLINE is not None and isinstance(params.get("inline"), _INLINE):
        inline = params["inline"] in (_INLINE.JAX_EARLY, _INLINE.JAX_LATE)
        return {**params, "inline": inline}
    return params


def to_jax(prim: str, params: dict[str, Any]) -> dict[str, Any]:
    """fcir's attribute values of ``prim`` (decoded) as the running JAX's params."""
    for (p, key), (default, _) in ADDED_PARAMS.items():
        if p == prim and key not in params and _running_jax_has(prim, key):
            params = {**params, key: default}
    if prim == "scan" and _jc._MERGED and "num_consts" in params:
        from jax._src import flattree as ft

        nc, nk = int(params["num_consts"]), int(params["num_carry"])
        jaxpr = params["jaxpr"]
        nx = len(jaxpr.in_avals) - nc - nk
        ny = len(jaxpr.out_avals) - nk
        if nx < 0 or ny < 0:
            raise ValueError(
                f"num_consts={nc}, num_carry={nk} do not fit a body with "
                f"{len(jaxpr.in_avals)} parameters and {len(jaxpr.out_avals)} results"
            )
        out = {k: v for k, v in params.items() if k not in ("num_consts", "num_carry")}
        out["ft_in"] = ft.pack((ft.nones(nc), ft.nones(nk), ft.nones(nx)))
        out["ft_out"] = ft.pack((ft.nones(nk), ft.nones(ny)))
        return out
    if prim == "jit" and _INLINE is not None and isinstance(params.get("inline"), bool):
        inline = _INLINE.JAX_LATE if params["inline"] else _INLINE.AUTO
        return {**params, "inline": inline}
    return params
