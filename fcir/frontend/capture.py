"""Capture: trace a JAX function and convert its jaxpr into a placement-typed Module.

Types are inferred region by region. A region runs at a *level*: -1 is the server (the
top of the program), ``i`` is inside a ``fed.map`` over the members of placement ``i``.
Unplaced values at the server are typed ``T@server``; inside a map region they are
plain ``T``. Region parameters take the type their uses require (an operand of a
nested ``fed.map`` or of a reduction is placed), propagated backwards through
elementwise ops, calls and control flow; results then follow forwards from the op type
rules. Server control flow (``scan``, ``while``, ``cond``) whose regions hold fed ops or
get placed values has its regions typed from its operands, to a fixed point through the
loop carry (``fcir.ir.control_flow``, docs/control_flow.md).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np

from fcir import gcpause
from fcir import jaxcompat as jc
from fcir.checker.check import check
from fcir.errors import FcirError, IRTypeError, PlacementError, UnsupportedError, user_location
from fcir.fed import Broadcast, Map, by_primitive
from fcir.frontend import jaxpr_cache as captured
from fcir.frontend import pytrees
from fcir.ir import Func, Module, Op, Region, Value, canonical, is_name, sanitize_name
from fcir.ir import attrs as A
from fcir.ir import control_flow as CF
from fcir.ir.elementwise import LAYOUT, PER_MEMBER
from fcir.ir.types import (
    SERVER,
    PlacedType,
    TensorType,
    Type,
    runtime_type,
    structure_of,
    tensor_of,
)
from fcir.jaxcompat import core, derivatives, scan_outputs, schema, source_info_util
from fcir.opkit.placement import PRIVATE_SCOPE

# Primitives applied member by member (fcir.ir.elementwise): on values placed at one
# placement they stay per-member computations, so capture keeps the placement.
ELEMENTWISE = PER_MEMBER
_LAYOUT = LAYOUT

# Call-like primitives that are inlined when their body contains federated ops or they
# are called on placed values, so that placements never hide inside a local call.
_INLINE_IF_FEDERATED = CF.CALLS

# JAX primitive name -> fed op class, from the registry (fcir.fed).
FED_OP_CLASSES = by_primitive()
FED_OP_NAMES = {prim: cls.name for prim, cls in FED_OP_CLASSES.items()}


def capture(fn, *args, name: str | None = None, locations: bool = False, **kwargs) -> Module:
    """Traces ``fn(*args)`` and returns its checked, placement-typed Module.

    ``args`` are arrays or ``jax.ShapeDtypeStruct`` pytrees. Works on anything that
    traces to a jaxpr with fcir primitives, e.g. ``jax.grad(round_fn)``. Raises
    PlacementError for client-to-client communication (see ``fcir.check``).

    ``locations=True`` records each op's source line in the module (printed by
    ``to_text(locations=True)``). Without it an error still names the user's source
    line: the failing conversion or check runs once more with locations.
    """
    # Tracing makes the jaxpr and converting it the module: millions of long-lived
    # objects and no garbage cycles, so no collector passes while they are made
    # (fcir.gcpause). Unpaused, the trace alone ran one to three full collections.
    with gcpause.tenured():
        traced = _trace(fn, args, kwargs, name)
        try:
            module = check(_convert(traced, locations))
        except FcirError as error:
            if locations:
                raise
            try:
                check(_convert(traced, True))
            except FcirError as located:
                if type(located) is type(error):
                    raise located from None
            raise
    captured.mark_checked(module)  # xla.compile need not check it again
    return module


def capture_unchecked(fn, *args, name: str | None = None, locations: bool = False,
                      **kwargs) -> Module:
    """Like :func:`capture` but returns the Module even when it does not check, so that
    ``fcir check`` can report every problem with its op."""
    with gcpause.tenured():  # as in capture
        return _convert(_trace(fn, args, kwargs, name), locations)


def _check_arguments(args, kwargs) -> None:
    """Every argument leaf is an array, a number or a ``jax.ShapeDtypeStruct``: name the
    first that is not (JAX's own message speaks of jit and static_argnums)."""
    leaves = jax.tree_util.tree_flatten_with_path((args, kwargs))[0]
    for path, leaf in leaves:
        if isinstance(leaf, (bool, int, float, complex)) or hasattr(leaf, "__jax_array__"):
            continue
        if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):  # arrays, ShapeDtypeStruct
            continue
        where = jax.tree_util.keystr(path[1:]) if path else ""
        kind = "argument" if path and getattr(path[0], "idx", None) == 0 else "keyword argument"
        raise IRTypeError(
            f"fcir.capture: {kind} {where or '?'} is a {type(leaf).__name__}, not an array: "
            "pass arrays or jax.ShapeDtypeStruct pytrees (bind other values with "
            "functools.partial or a closure)"
        )


def _trace(fn, args, kwargs, name):
    if not callable(fn):
        raise IRTypeError(
            f"fcir.capture(fn, *args): fn must be a function (an @fcir.program, or "
            f"jax.grad of one), got {type(fn).__name__}"
        )
    if name is not None and not is_name(name):
        raise IRTypeError(
            f"capture(name={name!r}): a module name is an ASCII identifier "
            f"([A-Za-z_][A-Za-z0-9_]*), e.g. {sanitize_name(name)!r}"
        )
    _check_arguments(args, kwargs)
    try:
        with scan_outputs.keeping_copies():  # one IR text of a linearized scan
            closed, out_shape = derivatives.make_jaxpr(fn, *args, **kwargs)
    except (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError) as e:
        raise _needs_a_value(e) from e
    _, in_tree = jax.tree_util.tree_flatten((args, kwargs) if kwargs else args)
    _, out_tree = jax.tree_util.tree_flatten(out_shape)
    return fn, closed, in_tree, out_tree, name


