"""Type soundness of local ops: what ``fcir.check`` adds so that a module that checks is true.

A ``jax.*`` op's result types are not taken on trust. The checker rebuilds the op's
primitive and params from its attributes, as the interpreters bind them
(``fcir.base_interpreter``), and re-derives the result types by the primitive's abstract
evaluation on the operands' run-time types: shapes and dtypes only, no FLOPs, no
tracing of regions. A region an attribute refers to (``cond`` branches, a ``scan``
body, a ``jit`` callee) stands in as a jaxpr with the region's parameter and result
types and no equations, so nested regions are evaluated once each, where they sit,
and checking stays linear in the number of ops.

Values placed at a placement have run-time arrays with a leading member axis, which is
what the interpreters bind: for a placed elementwise op (``local/C2``) comparing the
run-time types compares the member types, the placement itself being ``local/C2``'s.

Results are cached per signature (op name, attributes, operand and region types), so a
program of 1e5 ops with few distinct signatures costs 1e5 dictionary look-ups.

Constraints (quoted in errors as ``local/C4: ...``; negative tests in
tests/checker/test_local_ops.py):

* ``local/C4``: an op's result types are those its primitive's abstract evaluation gives
  for its operand types and attributes (for ``fcir.constant``: its value's type).
* ``local/C5``: the attributes decode to the primitive's params and the primitive accepts
  the operand types (its abstract evaluation does not raise).
* ``local/C6``: a call-like op (``jit``, ``closed_call``, ``custom_jvp_call``,
  ``custom_vjp_call``, ``remat``) has one region, whose parameters have the operands'
  types.
* ``value/C1``: a value's run-time array (the cardinalities of its placements times its
  member shape, times the dtype's bytes) is smaller than ``2**62`` bytes: XLA's shape
  arithmetic is int64, and beyond that it aborts the process instead of raising.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from fcir import jaxcompat as jc
from fcir.base_interpreter import jax_primitive
from fcir.errors import FcirError
from fcir.ir import attrs as A
from fcir.ir.nodes import Op, Region
from fcir.ir.text import format_attr
from fcir.ir.types import SERVER, PlacedType, TensorType, Type, dtype_from_name, dtype_name
from fcir.jaxcompat import (
    AccuracyMode,
    DotAlgorithm,
    DotAlgorithmPreset,
    Precision,
    Tolerance,
    core,
    named_sharding,
    schema,
)

# Collectives over a named axis: inside a fed.map over a placement they would be
# client-to-client communication.
COLLECTIVES = frozenset(
    "psum pmax pmin pmean ppermute pbroadcast all_gather all_to_all axis_index psum_scatter "
    "reduce_scatter psum_invariant pvary".split()
)

CONSTRAINTS = {
    "local/C4": "result types must be those the primitive's abstract evaluation gives for the "
    "operand types and attributes",
    "local/C5": "attributes must decode to the primitive's params, and the primitive must "
    "accept the operand types",
    "local/C6": "a call-like op's region parameters must have its operands' types",
    "value/C1": "a value's run-time array must be smaller than 2**62 bytes",
}

MAX_BYTES = 1 << 62

# Layout ops change where a value lives, never its type; their params name a mesh that
# only exists where the program runs (the reference interpreter ignores them), so
# their rule is checked here directly: each result has its operand's type.
LAYOUT = _LAYOUT = frozenset({"sharding_constraint", "reshard", "mesh_cast"})

# Call-like primitives: one region, called with the op's operands. (Control flow,
# whose regions take a part of the operands, is typed by fcir.check itself.)
_CALLS = frozenset(
    "jit pjit closed_call core_call custom_jvp_call custom_vjp_call remat2 checkpoint".split()
)

# Signature -> ("ok", result types) or ("err", code, message). Process-wide, like JAX's
# own tracing caches; bounded so that a long-lived process does not grow without end.
_CACHE: dict[tuple, tuple] = {}
_CACHE_LIMIT = 1 << 16


def clear_cache() -> None:
    _CACHE.clear()


def _typed(v):
    """``v`` with every scalar tagged by its type, for the cache key: ``True == 1 ==
    1.0`` in Python, but ``weak_type=1`` is an error where ``weak_type=True`` is not."""
    t = type(v)  # exact types first: the attributes of most ops are only these
    if t is tuple:
        return tuple([_typed(x) for x in v])
    if t is int or t is bool or t is float:
        return (t, v)
    if t is str or v is None:
        return v
    if isinstance(v, tuple):
        return tuple([_typed(x) for x in v])
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return (type(v), tuple([_typed(getattr(v, f.name)) for f in dataclasses.fields(v)]))
    if isinstance(v, (bool, int, float, complex, np.generic)):
        return (type(v), v)
    return v


class _Failure(Exception):
    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


class Types:
    """Run-time array types of IR types in one module, memoized by object: the checker
    asks about every value, and hashing a nested frozen type each time costs more than
    the look-up saves (the memo holds the types, so their ids stay theirs)."""

    def __init__(self, placements):
        self.sizes = dict(placements)
        self.memo: dict[int, tuple] = {}

    def runtime(self, t: Type):
        """(dtype, shape) of a value of type ``t`` at run time, or None when ``t`` names an
        undeclared placement (module/C4 reports that)."""
        entry = self.memo.get(id(t))
        if entry is None or entry[0] is not t:
            entry = self.memo[id(t)] = (t, self._runtime(t), _UNSET)
        return entry[1]

    def _runtime(self, t: Type):
        if isinstance(t, TensorType):
            return (t.dtype, t.shape)
        if isinstance(t, PlacedType):
            inner = self.runtime(t.member)
            if inner is not None:
                if t.placement == SERVER:
                    return inner
                if t.placement in self.sizes:
                    return (inner[0], (self.sizes[t.placement], *inner[1]))
        return None

    def size_problem(self, t: Type) -> str | None:
        """``value/C1`` message for a value of type ``t``, or None when it is fine."""
        rt = self.runtime(t)
        entry = self.memo[id(t)]
        if entry[2] is _UNSET:
            entry = self.memo[id(t)] = (t, rt, _size_problem(t, rt))
        return entry[2]


_UNSET = object()


def _size_problem(t: Type, rt) -> str | None:
    if rt is None:
        return None
    dtype, shape = rt
    elements = math.prod(shape)
    if elements == 0:
        return None
    try:
        dt = dtype_from_name(dtype)
    except FcirError:
        return None
    impl = getattr(dt, "_impl", None)
    # A PRNG key is its key data: key_shape uint32 words per key.
    itemsize = 4 * math.prod(impl.key_shape) if impl is not None else np.dtype(dt).itemsize
    if elements * itemsize < MAX_BYTES:
        return None
    return (
        f"value/C1: a value of type {t} is a run-time array {dtype}{list(shape)} of "
        f"{elements * itemsize} bytes, over the 2**62-byte limit of XLA's int64 shape "
        "arithmetic: lower the cardinality or the member shape"
    )


def result_types_problem(types: Types, op: Op) -> tuple[str, str] | None:
    """(code, message) when ``op``'s declared result types are not what its primitive
    derives, or its attributes or operands are rejected; None when they hold."""
    if op.name == "fcir.constant":
        return _constant_problem(types, op)
    runtime = types.runtime
    operand_types = tuple([runtime(v.type) for v in op.operands])
    if None in operand_types:
        return None  # an undeclared placement: module/C4
    region_sigs = ()
    if op.regions:
        region_sigs = tuple([_region_signature(types, r) for r in op.regions])
        if None in region_sigs:
            return None
    attrs = op.attrs
    key = (op.name, _typed(tuple(sorted(attrs.items()))) if attrs else (), operand_types,
           region_sigs)
    try:
        cached = _CACHE.get(key)
    except TypeError:  # an attribute that is not hashable (none is, when well formed)
        key, cached = None, None
    if cached is None:
        try:
            cached = ("ok", _derive(op, operand_types, region_sigs))
        except _Failure as e:
            cached = ("err", e.code, str(e))
        if key is not None:
            if len(_CACHE) >= _CACHE_LIMIT:
                _CACHE.clear()
            _CACHE[key] = cached
    if cached[0] == "err":
        return cached[1], cached[2]
    derived = cached[1]
    if derived is None:
        return None
    declared = [runtime(v.type) for v in op.results]
    if declared == derived:
        return None
    if None in declared:
        return None
    if len(derived) != len(declared):
        return "local/C4", (
            f"local/C4: {op.name} declares {len(declared)} results, but the primitive gives "
            f"{len(derived)} ({', '.join(_fmt(d) for d in derived)})"
        )
    for i, (v, want, got) in enumerate(zip(op.results, derived, declared)):
        if want != got:
            return "local/C4", (
                f"local/C4: result {i} has type {v.type} (a run-time {_fmt(got)}), but the "
                f"primitive gives {_fmt(want)} for operands "
                f"({', '.join(str(o.type) for o in op.operands)}) and these attributes"
            )
    return None


def _fmt(rt) -> str:
    return f"{rt[0]}[{','.join(str(d) for d in rt[1])}]"


def _region_signature(types: Types, r: Region):
    params = tuple(types.runtime(v.type) for v in r.params)
    results = tuple(types.runtime(v.type) for v in r.results)
    if None in params or None in results:
        return None
    return params, results


def _constant_problem(types: Types, op: Op):
    value = op.attrs.get("value")
    if op.operands or len(op.results) != 1 or not isinstance(value, A.Tensor):
        return "local/C5", (
            "local/C5: fcir.constant takes no operands, gives one result and has a tensor "
            "attribute 'value'"
        )
    declared = types.runtime(op.results[0].type)
    if declared is not None and declared != (value.dtype, value.shape):
        return "local/C4", (
            f"local/C4: result has type {op.results[0].type}, but the constant's value is "
            f"{TensorType(value.dtype, value.shape)}"
        )
    return None


_AVALS: dict[tuple, core.ShapedArray] = {}
_DTYPE_NAMES: dict[Any, str] = {}


def _aval(rt) -> core.ShapedArray:
    aval = _AVALS.get(rt)
    if aval is None:
        if len(_AVALS) >= _CACHE_LIMIT:
            _AVALS.clear()
        aval = _AVALS[rt] = core.ShapedArray(rt[1], dtype_from_name(rt[0]))
    return aval


def _dtype_name(dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:

        name = _DTYPE_NAMES[dtype] = dtype_name(dtype)
    return name


def _stub(sig, closed: bool):
    """A jaxpr with the region's types and no equations: what abstract evaluation of a
    control-flow or call primitive reads (in_avals, out_avals, effects)."""
    lu = jc.lu
    params, results = sig
    jaxpr = core.Jaxpr([], [core.Var(_aval(p)) for p in params],
                       [core.Var(_aval(r)) for r in results], [],
                       debug_info=lu.DebugInfo("fcir.check", "<region>", None, None))
    return jc.closed_jaxpr(jaxpr, []) if closed else jaxpr


def _derive(op: Op, operand_types, region_sigs) -> list | None:
    """The result types the primitive gives: a list of (dtype, shape), or None where
    they cannot be derived from the op alone."""
    name = op.name.removeprefix("jax.")
    try:
        prim = jax_primitive(name)
    except FcirError as e:
        raise _Failure("local/C5", f"local/C5: {e}") from None

    def region(ref: A.RegionRef):
        if not isinstance(ref.index, int) or not 0 <= ref.index < len(region_sigs):
            raise _Failure(
                "local/C5", f"local/C5: attribute names region ^{ref.index}, but {op.name} "
                f"has {len(region_sigs)} regions"
            )
        return _stub(region_sigs[ref.index], ref.closed)

    try:
        params = {k: A.decode(v, region) for k, v in op.attrs.items()}
    except _Failure:
        raise
    except Exception as e:  # an attribute that names no JAX value: say which op
        raise _Failure("local/C5", f"local/C5: attributes do not decode: {_what(e)}") from None
    for key, value in params.items():
        check = _PARAM_CHECKS.get(key)
        if check is not None and not check[0](value, len(op.operands), len(op.results)):
            raise _Failure(
                "local/C5", f"local/C5: jax.{name} attribute {key} must be {check[1]}, got "
                f"{_short(op.attrs[key])}"
            )
    try:
        params = schema.to_jax(name, params)
    except Exception as e:
        raise _Failure("local/C5", f"local/C5: jax.{name} attributes: {_what(e)}") from None
    if name in _LAYOUT:
        return list(operand_types)
    if name in COLLECTIVES or name == "shard_map":
        # A collective's type depends on the sizes of the named axes it reduces over,
        # which only the enclosing shard_map's mesh binds (over a placement axis it is
        # local/C3 already), and shard_map's region is typed per shard (manual axes,
        # varying values): neither is derived from the op alone.
        return None
    if name in _CALLS and (len(region_sigs) != 1 or region_sigs[0][0] != operand_types):
        takes = ", ".join(_fmt(t) for t in region_sigs[0][0]) if region_sigs else "no region"
        raise _Failure(
            "local/C6", f"local/C6: a call's region parameters must have its operands' "
            f"types: operands ({', '.join(_fmt(t) for t in operand_types)}), region takes "
            f"({takes})"
        )
    avals = [_aval(t) for t in operand_types]
    try:
        rule = core.custom_typechecks.get(prim)
        if type(prim).abstract_eval is core.Primitive.abstract_eval and (
            "abstract_eval" not in vars(prim)
        ):
            if rule is None:
                raise _Failure("local/C5", f"local/C5: jax.{name} has no abstract evaluation")
            # Typecheck rules take atoms (they read .aval), not avals.
            out, _ = rule(None, *[core.Var(a) for a in avals], **params)
        else:
            out, _ = prim.abstract_eval(*avals, **params)
    except _Failure:
        raise
    except Exception as e:  # the primitive's own shape/dtype rule rejected the op
        raise _Failure(
            "local/C5", f"local/C5: jax.{name} rejects operands "
            f"({', '.join(_fmt(t) for t in operand_types)}) with these attributes: {_what(e)}"
        ) from None
    outs = out if prim.multiple_results else [out]
    result: list[Any] = []
    for a in outs:
        try:
            result.append((_dtype_name(a.dtype), tuple(int(d) for d in a.shape)))
        except Exception as e:
            raise _Failure("local/C5", f"local/C5: jax.{name} gives {a}: {_what(e)}") from None
    return result


def _short(attr) -> str:

    try:
        text = format_attr(attr)
    except Exception:
        text = repr(attr)
    return text if len(text) <= 80 else text[:77] + "..."


def _is_precision(v, ops, res) -> bool:

    if v is None or isinstance(v, (DotAlgorithm, DotAlgorithmPreset)):
        return True
    return isinstance(v, tuple) and len(v) == 2 and all(isinstance(p, Precision) for p in v)


def _is_accuracy(v, ops, res) -> bool:

    return v is None or isinstance(v, (AccuracyMode, Tolerance))


def _is_sharding(v) -> bool:
    import jax

    return isinstance(
        v, (jax.sharding.NamedSharding, jax.sharding.PartitionSpec,
            named_sharding.UnspecifiedValue)
    )


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _ints(v) -> bool:
    return isinstance(v, tuple) and all(_is_int(d) for d in v)


def _per(count, item):
    """A tuple with one ``item`` per operand (count "ops") or result ("res")."""

    def check(v, ops, res) -> bool:
        n = ops if count == "ops" else res
        return isinstance(v, tuple) and len(v) == n and all(item(x) for x in v)

    return check


def _is_mesh(v, ops, res) -> bool:
    import jax

    return isinstance(v, (jax.sharding.Mesh, jax.sharding.AbstractMesh))


def _is_options(v, ops, res) -> bool:
    return isinstance(v, tuple) and all(
        isinstance(kv, tuple) and len(kv) == 2 and isinstance(kv[0], str) for kv in v
    )


_BOOL = (lambda v, ops, res: isinstance(v, bool), "true or false")
_INT = (lambda v, ops, res: _is_int(v), "an integer")
_INTS = (lambda v, ops, res: _ints(v), "a list of integers")
_INTS_OR_NONE = (lambda v, ops, res: v is None or _ints(v), "none or a list of integers")
_SHARDING_OR_NONE = (lambda v, ops, res: v is None or _is_sharding(v), "none or a sharding")

# What a captured jaxpr holds in each param, by name (the same across primitives). A
# shape rule reads some of these, but many params are read only by lowering, which
# then fails far from the op, or aborts the process: dot_general's precision=3 is an
# LLVM error, convert_element_type's weak_type=3 a C++ bad_cast.
_PARAM_CHECKS = {
    "precision": (_is_precision, "none, a pair of #Precision members or a dot algorithm"),
    "preferred_element_type": (
        lambda v, ops, res: v is None or isinstance(v, np.dtype), "none or a dtype"),
    "accuracy": (_is_accuracy, "none, a #AccuracyMode or a #Tolerance"),
    "out_sharding": _SHARDING_OR_NONE,
    "sharding": _SHARDING_OR_NONE,
    **dict.fromkeys(
        ("weak_type", "keep_unused", "inline", "reverse", "indices_are_sorted",
         "unique_indices", "symbolic_zeros", "prevent_cse", "differentiated", "is_stable"),
        _BOOL),
    **dict.fromkeys(
        ("num_carry", "num_consts", "length", "axis", "dimension", "bit_width",
         "cond_nconsts", "body_nconsts"), _INT),
    "unroll": (lambda v, ops, res: isinstance(v, (bool, int)), "an integer or a bool"),
    "axes": (lambda v, ops, res: isinstance(v, tuple) and all(
        _is_int(a) or isinstance(a, str) for a in v), "a list of axes (integers or names)"),
    **dict.fromkeys(
        ("broadcast_dimensions", "shape", "new_sizes", "permutation",
         "limit_indices", "start_indices", "slice_sizes", "sizes"), _INTS),
    **dict.fromkeys(("strides", "dimensions"), _INTS_OR_NONE),
    "linear": (lambda v, ops, res: isinstance(v, tuple) and all(
        isinstance(x, bool) for x in v), "a list of bools"),
    "name": (lambda v, ops, res: isinstance(v, str), "a string"),
    "donated_invars": (_per("ops", lambda x: isinstance(x, bool)),
                       "a list of one bool per operand"),
    "in_shardings": (_per("ops", _is_sharding), "a list of one sharding per operand"),
    "out_shardings": (_per("res", _is_sharding), "a list of one sharding per result"),
    "in_layouts": (_per("ops", lambda x: x is None), "a list of one none per operand"),
    "out_layouts": (_per("res", lambda x: x is None), "a list of one none per result"),
    "ctx_mesh": (_is_mesh, "a mesh"),
    "compiler_options_kvs": (_is_options, "a list of [name, value] pairs"),
}


def _what(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]
