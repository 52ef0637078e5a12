"""Capture: trace a JAX function and convert its jaxpr into a placement-typed Module.

Types are inferred region by region. A region runs at a *level*: -1 is the server (the
top of the program), ``i`` is inside a ``fed.map`` over the members of placement ``i``.
Unplaced values at the server are typed ``T@server``; inside a map region they are
plain ``T``. Region parameters take the type their uses require (an operand of a
nested ``fed.map`` or of a reduction is placed), propagated backwards through
elementwise ops; results then follow forwards from the op type rules.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from jax._src import core, source_info_util

from fcir import attrs as A
from fcir import captured, pytrees
from fcir import primitives as P
from fcir.errors import FcirError, PlacementError, UnsupportedError
from fcir.ir import Func, Module, Op, Region, Value
from fcir.types import SERVER, PlacedType, TensorType, Type, structure_of, tensor_of

# Primitives applied elementwise: on values placed at one placement they stay
# per-member computations, so capture keeps the placement instead of flagging them.
ELEMENTWISE = frozenset(
    """abs acos acosh add and asin asinh atan atan2 atanh cbrt ceil clamp complex conj copy
    convert_element_type cos cosh digamma div eq erf erf_inv erfc exp exp2 expm1 floor ge gt
    imag integer_pow is_finite le lgamma log log1p logistic lt max min mul ne neg nextafter
    not or population_count pow real reduce_precision rem round rsqrt select_n shift_left
    shift_right_arithmetic shift_right_logical sign sin sinh sqrt square sub tan tanh xor
    sharding_constraint reshard mesh_cast add_any
    """.split()
)
# (sharding_constraint, reshard and mesh_cast only change a value's layout: under a mesh
# the frontend adds them to placed values, which stay placed. add_any is how JAX's
# backward pass sums the cotangents of a placed value used twice.)

# Call-like primitives that are inlined when their body contains federated ops, so that
# placements never hide inside a local call.
_INLINE_IF_FEDERATED = {
    "jit": "jaxpr",
    "pjit": "jaxpr",
    "closed_call": "call_jaxpr",
    "core_call": "call_jaxpr",
    "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr",
    "remat2": "jaxpr",
    "checkpoint": "jaxpr",
}

FED_OP_NAMES = {
    "fed_broadcast": "fed.broadcast",
    "fed_map": "fed.map",
    "fed_sum": "fed.sum",
    "fed_mean": "fed.mean",
    "fed_min": "fed.min",
    "fed_max": "fed.max",
    "fed_weighted_mean": "fed.weighted_mean",
    "fed_secure_sum": "fed.secure_sum",
    "fed_dp_sum": "fed.dp_sum",
    "fed_dp_mean": "fed.dp_mean",
}
# DP aggregates take the PRNG key, a value where the result lives, as their last operand.
_DP = frozenset({"fed_dp_sum", "fed_dp_mean"})


def capture(fn, *args, name: str | None = None, locations: bool = False, **kwargs) -> Module:
    """Traces ``fn(*args)`` and returns its checked, placement-typed Module.

    ``args`` are arrays or ``jax.ShapeDtypeStruct`` pytrees. Works on anything that
    traces to a jaxpr with fcir primitives, e.g. ``jax.grad(round_fn)``. Raises
    PlacementError for client-to-client communication (see ``fcir.check``).
    """
    from fcir.check import check

    return check(capture_unchecked(fn, *args, name=name, locations=locations, **kwargs))


def capture_unchecked(fn, *args, name: str | None = None, locations: bool = False,
                      **kwargs) -> Module:
    """Like :func:`capture` but returns the Module even when it does not check, so that
    ``fcir check`` can report every problem with its op."""
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args, **kwargs)
    _, in_tree = jax.tree_util.tree_flatten((args, kwargs) if kwargs else args)
    _, out_tree = jax.tree_util.tree_flatten(out_shape)
    return from_jaxpr(
        closed, in_tree, out_tree, name=name or _name_of(fn),
        placements=_placements(fn, closed.jaxpr), locations=locations,
        private=_private(fn),
    )


def from_jaxpr(closed: core.ClosedJaxpr, in_tree=None, out_tree=None, *, name="program",
               placements=None, locations: bool = False, private: bool = False) -> Module:
    """Converts an already traced jaxpr (unchecked). ``in_tree``/``out_tree`` are the
    PyTreeDefs of the flat arguments and results; placements default to those the
    jaxpr's federated ops use."""
    if placements is None:
        placements = _placements(None, closed.jaxpr)
    body = _Converter(placements, locations).convert_closed(closed, level=-1, label="main")
    main = Func("main", body, in_tree and structure_of(in_tree),
                out_tree and structure_of(out_tree))
    # In this process, results come back with the program's own pytree classes (optax
    # states, dataclasses); a deserialized module rebuilds them from the Structure.
    main.result_treedef = out_tree
    pytrees.remember(main.result_structure, out_tree)
    module = Module(name, placements, [main], private=private)
    # Backends that only need this very jaxpr back take it instead of tracing the IR.
    captured.remember(module, closed)
    return module