def _needs_a_value(e: Exception) -> UnsupportedError:
    """What to write instead of the Python (or numpy) code that asked a traced array for
    its value, naming the user's line: eager calls (and jax.grad outside jit) run such
    code, capture traces abstractly like jax.jit. ``fcir.map_fn`` marks an error of its
    body with the member placement (``fcir_member_of``): there the fix is a per-member
    select, not a server branch."""
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    at = user_location(e)
    at = f" (at {at})" if at else ""
    member = getattr(e, "fcir_member_of", None)
    if isinstance(e, jax.errors.TracerArrayConversionError):
        error = UnsupportedError(
            f"capture: a numpy function was given a traced array{at} ({first}). A program "
            "is traced like jax.jit, without values, and numpy computes on values: use "
            "jax.numpy (import jax.numpy as jnp; jnp.tanh(x) for np.tanh(x)), which "
            "captures; numpy is for constants made from Python values"
        )
    elif member is not None:
        error = UnsupportedError(
            f"capture: a map_fn body (one member of '{member}') needs the value of a "
            f"traced array in Python{at} ({first}), e.g. `if jnp.sum(x) > 0:`. Capture "
            "traces the body once, with one member's shapes and no values: pick values with "
            "jnp.where(pred, a, b), branch with jax.lax.cond(pred, f, g, *operands), loop "
            "with jax.lax.scan / fori_loop / while_loop (docs/control_flow.md)"
        )
    else:
        error = UnsupportedError(
            f"capture: the program needs the value of a traced array in Python{at} "
            f"({first}), e.g. `if fcir.reduce_mean(loss) > t:` choosing whether a second "
            "exchange runs. Capture traces the program like jax.jit, without values: "
            "branch with jax.lax.cond(pred, second_exchange, lambda w: w, w) (its "
            "predicate an aggregate at the server), loop with jax.lax.scan / fori_loop / "
            "while_loop; fcir captures those and their gradients (docs/control_flow.md)"
        )
    error.fcir_located = bool(at)
    return error


def _convert(traced, locations: bool) -> Module:
    fn, closed, in_tree, out_tree, name = traced
    module = from_jaxpr(
        closed, in_tree, out_tree, name=name or _name_of(fn),
        placements=_placements(fn, closed.jaxpr), locations=locations,
        private=_private(fn) or _calls_private(closed.jaxpr),
    )
    _check_client_data(fn, module)
    return module


def _check_client_data(fn, module: Module) -> None:
    """With ``fcir.program(client_data=...)``: no other argument may be client data, and
    a declared one may not be used at the server."""
    declared = _declared(fn, "fcir_client_data")
    structure = module.main.arg_structure
    if declared is None or structure is None or structure.kind != "tuple":
        return
    import inspect

    try:
        names = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        names = []
    params = module.main.body.params
    # A server value read by a server op, or by a map_fn body through a closure (which
    # broadcasts it: every member then holds all members' data).
    used = {id(v) for op in module.main.body.ops for v in op.operands}
    allowed = {i for i, _ in declared}
    for i, arg in enumerate(structure.children):
        name = names[i] if i < len(names) else f"argument {i}"
        if i in allowed:
            at_server = [
                (leaf, params[leaf].type) for leaf in arg.leaves()
                if id(params[leaf]) in used and isinstance(params[leaf].type, PlacedType)
                and (params[leaf].type.placement == SERVER or params[leaf].type.all_equal)
            ]
            if at_server:
                leaf, t = at_server[0]
                raise PlacementError(
                    f"@{module.name}: argument {name!r} is declared client data "
                    f"(fcir.program(client_data=...)) but %{leaf}: {t} is used at the "
                    "server, read whole by a server op or by a map_fn body through a closure "
                    f"(which gives every member all members' data): pass {name!r} to "
                    "fcir.map_fn as an argument, one member's slice per member"
                )
            continue
        for leaf in arg.leaves():
            t = params[leaf].type
            if isinstance(t, PlacedType) and t.placement != SERVER and not t.all_equal:
                said = ", ".join(repr(c) for _, c in declared) or "none"
                raise PlacementError(
                    f"@{module.name}: argument {name!r} (%{leaf}: {t}) is used as client "
                    f"data, but fcir.program(client_data=...) declares only {said}: if "
                    f"{name!r} is a server value, did you mean fcir.broadcast({name})?"
                )


def from_jaxpr(closed: jc.ClosedJaxpr, in_tree=None, out_tree=None, *, name="program",
               placements=None, locations: bool = False, private: bool = False) -> Module:
    """Converts an already traced jaxpr (unchecked). ``in_tree``/``out_tree`` are the
    PyTreeDefs of the flat arguments and results; placements default to those the
    jaxpr's federated ops use."""
    if placements is None:
        placements = _placements(None, closed.jaxpr)
    converter = _Converter(placements, locations)
    body = converter.convert_closed(closed, level=-1, label="main")
    main = Func("main", body, in_tree and structure_of(in_tree),
                out_tree and structure_of(out_tree))
    # In this process, results come back with the program's own pytree classes (optax
    # states, dataclasses); a deserialized module rebuilds them from the Structure.
    main.result_treedef = out_tree
    pytrees.remember(main.result_structure, out_tree)
    module = Module(name, placements, [main], private=private)
    # One layout wherever JAX versions emit the same computation in another (fcir.ir.canonical).
    canonical.canonicalize(module, converter.weak_literals)
    # Backends that only need this very jaxpr back take it instead of tracing the IR.
    captured.remember(module, closed)
    return module


def _declared(fn, attr: str):
    """``attr`` as ``fcir.program`` set it on ``fn`` or on what ``fn`` wraps (jit,
    partial, functools.wraps), or None."""
    seen = fn
    for _ in range(16):
        value = getattr(seen, attr, None)
        if value is not None:
            return value
        seen = getattr(seen, "__wrapped__", None) or getattr(seen, "func", None)
        if seen is None:
            break
    return None