def _private(fn) -> bool:
    """True if ``fn`` (or what it wraps) is an ``fcir.program(private=True)``."""
    seen = fn
    for _ in range(16):
        flag = getattr(seen, "fcir_private", None)
        if flag is not None:
            return bool(flag)
        seen = getattr(seen, "__wrapped__", None) or getattr(seen, "func", None)
        if seen is None:
            break
    return False


def _name_of(fn) -> str:
    while isinstance(fn, functools.partial):
        fn = fn.func
    name = getattr(fn, "__name__", None) or type(fn).__name__
    return "".join(c if c.isalnum() or c == "_" else "_" for c in name) or "program"


def _placements(fn, jaxpr: core.Jaxpr) -> list[tuple[str, int]]:
    """Declared placements if ``fn`` (or what it wraps) is an fcir.program; else the
    placements the jaxpr's federated ops use, ordered by nesting depth."""
    seen = fn
    for _ in range(16):
        spec = getattr(seen, "fcir_placements", None)
        if spec is not None:
            return list(zip(spec.names, spec.sizes))
        seen = getattr(seen, "__wrapped__", None) or getattr(seen, "func", None)
        if seen is None:
            break
    found: dict[str, tuple[int, int]] = {}

    def visit(jx: core.Jaxpr, depth: int) -> None:
        for eqn in jx.eqns:
            if eqn.primitive.name in FED_OP_NAMES:
                p, n = eqn.params["placement"], eqn.params["n"]
                if p in found and found[p] != (depth, n):
                    raise PlacementError(
                        f"placement '{p}' is used with cardinality {n} at depth {depth} and "
                        f"{found[p][1]} at depth {found[p][0]}"
                    )
                found[p] = (depth, n)
            for sub in core.jaxprs_in_params(eqn.params):
                visit(sub, depth + (eqn.primitive is P.map_p))

    visit(jaxpr, 0)
    by_depth = sorted(found.items(), key=lambda kv: kv[1][0])
    depths = [d for _, (d, _) in by_depth]
    if len(set(depths)) != len(depths):
        raise PlacementError(
            "several placements at one nesting depth; declare them with @fcir.program"
        )
    return [(p, n) for p, (_, n) in by_depth]


def _contains_federated(jx: core.Jaxpr) -> bool:
    for eqn in jx.eqns:
        if eqn.primitive.name in FED_OP_NAMES:
            return True
        if any(_contains_federated(s) for s in core.jaxprs_in_params(eqn.params)):
            return True
    return False


def _member_of(t: Type) -> Type:
    return t.member if isinstance(t, PlacedType) else t