def _private(fn) -> bool:
    """True if ``fn`` (or what it wraps) is an ``fcir.program(private=True)``."""
    return bool(_declared(fn, "fcir_private"))


def _calls_private(jaxpr: core.Jaxpr) -> bool:
    """True if an op of ``jaxpr`` (or of a jaxpr inside it) was traced inside an
    ``fcir.program(private=True)``: a function that calls a private program (under
    jax.grad, vmap, jit, a scan body...) is private too."""
    stack, seen = [jaxpr], set()
    while stack:
        jx = stack.pop()
        if id(jx) in seen:
            continue
        seen.add(id(jx))
        for eqn in jx.eqns:
            if PRIVATE_SCOPE in str(eqn.source_info.name_stack):
                return True
            stack.extend(core.jaxprs_in_params(eqn.params))
    return False


def _name_of(fn) -> str:
    while isinstance(fn, functools.partial):
        fn = fn.func
    name = getattr(fn, "__name__", None) or type(fn).__name__
    return sanitize_name(name) if isinstance(name, str) and name else "program"


def _placements(fn, jaxpr: core.Jaxpr) -> list[tuple[str, int]]:
    """Declared placements if ``fn`` (or what it wraps) is an fcir.program; else the
    placements the jaxpr's federated ops use, ordered by nesting depth."""
    spec = _declared(fn, "fcir_placements")
    if spec is not None:
        return list(zip(spec.names, spec.sizes))
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
                visit(sub, depth + (eqn.primitive is Map.primitive))

    visit(jaxpr, 0)
    by_depth = sorted(found.items(), key=lambda kv: kv[1][0])
    depths = [d for _, (d, _) in by_depth]
    if len(set(depths)) != len(depths):
        raise PlacementError(
            "several placements at one nesting depth; declare them with @fcir.program"
        )
    return [(p, n) for p, (_, n) in by_depth]


def _check_cardinality(eqn, declared: int) -> None:
    """A module has one cardinality per placement, which every backend runs each fed op
    with; a fed op traced with another (a program calling a program declared with other
    cardinalities) would compute other numbers than jax.jit does, so it is refused."""
    n = eqn.params["n"]
    if n != declared:
        p = eqn.params["placement"]
        raise PlacementError(
            f"{FED_OP_NAMES[eqn.primitive.name]}: traced with '{p}' of cardinality {n}, but "
            f"the captured program declares {p}:{declared}; a module has one cardinality "
            f"per placement: declare the programs it calls with placements={{'{p}': "
            f"{declared}}} (or capture the called program on its own)"
        )


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
        self.weak_literals: set[Value] = set()  # scalar ones, for fcir.ir.canonical
        # Values a jax.scan stacked from per-iteration placed values: the IR keeps their
        # member axis first, where the jaxpr has the scan axis first (control_flow.py).
        self.swapped: set[Value] = set()
        # jaxpr variables holding a placed value with its member axis second, the batch
        # axis of a jax.vmap first (``transpose`` of a map's batched result, which JAX's
        # scan batching inserts to stack batched ys): the IR keeps the placed value and
        # drops the transposes (``views``), also per iteration of a scan that stacked
        # them (``stacked_views``: the scan's stacked result and its xs slices).
        self.views: set = set()
        self.stacked_views: set = set()
        self._tensor_types: dict = {}
        self._server_types: dict = {}

    # -- types ----------------------------------------------------------------------------

    def local(self, t: Type, level: int) -> Type:
        return PlacedType(t, SERVER, True) if level < 0 else t

    # Most ops of a large program repeat a few types: one (immutable) type object each.
    def tensor_type(self, aval) -> TensorType:
        key = (aval.dtype, aval.shape)
        t = self._tensor_types.get(key)
        if t is None:
            t = self._tensor_types[key] = tensor_of(aval)
        return t

    def local_type(self, t: TensorType, level: int) -> Type:
        if level >= 0:
            return t
        placed = self._server_types.get(t)
        if placed is None:
            placed = self._server_types[t] = PlacedType(t, SERVER, True)
        return placed

    def child(self, level: int, eqn) -> str:
        p = eqn.params["placement"]
        if level + 1 >= len(self.names) or self.names[level + 1] != p:
            here = SERVER if level < 0 else self.names[level]
            raise PlacementError(
                f"{FED_OP_NAMES[eqn.primitive.name]}: addresses placement '{p}' from "
                f"'{here}', but the placement below '{here}' is "
                f"{self.names[level + 1] if level + 1 < len(self.names) else 'none'!r}"
            )
        _check_cardinality(eqn, self.sizes[p])
        return p

    def param_types(self, jx: core.Jaxpr, level: int, out_req=None, *,
                    stacked_ok: bool = False) -> list[Type]:
        """Types a region's parameters must have, from their uses (backwards).

        ``out_req`` are types required of the region's results (None where any will do):
        a loop carry or a call's result that is used as placed data later.
        ``stacked_ok``: ``jx`` is the body of an inlined call or of a fed.map, whose
        parameters may be stacked per-round client values (a gradient's residuals).
        """
        req: dict[core.Var, Type] = {}

        def require(v, t) -> None:
            if isinstance(v, core.Var) and v not in req and t is not None:
                req[v] = t

        for v, t in zip(jx.outvars, out_req or ()):
            if CF.is_placed(t):
                require(v, t)
        for eqn in reversed(jx.eqns):
            name = eqn.primitive.name
            if eqn.primitive is Map.primitive:
                p = self.child(level, eqn)
                inner = self.param_types(eqn.params["body"].jaxpr, level + 1, stacked_ok=True)
                for v, t in zip(eqn.invars, inner):
                    require(v, t if isinstance(t, _Stacked) else PlacedType(t, p))
            elif name in FED_OP_NAMES and eqn.primitive is not Broadcast.primitive:
                p = self.child(level, eqn)
                placed = FED_OP_CLASSES[name].placed_operands(len(eqn.invars))
                for v in (eqn.invars[i] for i in placed):
                    if isinstance(v, core.Var):
                        require(v, PlacedType(self.member_type(v.aval), p))
            elif name in _LAYOUT and CF.is_placed(req.get(eqn.outvars[0])):
                # A layout change keeps the type whole, nested placements included
                # ({{T}@clients}@silos under jax.set_mesh with a "silos" axis).
                for v, o in zip(eqn.invars, eqn.outvars):
                    require(v, req.get(o))
            elif name in ELEMENTWISE:
                outs = [req.get(o) for o in eqn.outvars]
                p = next((t.placement for t in outs if _is_placed(t)), None)
                if p is not None:
                    shape = eqn.outvars[0].aval.shape
                    for v in eqn.invars:
                        if isinstance(v, core.Var) and v.aval.shape == shape:
                            require(v, PlacedType(self.member_type(v.aval), p))
            elif name in CF.PRIMITIVES:
                for v, t in zip(eqn.invars, self.control_flow_requirements(eqn, req, level)):
                    require(v, t)
            elif name in _INLINE_IF_FEDERATED:
                sub = _open(eqn.params[_INLINE_IF_FEDERATED[name]])
                inner = self.param_types(sub, level, [req.get(o) for o in eqn.outvars],
                                         stacked_ok=True)
                consts = len(sub.invars) - len(eqn.invars)
                for v, t in zip(eqn.invars, inner[consts:] if consts >= 0 else inner):
                    if CF.is_placed(t) or isinstance(t, _Stacked):
                        require(v, t)
        for v in jx.invars:
            if isinstance(req.get(v), _Stacked) and not stacked_ok:
                raise PlacementError(req[v].message(v))
        return [
            req[v] if CF.is_placed(req.get(v)) or isinstance(req.get(v), _Stacked)
            else self.local(tensor_of(v.aval), level)
            for v in jx.invars
        ]

    def control_flow_requirements(self, eqn, req, level: int) -> list:
        """Placements a scan/while/cond needs of its operands, from its regions' uses and
        from the uses of its results (a fixed point through the loop carry)."""
        name, params = eqn.primitive.name, schema.to_fcir(eqn.primitive.name, eqn.params)
        outs = [req.get(o) for o in eqn.outvars]
        n = len(eqn.invars)
        found: list = [None] * n

        def merge(i, t):
            if found[i] is None and (CF.is_placed(t) or isinstance(t, _Stacked)):
                found[i] = t

        if name == "cond":
            for branch in params["branches"]:
                for i, t in enumerate(self.param_types(branch.jaxpr, level, outs), 1):
                    merge(i, t)
            return found
        if name == "scan":
            nc, nk, length = params["num_consts"], params["num_carry"], params["length"]
            body = params["jaxpr"].jaxpr
            ys = [_unstacked_req(t) for t in outs[nk:]]
            carry = outs[:nk]
            for _ in range(nk + 1):
                inner = self.param_types(body, level, carry + ys)
                new = [c if CF.is_placed(c) else t for c, t in zip(carry, inner[nc:nc + nk])]
                if new == carry:
                    break
                carry = new
            for i, t in enumerate(inner[: nc + nk]):
                merge(i, t)
            for i in range(nc, nc + nk):
                merge(i, carry[i - nc])
            for i, t in enumerate(inner[nc + nk:], nc + nk):
                if CF.is_placed(t):
                    merge(i, _Stacked(t, length, eqn.invars[i]))
            return found
        # while: cond consts, body consts, carry
        cn, bn = params["cond_nconsts"], params["body_nconsts"]
        carry = outs
        for _ in range(len(carry) + 1):
            body = self.param_types(params["body_jaxpr"].jaxpr, level, carry)
            cond = self.param_types(params["cond_jaxpr"].jaxpr, level)
            new = [
                next((x for x in (c, b, k) if CF.is_placed(x)), c)
                for c, b, k in zip(carry, body[bn:], cond[cn:])
            ]
            if new == carry:
                break
            carry = new
        for i, t in enumerate(cond[:cn] + body[:bn] + carry):
            merge(i, t)
        return found

    def member_type(self, aval) -> TensorType:
        t = tensor_of(aval)
        return TensorType(t.dtype, t.shape[1:])

    # -- conversion -----------------------------------------------------------------------

    def convert_closed(self, closed, level: int, label: str, param_types=None,
                       swapped=(), view_yields: bool = False) -> Region:
        """``swapped[i]``: parameter i is a stacked per-round placed value (only a
        fed.map body gets those, and only a fed.map body may yield them)."""
        jx = closed.jaxpr if isinstance(closed, jc.ClosedJaxpr) else closed
        consts = closed.consts if isinstance(closed, jc.ClosedJaxpr) else ()
        types = param_types if param_types is not None else self.param_types(jx, level)
        params = [Value(t) for t in types]
        self.swapped.update(v for v, s in zip(params, swapped) if s)
        region = Region(params, [], [], label)
        env: dict[core.Var, Value] = dict(zip(jx.invars, params))
        for var, val in zip(jx.constvars, consts):
            env[var] = self.constant(region, val, level)
        self.convert_eqns(jx, env, region, level)
        region.results = [self.read(env, v, region, level) for v in jx.outvars]
        if not view_yields:  # a scan body's ys may be views: the scan stacks them
            self.no_view_yields(jx.outvars, f"the region {label}")
        for v in region.results:
            if v in self.swapped and label != "member":
                raise PlacementError(_swapped_message(f"the region {label}", v, "yields"))
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
            c = self.constant(region, atom.val if hasattr(atom, "val") else atom, level)
            if getattr(atom.aval, "weak_type", False) and not atom.aval.shape:
                self.weak_literals.add(c)
            return c
        try:
            v = env[atom]
        except KeyError:
            raise UnsupportedError(f"jaxpr variable {atom} is used before it is defined") from None
        if isinstance(v, _TraceConst):
            # As JAX 0.10 inlined while tracing: a scalar constant is a literal at each
            # use, a larger one a constant made where it is first used.
            c = self.constant(region, v.value, level)
            if np.ndim(v.value):
                env[atom] = c
            return c
        return v

    def location(self, eqn) -> str:
        if not self.locations:
            return ""
        frame = source_info_util.user_frame(eqn.source_info.traceback)
        if frame is None:
            return ""
        import os

        return f"{os.path.basename(frame.file_name)}:{frame.start_line}"

    def located(self, error: FcirError, eqn) -> FcirError:
        """``error`` naming the user's source line of ``eqn`` (innermost first), when
        locations are recorded (``capture`` retries a failed conversion with them)."""
        loc = self.location(eqn)
        if not loc or getattr(error, "fcir_located", False):
            return error
        new = type(error)(f"{error} (at {loc})")
        new.fcir_located = True
        return new

    def convert_eqns(self, jx: core.Jaxpr, env, region: Region, level: int) -> None:
        for eqn in jx.eqns:
            name = eqn.primitive.name
            if name in _INLINE_IF_FEDERATED and schema.inlined_while_tracing(name, eqn.params):
                # JAX 0.10 inlined this call while tracing: its literal operands are
                # literals at their uses inside, not constants made at the call.
                operands = [
                    _TraceConst(a.val) if isinstance(a, core.Literal)
                    else self.read(env, a, region, level)
                    for a in eqn.invars
                ]
                for var, val in zip(eqn.outvars, self.inline(eqn, operands, region, level)):
                    if not isinstance(var, core.DropVar):
                        env[var] = val
                continue
            operands = [self.read(env, a, region, level) for a in eqn.invars]
            if self.batch_view(eqn, operands, env):
                continue
            self.check_swapped(eqn, operands)
            placed = any(CF.is_placed(o.type) for o in operands)
            try:
                if name in FED_OP_NAMES:
                    results = self.fed_op(eqn, operands, region, level)
                elif name in _INLINE_IF_FEDERATED and (placed or _contains_federated(
                    _open(eqn.params[_INLINE_IF_FEDERATED[name]])
                )):
                    results = self.inline(eqn, operands, region, level)
                elif name in CF.PRIMITIVES and (placed or any(
                    _contains_federated(j) for j in core.jaxprs_in_params(eqn.params)
                )):
                    results = self.control_flow(eqn, operands, region, level)
                else:
                    results = self.local_op(eqn, operands, region, level)
            except FcirError as e:
                raise self.located(e, eqn) from None
            except Exception as e:  # a JAX param we cannot represent, or a bug: name the op
                raise self.located(
                    UnsupportedError(f"capturing jax.{name}: {type(e).__name__}: {e}"), eqn
                ) from e
            for var, val in zip(eqn.outvars, results):
                if not isinstance(var, core.DropVar):
                    env[var] = val

    def batch_view(self, eqn, operands, env) -> bool:
        """Handles ``transpose`` swapping axes 0 and 1 of a placed value (into a view,
        see ``views``) or of a view (back to the placed value); True if it did. Any
        other op reading a view is refused: its layout is not the IR's."""
        views = [a for a in eqn.invars if _is_var(a) and (a in self.views
                                                           or a in self.stacked_views)]
        name = eqn.primitive.name
        if name == "transpose" and len(operands) == 1 and _swaps01(eqn.params["permutation"]):
            (a,), (x,), (out,) = eqn.invars, operands, eqn.outvars
            if _is_var(a) and a in self.views:
                env[out] = x
                return True
            t = x.type
            if (not views and _is_placed(t) and x not in self.swapped and len(t.member.shape) >= 1):
                env[out] = x
                self.views.add(out)
                return True
        if views and name not in ("scan", *_INLINE_IF_FEDERATED):
            raise PlacementError(
                f"jax.{name}: reads a placed value whose member axis jax.vmap moved second "
                "(batch axis first); fcir keeps the member axis of placed values first. "
                "Batch the values inside fcir.map_fn instead"
            )
        return False

    def inline(self, eqn, operands, region: Region, level: int) -> list[Value]:
        sub = eqn.params[_INLINE_IF_FEDERATED[eqn.primitive.name]]
        jx = _open(sub)
        consts = sub.consts if isinstance(sub, jc.ClosedJaxpr) else ()
        env = {}
        traced = schema.inlined_while_tracing(eqn.primitive.name, eqn.params)
        for var, val in zip(jx.constvars, consts):
            env[var] = _TraceConst(val) if traced else self.constant(region, val, level)
        extra = len(jx.invars) - len(operands)
        if extra < 0:
            raise UnsupportedError(f"jax.{eqn.primitive.name}: more operands than parameters")
        # custom_vjp/jvp calls pass their consts as leading operands already.
        env.update(zip(jx.invars, operands))
        self.pass_views(eqn.invars, jx.invars)
        self.convert_eqns(jx, env, region, level)
        self.pass_views(jx.outvars, eqn.outvars)
        return [self.read(env, v, region, level) for v in jx.outvars]

    def no_view_yields(self, outvars, where: str) -> None:
        if any(_is_var(v) and v in self.views for v in outvars):
            raise PlacementError(
                f"{where} yields a placed value whose member axis jax.vmap moved second; "
                "fcir keeps the member axis of placed values first: batch the values "
                "inside fcir.map_fn instead"
            )

    def pass_views(self, outer, inner) -> None:
        """Marks ``inner[i]`` a view (stacked view) where ``outer[i]`` is one."""
        for a, b in zip(outer, inner):
            if _is_var(a) and _is_var(b):
                if a in self.views:
                    self.views.add(b)
                if a in self.stacked_views:
                    self.stacked_views.add(b)

    def check_swapped(self, eqn, operands) -> None:
        """Stacked placed values (scan ``ys``) may only be scanned over again."""
        name = eqn.primitive.name
        if name in _INLINE_IF_FEDERATED or eqn.primitive is Map.primitive:
            return  # passed on unchanged: the body's uses are checked
        xs = range(0)
        if name == "scan":
            xs = range(sum(schema.scan_counts(eqn.params)), len(operands))
        for i, o in enumerate(operands):
            if o in self.swapped and i not in xs:
                raise PlacementError(_swapped_message(f"jax.{name}", o, "reads"))

    def control_flow(self, eqn, operands, region: Region, level: int) -> list[Value]:
        """A scan/while/cond whose regions hold fed ops or get placed values: its regions
        are typed from its operands, to a fixed point through the loop carry."""
        flow = _Flow(self, eqn, list(operands), region, level)
        typed = {"scan": flow.scan, "while": flow.while_loop}.get(flow.name, flow.cond)
        return flow.emit(typed())

    def promotions(self, body: Region, carried) -> dict[int, PlacedType]:
        """Loop-carried parameters (indices in ``carried``) typed as local values that
        the body combines elementwise with placed values of their own runtime type: they
        are per-member accumulators (JAX's cotangents of client data), so the carry is
        placed. Returns parameter index -> the placed type."""
        out: dict[int, PlacedType] = {}
        index = {body.params[i]: i for i in carried}
        for op in body.ops:
            if op.name.removeprefix("jax.") not in ELEMENTWISE:
                continue
            placed = next((o.type for o in op.operands if CF.is_placed(o.type)), None)
            if placed is None:
                continue
            runtime = runtime_type(placed, self.sizes.get)
            for o in op.operands:
                i = index.get(o)
                if i is not None and not CF.is_placed(o.type) and _member_of(o.type) == runtime:
                    out[i] = PlacedType(placed.member, placed.placement)
        return out

    def splat_at(self, region: Region, v: Value, want: Type, level: int) -> Value | None:
        """``v``, a local splat of one scalar with the runtime type of placed type
        ``want``, remade as an all-equal placed value that fits ``want`` (ops appended to
        ``region``: the member splat, broadcast down each level); else None."""
        if not CF.is_placed(want):
            return None
        producer = next((op for op in region.ops if v in op.results), None)
        if producer is None or producer.name != "jax.broadcast_in_dim":
            return None
        (scalar,) = producer.operands
        member = CF.innermost(want)
        if (member is None or _member_of(scalar.type) != TensorType(member.dtype, ())
                or producer.attrs.get("broadcast_dimensions") != ()
                or _member_of(v.type) != runtime_type(want, self.sizes.get)):
            return None
        tensor = Value(self.local(member, level))
        attrs = {**producer.attrs, "shape": tuple(member.shape)}
        region.ops.append(Op("jax.broadcast_in_dim", [scalar], [tensor], attrs,
                             location=producer.location))
        return self.broadcast_down(region, tensor, want, producer.location)

    def broadcast_down(self, region: Region, tensor: Value, want: PlacedType,
                       location: str) -> Value:
        """``tensor`` (local) sent to every member of ``want``'s placements, outermost
        first: ``T@p!``, or for nested ``{{T}@q}@p`` a map over p broadcasting to q."""
        member = CF.innermost(want)
        top = Value(PlacedType(member, want.placement, True))
        region.ops.append(Op(Broadcast.name, [tensor], [top], {"to": want.placement},
                             location=location))
        if isinstance(want.member, TensorType):
            return top
        param = Value(member)
        body = Region([param], [], [], "member")
        body.results = [self.broadcast_down(body, param, want.member, location)]
        out = Value(PlacedType(body.results[0].type, want.placement))
        region.ops.append(Op(Map.name, [top], [out], {}, [body], location=location))
        return out

    def fed_op(self, eqn, operands, region: Region, level: int) -> list[Value]:
        cls = FED_OP_CLASSES[eqn.primitive.name]
        p = self.child(level, eqn)
        loc = self.location(eqn)
        if cls is Broadcast:
            (x,) = operands
            t = PlacedType(_member_of(x.type) if level < 0 else x.type, p, True)
            out = [Value(t)]
            op = Op(cls.name, operands, out, {"to": p}, location=loc)
        elif cls is Map:
            body = eqn.params["body"]
            if not operands:
                raise UnsupportedError(f"{cls.name} over no placed values: give map_fn an argument")
            inner = [_member_of(o.type) for o in operands]
            # A broadcast (all-equal) operand is one value per member inside the region.
            sub = self.convert_closed(body, level + 1, "member", param_types=inner,
                                      swapped=[o in self.swapped for o in operands])
            out = [Value(PlacedType(r.type, p)) for r in sub.results]
            # A stacked value passes through the map unchanged (member axis first).
            self.swapped.update(v for v, r in zip(out, sub.results) if r in self.swapped)
            op = Op(cls.name, operands, out, {}, [sub], location=loc)
        elif cls.kind == "index":  # each member's position: a value per member
            out = [Value(PlacedType(TensorType("i32", ()), p))]
            op = Op(cls.name, operands, out, {}, location=loc)
        else:  # the reductions and DP aggregates: results local to this level
            out = [Value(self.local(tensor_of(v.aval), level)) for v in eqn.outvars]
            op = Op(cls.name, operands, out, cls.attrs_from_params(eqn.params), location=loc)
        region.ops.append(op)
        return out

    def local_op(self, eqn, operands, region: Region, level: int) -> list[Value]:
        name = eqn.primitive.name
        regions: list[Region] = []

        def add_region(jx, closed: bool) -> A.RegionRef:
            regions.append(self.convert_closed(jx, level, f"r{len(regions)}"))
            return A.RegionRef(len(regions) - 1, closed)

        params = schema.to_fcir(name, eqn.params)
        attrs = {k: A.encode(v, name, k, add_region) for k, v in sorted(params.items())}
        if name in _LAYOUT and len(operands) == len(eqn.outvars) and any(
            CF.is_placed(o.type) and not _is_placed(o.type) for o in operands
        ):  # a layout change of nested placed values ({{T}@clients}@silos): same types
            results = [Value(o.type) for o in operands]
            region.ops.append(
                Op(f"jax.{name}", operands, results, attrs, regions, location=self.location(eqn))
            )
            return results
        placed = self.elementwise_placement(name, operands)
        results = []
        for var in eqn.outvars:
            t = self.tensor_type(var.aval)
            if placed is not None and len(placed) == 3:  # nested: the operands' member type
                member = _with_dtype(placed[2], t.dtype)
                results.append(Value(PlacedType(member, placed[0], placed[1])))
            elif placed is not None:
                results.append(Value(PlacedType(TensorType(t.dtype, t.shape[1:]), *placed)))
            else:
                results.append(Value(self.local_type(t, level)))
        region.ops.append(
            Op(f"jax.{name}", operands, results, attrs, regions, location=self.location(eqn))
        )
        return results

    def elementwise_placement(self, name, operands):
        """(placement, all_equal) when an elementwise op acts on values placed at one
        placement (scalar constants may join: they are known everywhere)."""
        if name not in ELEMENTWISE:
            return None
        nested = [o.type for o in operands if _is_nested(o.type)]
        if nested:
            # Values placed at a nested placement ({{T}@clients}@silos, e.g. the
            # cotangents of client data that a backward scan adds up): per member of
            # the inner placement too, when every placed operand has one member type.
            others = [o for o in operands if not _is_nested(o.type)]
            if any(o not in self.constants or _member_of(o.type).shape for o in others):
                return None
            if len({(t.placement, t.member) for t in nested}) != 1:
                return None
            return nested[0].placement, all(t.all_equal for t in nested), nested[0].member
        placed = [o.type for o in operands if _is_placed(o.type)]
        others = [o for o in operands if not _is_placed(o.type)]
        if not placed or any(o not in self.constants or _member_of(o.type).shape for o in others):
            return None
        if len({(t.placement, t.member.shape) for t in placed}) != 1:
            return None
        return placed[0].placement, all(t.all_equal for t in placed)