class _Converter:
    def __init__(self, placements: list[tuple[str, int]], locations: bool):
        self.names = [p for p, _ in placements]
        self.sizes = dict(placements)
        self.locations = locations
        self.constants: set[Value] = set()

    # -- types ----------------------------------------------------------------------------

    def local(self, t: Type, level: int) -> Type:
        return PlacedType(t, SERVER, True) if level < 0 else t

    def child(self, level: int, eqn) -> str:
        p = eqn.params["placement"]
        if level + 1 >= len(self.names) or self.names[level + 1] != p:
            here = SERVER if level < 0 else self.names[level]
            raise PlacementError(
                f"{FED_OP_NAMES[eqn.primitive.name]}: addresses placement '{p}' from "
                f"'{here}', but the placement below '{here}' is "
                f"{self.names[level + 1] if level + 1 < len(self.names) else 'none'!r}"
            )
        return p

    def param_types(self, jx: core.Jaxpr, level: int) -> list[Type]:
        """Types a region's parameters must have, from their uses (backwards)."""
        req: dict[core.Var, Type] = {}

        def require(v, t: Type) -> None:
            if isinstance(v, core.Var) and v not in req:
                req[v] = t

        for eqn in reversed(jx.eqns):
            name = eqn.primitive.name
            if name == "fed_map":
                p = self.child(level, eqn)
                inner = self.param_types(eqn.params["body"].jaxpr, level + 1)
                for v, t in zip(eqn.invars, inner):
                    require(v, PlacedType(t, p))
            elif name in FED_OP_NAMES and name != "fed_broadcast":
                p = self.child(level, eqn)
                for v in eqn.invars[:-1] if name in _DP else eqn.invars:
                    if isinstance(v, core.Var):
                        require(v, PlacedType(self.member_type(v.aval), p))
            elif name in ELEMENTWISE:
                outs = [req.get(o) for o in eqn.outvars]
                p = next((t.placement for t in outs if _is_placed(t)), None)
                if p is not None:
                    shape = eqn.outvars[0].aval.shape
                    for v in eqn.invars:
                        if isinstance(v, core.Var) and v.aval.shape == shape:
                            require(v, PlacedType(self.member_type(v.aval), p))
            elif name in _INLINE_IF_FEDERATED:
                sub = eqn.params[_INLINE_IF_FEDERATED[name]]
                sub = sub.jaxpr if isinstance(sub, core.ClosedJaxpr) else sub
                if _contains_federated(sub):
                    inner = self.param_types(sub, level)
                    consts = len(sub.invars) - len(eqn.invars)
                    for v, t in zip(eqn.invars, inner[consts:] if consts >= 0 else inner):
                        if isinstance(t, PlacedType) and t.placement != SERVER:
                            require(v, t)
        return [req.get(v, self.local(tensor_of(v.aval), level)) for v in jx.invars]

    def member_type(self, aval) -> TensorType:
        t = tensor_of(aval)
        return TensorType(t.dtype, t.shape[1:])

    # -- conversion -----------------------------------------------------------------------

    def convert_closed(self, closed, level: int, label: str, param_types=None) -> Region:
        jx = closed.jaxpr if isinstance(closed, core.ClosedJaxpr) else closed
        consts = closed.consts if isinstance(closed, core.ClosedJaxpr) else ()
        types = param_types if param_types is not None else self.param_types(jx, level)
        params = [Value(t) for t in types]
        region = Region(params, [], [], label)
        env: dict[core.Var, Value] = dict(zip(jx.invars, params))
        for var, val in zip(jx.constvars, consts):
            env[var] = self.constant(region, val, level)
        self.convert_eqns(jx, env, region, level)
        region.results = [self.read(env, v, region, level) for v in jx.outvars]
        return region

    def constant(self, region: Region, value, level: int) -> Value:
        tensor = A.Tensor.from_array(value)
        t = self.local(TensorType(tensor.dtype, tensor.shape), level)
        v = Value(t)
        self.constants.add(v)
        region.ops.append(Op("fcir.constant", [], [v], {"value": tensor}))
        return v

    def read(self, env, atom, region: Region, level: int) -> Value:
        if isinstance(atom, core.Literal):
            return self.constant(region, atom.val if hasattr(atom, "val") else atom, level)
        try:
            return env[atom]
        except KeyError:
            raise UnsupportedError(f"jaxpr variable {atom} is used before it is defined") from None

    def location(self, eqn) -> str:
        if not self.locations:
            return ""
        frame = source_info_util.user_frame(eqn.source_info.traceback)
        if frame is None:
            return ""
        import os

        return f"{os.path.basename(frame.file_name)}:{frame.start_line}"

    def convert_eqns(self, jx: core.Jaxpr, env, region: Region, level: int) -> None:
        for eqn in jx.eqns:
            name = eqn.primitive.name
            operands = [self.read(env, a, region, level) for a in eqn.invars]
            try:
                if name in FED_OP_NAMES:
                    results = self.fed_op(eqn, operands, region, level)
                elif name in _INLINE_IF_FEDERATED and _contains_federated(
                    _open(eqn.params[_INLINE_IF_FEDERATED[name]])
                ):
                    results = self.inline(eqn, operands, region, level)
                else:
                    results = self.local_op(eqn, operands, region, level)
            except FcirError:
                raise
            except Exception as e:  # a JAX param we cannot represent, or a bug: name the op
                raise UnsupportedError(f"capturing jax.{name}: {type(e).__name__}: {e}") from e
            for var, val in zip(eqn.outvars, results):
                if not isinstance(var, core.DropVar):
                    env[var] = val

    def inline(self, eqn, operands, region: Region, level: int) -> list[Value]:
        sub = eqn.params[_INLINE_IF_FEDERATED[eqn.primitive.name]]
        jx = _open(sub)
        consts = sub.consts if isinstance(sub, core.ClosedJaxpr) else ()
        env = {}
        for var, val in zip(jx.constvars, consts):
            env[var] = self.constant(region, val, level)
        extra = len(jx.invars) - len(operands)
        if extra < 0:
            raise UnsupportedError(f"jax.{eqn.primitive.name}: more operands than parameters")
        # custom_vjp/jvp calls pass their consts as leading operands already.
        env.update(zip(jx.invars, operands))
        self.convert_eqns(jx, env, region, level)
        return [self.read(env, v, region, level) for v in jx.outvars]

    def fed_op(self, eqn, operands, region: Region, level: int) -> list[Value]:
        name = eqn.primitive.name
        p = self.child(level, eqn)
        loc = self.location(eqn)
        if name == "fed_broadcast":
            (x,) = operands
            t = PlacedType(_member_of(x.type) if level < 0 else x.type, p, True)
            out = [Value(t)]
            op = Op("fed.broadcast", operands, out, {"to": p}, location=loc)
        elif name == "fed_map":
            body = eqn.params["body"]
            if not operands:
                raise UnsupportedError("fed.map over no placed values: give map_fn an argument")
            inner = [_member_of(o.type) for o in operands]
            # A broadcast (all-equal) operand is one value per member inside the region.
            sub = self.convert_closed(body, level + 1, "member", param_types=inner)
            out = [Value(PlacedType(r.type, p)) for r in sub.results]
            op = Op("fed.map", operands, out, {}, [sub], location=loc)
        elif name in _DP:
            attrs = {k: float(eqn.params[k]) for k in ("clip_norm", "noise_multiplier")}
            out = [Value(self.local(tensor_of(v.aval), level)) for v in eqn.outvars]
            op = Op(FED_OP_NAMES[name], operands, out, attrs, location=loc)
        else:
            attrs = {"bitwidth": int(eqn.params["bitwidth"])} if name == "fed_secure_sum" else {}
            av = eqn.outvars[0].aval
            out = [Value(self.local(tensor_of(av), level))]
            op = Op(FED_OP_NAMES[name], operands, out, attrs, location=loc)
        region.ops.append(op)
        return out

    def local_op(self, eqn, operands, region: Region, level: int) -> list[Value]:
        name = eqn.primitive.name
        regions: list[Region] = []

        def add_region(jx, closed: bool) -> A.RegionRef:
            regions.append(self.convert_closed(jx, level, f"r{len(regions)}"))
            return A.RegionRef(len(regions) - 1, closed)

        attrs = {k: A.encode(v, name, k, add_region) for k, v in sorted(eqn.params.items())}
        placed = self.elementwise_placement(name, operands)
        results = []
        for var in eqn.outvars:
            t = tensor_of(var.aval)
            if placed is not None:
                results.append(Value(PlacedType(TensorType(t.dtype, t.shape[1:]), *placed)))
            else:
                results.append(Value(self.local(t, level)))
        region.ops.append(
            Op(f"jax.{name}", operands, results, attrs, regions, location=self.location(eqn))
        )
        return results

    def elementwise_placement(self, name, operands):
        """(placement, all_equal) when an elementwise op acts on values placed at one
        placement (scalar constants may join: they are known everywhere)."""
        if name not in ELEMENTWISE:
            return None
        placed = [o.type for o in operands if _is_placed(o.type)]
        others = [o for o in operands if not _is_placed(o.type)]
        if not placed or any(o not in self.constants or _member_of(o.type).shape for o in others):
            return None
        if len({(t.placement, t.member.shape) for t in placed}) != 1:
            return None
        return placed[0].placement, all(t.all_equal for t in placed)


def _is_placed(t) -> bool:
    return isinstance(t, PlacedType) and t.placement != SERVER and isinstance(t.member, TensorType)


def _open(j):
    return j.jaxpr if isinstance(j, core.ClosedJaxpr) else j


def abstract_args(args):
    """Arrays -> ShapeDtypeStructs (keeps capture from holding on to data)."""
    return jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype), args)