class _Flow:
    """One scan, while or cond being converted (``_Converter.control_flow``): its
    operands (a splat a loop makes per-member may replace one) and their types, and the
    regions converted for it so far, which ``emit`` hands to the op's attributes."""

    def __init__(self, conv: _Converter, eqn, operands: list[Value], region: Region, level: int):
        self.conv, self.eqn, self.region, self.level = conv, eqn, region, level
        self.name = eqn.primitive.name
        self.params = schema.to_fcir(self.name, eqn.params)
        self.operands = operands
        self.types = [o.type for o in operands]
        self.converted: list[tuple[object, Region]] = []

    def convert(self, jx, types, view_yields=False) -> Region:
        sub = self.conv.convert_closed(jx, self.level, "r", param_types=list(types),
                                       view_yields=view_yields)
        self.converted.append((jx, sub))
        return sub

    def join(self, what, a, b, fix=None):
        t = CF.join(a, b)
        if t is None and fix is not None:
            # A splat made at the server (JAX's zero cotangents) that the loop makes
            # per-member: every member makes the same splat, so broadcast its member.
            v = self.conv.splat_at(self.region, self.operands[fix], b, self.level)
            if v is not None:
                self.operands[fix], self.types[fix] = v, v.type
                t = CF.join(v.type, b)
        if t is None:
            raise PlacementError(
                f"jax.{self.name}: {what} is {a} on entry but {b} after an iteration or in "
                "another branch; a value has one placement through control flow: "
                "broadcast it (fcir.broadcast) or aggregate it before the loop"
            )
        return t

    def scan(self) -> list[Value]:
        c, params, types, operands = self.conv, self.params, self.types, self.operands
        nc, nk, length = params["num_consts"], params["num_carry"], params["length"]
        body_jx = params["jaxpr"].jaxpr
        for i, a in enumerate(self.eqn.invars):
            if _is_var(a) and (a in c.views or a in c.stacked_views):
                if i < nc + nk or a in c.views:
                    raise PlacementError(
                        "jax.scan: carries or scans over a placed value whose member "
                        "axis jax.vmap moved second; batch the values inside "
                        "fcir.map_fn instead"
                    )
                c.views.add(body_jx.invars[i])  # one slice: batch first, members
        xs = []
        for i in range(nc + nk, len(operands)):
            if CF.is_placed(types[i]) and operands[i] not in c.swapped:
                raise PlacementError(
                    f"jax.scan: scans along the leading axis of {types[i]}, which is "
                    "its member axis: that reads one member per iteration. Scan over "
                    "rounds inside fcir.map_fn or index the round there instead"
                )
            xs.append(CF.unstack(types[i]))
        carry = types[nc:nc + nk]
        for _ in range(nk + 2):
            self.converted.clear()
            body = self.convert(params["jaxpr"], types[:nc] + carry + xs, view_yields=True)
            outs = [r.type for r in body.results]
            new = [self.join(f"carry {k}", a, b, nc + k)
                   for k, (a, b) in enumerate(zip(carry, outs))]
            for i, t in c.promotions(body, range(nc, nc + nk)).items():
                new[i - nc] = self.join(f"carry {i - nc}", types[i], t, i)
            if new == carry:
                break
            carry = new
        c.no_view_yields(body_jx.outvars[:nk], "jax.scan: the carry")
        out_types = carry + [CF.stack(t, length) for t in outs[nk:]]
        results = [Value(t) for t in out_types]
        c.swapped.update(v for v in results[nk:] if CF.is_placed(v.type))
        for y, out in zip(body_jx.outvars[nk:], self.eqn.outvars[nk:]):
            if _is_var(y) and y in c.views:
                c.stacked_views.add(out)
        return results

    def while_loop(self) -> list[Value]:
        params, types = self.params, self.types
        cn, bn = params["cond_nconsts"], params["body_nconsts"]
        carry = types[cn + bn:]
        for _ in range(len(carry) + 2):
            self.converted.clear()
            body = self.convert(params["body_jaxpr"], types[cn:cn + bn] + carry)
            cond = self.convert(params["cond_jaxpr"], types[:cn] + carry)
            new = [self.join(f"carry {k}", a, r.type, cn + bn + k)
                   for k, (a, r) in enumerate(zip(carry, body.results))]
            for i, t in self.conv.promotions(body, range(bn, bn + len(carry))).items():
                new[i - bn] = self.join(f"carry {i - bn}", types[cn + i], t, cn + i)
            if new == carry:
                break
            carry = new
        if CF.is_placed(cond.results[0].type):
            raise PlacementError(
                f"jax.while: the loop condition is {cond.results[0].type}; it must be "
                "known where the loop runs: aggregate it first (e.g. fcir.reduce_max)"
            )
        return [Value(t) for t in carry]

    def cond(self) -> list[Value]:
        """A cond (lax.switch is a cond with several branches)."""
        types = self.types
        if CF.is_placed(types[0]):
            raise PlacementError(
                f"jax.cond: the branch index is {types[0]}; it must be known where the "
                "cond runs: aggregate it first (e.g. fcir.reduce_max)"
            )
        branches = [self.convert(b, types[1:]) for b in self.params["branches"]]
        outs = [r.type for r in branches[0].results]
        for k in range(len(outs)):
            placed = next((s.results[k].type for s in branches
                           if CF.is_placed(s.results[k].type)), None)
            for sub in branches if placed is not None else ():
                y = sub.results[k]
                if CF.join(y.type, placed) is None:
                    sub.results[k] = self.conv.splat_at(sub, y, placed, self.level) or y
            outs[k] = branches[0].results[k].type
            for sub in branches[1:]:
                outs[k] = self.join(f"result {k}", outs[k], sub.results[k].type)
        return [Value(t) for t in outs]

    def emit(self, results: list[Value]) -> list[Value]:
        """The op, its regions numbered in the order its attributes name them."""
        regions: list[Region] = []

        def add_region(jx, closed: bool) -> A.RegionRef:
            k = next(k for k, (j, _) in enumerate(self.converted) if j is jx)
            sub = self.converted.pop(k)[1]
            sub.label = f"r{len(regions)}"
            regions.append(sub)
            return A.RegionRef(len(regions) - 1, closed)

        attrs = {k: A.encode(v, self.name, k, add_region) for k, v in sorted(self.params.items())}
        op = Op(f"jax.{self.name}", self.operands, results, attrs, regions,
                location=self.conv.location(self.eqn))
        self.region.ops.append(op)
        return results


@dataclasses.dataclass(frozen=True)
class _Stacked:
    """A requirement on a scan's ``xs``: per-iteration values placed at ``inner``'s
    placement, stacked with the scan axis first (as JAX stacks them)."""

    inner: PlacedType
    length: int
    var: object = dataclasses.field(compare=False)

    def message(self, v) -> str:
        return (
            f"jax.scan: scans over {tensor_of(v.aval)} as {self.length} values of type "
            f"{self.inner} (scan axis first, member axis second), but it enters the program "
            "(or a region) from outside: fcir keeps the member axis of placed data first. "
            f"Pass it as {{{CF.stack(self.inner.member, self.length)}}}@"
            f"{self.inner.placement} and index the round inside fcir.map_fn (see "
            "docs/control_flow.md)"
        )


def _unstacked_req(t):
    return t.inner if isinstance(t, _Stacked) else None


def _swapped_message(where: str, v: Value, verb: str) -> str:
    return (
        f"{where} {verb} a value of type {v.type} that jax.scan stacked from per-iteration "
        "placed values: such values may only be scanned over by another jax.scan. "
        "Aggregate them inside the loop (e.g. fcir.reduce_mean) or carry them instead"
    )


def _is_placed(t) -> bool:
    return isinstance(t, PlacedType) and t.placement != SERVER and isinstance(t.member, TensorType)


def _is_var(a) -> bool:
    return isinstance(a, core.Var) and not isinstance(a, core.DropVar)


def _swaps01(perm) -> bool:
    perm = tuple(int(p) for p in perm)
    return len(perm) >= 2 and perm[:2] == (1, 0) and perm[2:] == tuple(range(2, len(perm)))


def _is_nested(t) -> bool:
    return (isinstance(t, PlacedType) and t.placement != SERVER
            and isinstance(t.member, PlacedType))


def _with_dtype(t: Type, dtype: str) -> Type:
    """``t`` with its innermost tensor's dtype replaced."""
    if isinstance(t, PlacedType):
        return PlacedType(_with_dtype(t.member, dtype), t.placement, t.all_equal)
    return TensorType(dtype, t.shape)


@dataclasses.dataclass(frozen=True, eq=False)
class _TraceConst:
    """A constant of a call that JAX 0.10 would have inlined while tracing."""

    value: object


def _open(j):
    return j.jaxpr if isinstance(j, jc.ClosedJaxpr) else j


def abstract_args(args):
    """Arrays -> ShapeDtypeStructs (keeps capture from holding on to data)."""
    return jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype), args)
