"""The checker: SSA scoping, federated type rules, and placement discipline.

``verify(module)`` returns every diagnostic; ``check(module)`` raises the first
placement problem as PlacementError (else type problems as IRTypeError), with all
diagnostics in the message. Local (``jax.*``) ops follow two rules:

* ``local/C1``: a local op reads only values local to where it runs. At the server a
  value placed at clients is off limits: reading one member (``x[0]``), reducing the
  member axis with ``jnp.sum`` or any other whole-placement access outside ``fed.*`` ops
  is client-to-client communication.
* ``local/C2``: the exception is an elementwise op whose operands are all placed at one
  placement with one member shape (scalar constants may join); it is a per-member
  computation and its results are placed there too.
* ``local/C3``: no collective over a placement axis. A collective whose axes are array
  dimensions (``psum(r, "batch")`` under a ``vmap`` in client code becomes
  ``psum[axes=(0,)]``) or another named axis is local computation and is allowed.
* ``region/C1``: ops in a region use only values defined earlier in that region
  (regions are isolated from above); ``region/C2``: each value is defined once.
* ``flow/C1`` .. ``flow/C4``: a control-flow op (``jax.scan``, ``jax.while``,
  ``jax.cond``) or call (``jax.pjit``, ...) hands its operands to its regions' parameters
  and their results back (``fcir.ir.control_flow``); when those types fit, the op itself
  reads nothing, so it may pass placed values. Its regions run where the op runs and are
  checked op by op like any other region.
* ``module/C5``: module, func and placement names are ASCII identifiers.

Local ops' result types and attributes, and the size of every value, are checked by
``fcir.checker.local_ops`` (its docstring lists those constraints, its tests are in
tests/checker/test_local_ops.py).

A private module (``@fcir.program(..., private=True)``) also gets the leak check of
``fcir.privacy`` (``privacy/C1``-``C4``, raised as PrivacyError).
"""

from __future__ import annotations

import dataclasses

from fcir.checker import local_ops as check_local
from fcir.checker.local_ops import COLLECTIVES
from fcir.checker.opnames import FCIR_OPS, closest_op
from fcir.errors import IRTypeError, PlacementError, PrivacyError
from fcir.fed import Context, Violation, ops
from fcir.ir import control_flow as CF
from fcir.ir import expect_module
from fcir.ir.elementwise import PER_MEMBER as ELEMENTWISE
from fcir.ir.nodes import Module, Op, Region, Value, describe, is_name, value_numbering
from fcir.ir.types import SERVER, PlacedType, TensorType
from fcir.privacy import leaks

# The checker's own constraints (the fed ops' are in their classes, fcir.fed; local
# ops' types in fcir.checker.local_ops.CONSTRAINTS; the leak check's in fcir.privacy).
CONSTRAINTS = {
    "module/C1": "placement names must be unique and not 'server'",
    "module/C2": "every placement's cardinality must be a positive int",
    "module/C3": "the module must have a func @main",
    "module/C4": "a type must name only declared placements",
    "module/C5": "module, func and placement names must be ASCII identifiers",
    "region/C1": "ops in a region use only values defined earlier in that region",
    "region/C2": "each value is defined once",
    "flow/C1": "a control-flow op's regions must have the parameters and results it binds",
    "flow/C2": "an operand must fit the region parameter it binds to",
    "flow/C3": "a yielded value must fit the result (or carried parameter) it becomes",
    "flow/C4": "a branch index or loop condition must be local",
    "local/C1": "a local op reads only values local to where it runs",
    "local/C2": "an elementwise op on values placed at one placement with one member shape "
    "is per-member computation",
    "local/C3": "no collective over a placement axis",
    "fed/C0": "a fed.* op must be one fcir defines",
    "op/C0": "ops are fed.*, jax.* or fcir.constant",
}


@dataclasses.dataclass
class Diagnostic:
    code: str
    message: str
    where: str
    placement: bool

    def __str__(self) -> str:
        return f"{self.where}: {self.message}"


class _Checker:
    def __init__(self, module: Module):
        self.module = module
        self.diags: list[Diagnostic] = []
        self.names = None
        self.types = check_local.Types(module.placements)

    def report(self, code, message, path, op, placement):
        if op is None:
            where = "func @main"
        else:
            if self.names is None:
                self.names = value_numbering(self.module.main)
            where = describe(self.module, path, op, self.names)
        self.diags.append(Diagnostic(code, message, where, placement))

    def run(self) -> list[Diagnostic]:
        m = self.module
        names = [p for p, _ in m.placements]
        if len(set(names)) != len(names) or SERVER in names:
            self.report("module/C1", "module/C1: placement names must be unique and not "
                        f"'{SERVER}' ({names})", (), None, True)
        for p, n in m.placements:
            if not isinstance(n, int) or n < 1:
                self.report("module/C2", f"module/C2: cardinality of '{p}' must be positive",
                            (), None, True)
        named = [("module", m.name), *(("placement", p) for p in names),
                 *(("func", f.name) for f in m.funcs)]
        for what, name in named:
            if not is_name(name):
                self.report("module/C5", f"module/C5: {what} name {name!r} must be an ASCII "
                            "identifier ([A-Za-z_][A-Za-z0-9_]*) to print and parse", (), None,
                            False)
        try:
            main = m.main
        except IRTypeError as e:
            self.report("module/C3", f"module/C3: {e}", (), None, False)
            return self.diags
        for v in main.body.params + main.body.results:
            self.check_type_placements(v.type, (), None)
        self.check_sizes(main.body.params, (), None)
        self.region(main.body, Context(m.placements, -1), (), set())
        if m.private and not self.diags:  # the leak check needs a well-formed module
            for leak in leaks(m):
                self.report(leak.code, leak.message, leak.path, leak.op, True)
        return self.diags

    def check_type_placements(self, t, path, op):
        if isinstance(t, PlacedType):
            if t.placement != SERVER and t.placement not in dict(self.module.placements):
                self.report("module/C4", f"module/C4: type {t} names undeclared placement "
                            f"'{t.placement}'", path, op, True)
            self.check_type_placements(t.member, path, op)

    def region(self, region: Region, ctx: Context, path: tuple, outer_defined: set) -> None:
        defined: set = set()
        for v in region.params:
            if v in defined or v in outer_defined:
                self.report("region/C2", "region/C2: a value is defined twice", path, None, False)
            defined.add(v)
        for i, op in enumerate(region.ops):
            p = (*path, i)
            for j, v in enumerate(op.operands):
                if v not in defined:
                    self.report(
                        "region/C1",
                        f"region/C1: operand {j} is not defined earlier in this region "
                        "(regions are isolated from above)",
                        p, op, False,
                    )
            self.op(op, ctx, p)
            for v in op.results:
                if v in defined:
                    self.report("region/C2", "region/C2: a value is defined twice", p, op,
                                False)
                defined.add(v)
        for v in region.results:
            if v not in defined:
                self.report("region/C1", "region/C1: yielded value is not defined in this "
                            "region", path, None, False)

    def check_sizes(self, values, path, op) -> None:
        for v in values:
            problem = self.types.size_problem(v.type)
            if problem is not None:
                self.report("value/C1", problem, path, op, False)
                return

    def op(self, op: Op, ctx: Context, path: tuple) -> None:
        for v in op.results:
            self.check_type_placements(v.type, path, op)
        self.check_sizes(op.results, path, op)
        rule = ops().get(op.name)
        if rule is not None:
            try:
                rule.verify(op, ctx)
            except Violation as e:
                self.report(e.code, str(e), path, op, e.placement)
                return
            for r, sub in enumerate(op.regions):
                inner = Context(self.module.placements, ctx.level + 1)
                self.region(sub, inner, (*path, r), set())
            return
        if op.name.startswith("fed."):
            self.report("fed/C0", f"fed/C0: unknown federated op {op.name}"
                        f"{closest_op(op.name)}", path, op, False)
            return
        if op.name not in FCIR_OPS and not op.name.startswith("jax."):
            self.report("op/C0", f"op/C0: unknown op {op.name}{closest_op(op.name)}: ops "
                        "are fed.*, jax.* or fcir.constant", path, op, False)
            return
        before = len(self.diags)
        if not self.region_bindings(op, ctx, path):
            self.local(op, ctx, path)
        new = self.diags[before:]
        if not any(d.placement for d in new):  # placement holds: now the types
            problem = check_local.result_types_problem(self.types, self.as_bound(op))
            if problem is not None:
                # A binding that does not fit in shape or dtype is what the primitive's
                # own type rule rejects too; its words (fcir.checker.local_ops) are the ones.
                del self.diags[before:]
                self.report(problem[0], problem[1], path, op, False)
        for r, sub in enumerate(op.regions):
            self.region(sub, ctx, (*path, r), set())

    def region_bindings(self, op: Op, ctx, path: tuple) -> bool:
        """For a control-flow or call op: checks each operand against the region
        parameter it binds to, each yielded value against the op result (or the carried
        parameter) it becomes, and that branch indices and loop conditions are local.
        True when the op is one of these: it only passes values on, placed or not, so
        local/C1 does not apply to the op itself (any misfit is reported here)."""
        prim = op.name.removeprefix("jax.")
        if not op.regions or not (prim in CF.PRIMITIVES or prim in CF.CALLS):
            return False
        try:
            bindings = CF.bindings(prim, op.attrs, len(op.operands), len(op.results),
                                   len(op.regions))
        except CF.BindingError as e:
            self.report("flow/C1", f"flow/C1: {op.name}: {e}", path, op, False)
            return True

        def fail(code, text, a, b):
            self.report(code, f"{code}: {op.name}: {text}", path, op,
                        CF.is_placed(a) or CF.is_placed(b))

        length = op.attrs.get("length")
        for b in bindings:
            sub = op.regions[b.region]
            if len(sub.params) != len(b.params) or len(sub.results) != len(b.results):
                fail("flow/C1", f"region ^{b.region} has {len(sub.params)} parameters and "
                     f"{len(sub.results)} results, the op binds {len(b.params)} and "
                     f"{len(b.results)}", None, None)
                continue
            for k, (i, sliced) in enumerate(b.params):
                t = op.operands[i].type
                if sliced:
                    t = CF.unstack(t) if _leading(t) == length else None
                if t is None or not CF.assignable(t, sub.params[k].type):
                    what = "one slice of operand" if sliced else "operand"
                    fail("flow/C2", f"{what} {i} ({op.operands[i].type}) does not fit "
                         f"parameter {k} ({sub.params[k].type}) of region ^{b.region}",
                         op.operands[i].type, sub.params[k].type)
            for j, (kind, k) in enumerate(b.results):
                y = sub.results[j].type
                if kind == "predicate":
                    if not (ctx.is_local(y) and ctx.member_of_local(y) == TensorType("bool", ())):
                        fail("flow/C4", f"the loop condition yields {y}; it must be a bool[] "
                             f"local to '{ctx.here}'", y, None)
                    continue
                res = op.results[j].type
                if kind == "stacked":
                    stacked = CF.stack(y, length) if isinstance(length, int) else None
                    if stacked is None or not CF.assignable(stacked, res):
                        fail("flow/C3", f"result {j} ({res}) is not {length} stacked values "
                             f"of yielded value {j} ({y}) of region ^{b.region}", res, y)
                    continue
                targets = [res]
                if kind == "carry":
                    # The carry enters as the operand, and each iteration's yield feeds
                    # every parameter bound to that operand on the next iteration.
                    operand = b.params[k][0]
                    targets += [
                        op.regions[bb.region].params[kk].type
                        for bb in bindings for kk, (i, _) in enumerate(bb.params)
                        if i == operand and len(op.regions[bb.region].params) == len(bb.params)
                    ]
                    if not CF.assignable(op.operands[operand].type, res):
                        fail("flow/C3", f"result {j} ({res}) does not fit operand {operand} "
                             f"({op.operands[operand].type}) it is after no iteration",
                             res, op.operands[operand].type)
                bad = next((t for t in targets if not CF.assignable(y, t)), None)
                if bad is not None:
                    fail("flow/C3", f"yielded value {j} ({y}) of region ^{b.region} does "
                         f"not fit {bad}", y, bad)
        if prim == "cond" and op.operands and not ctx.is_local(op.operands[0].type):
            fail("flow/C4", f"the branch index ({op.operands[0].type}) must be local to "
                 f"'{ctx.here}'", op.operands[0].type, None)
        return True

    def as_bound(self, op: Op) -> Op:
        """``op`` with the types JAX binds it with, for check_local: a jax.scan's placed
        ``xs``/``ys`` have the scan axis first there (``fcir.ir.control_flow.scan_axis``);
        every other op is bound as typed."""
        if op.name != "jax.scan":
            return op
        try:
            xs, ys = CF.scan_slices(op.attrs, len(op.operands), len(op.results))
        except CF.BindingError:
            return op  # attributes region_bindings reports as flow/C1

        def view(v: Value, sliced: bool) -> Value:
            rt = self.types.runtime(v.type)
            axis = CF.scan_axis(v.type)
            if not sliced or axis == 0 or rt is None:
                return v
            shape = list(rt[1])
            return Value(TensorType(rt[0], (shape.pop(axis), *shape)))

        return Op(op.name, [view(v, i in xs) for i, v in enumerate(op.operands)],
                  [view(v, j in ys) for j, v in enumerate(op.results)], op.attrs, op.regions,
                  location=op.location)

    def local(self, op: Op, ctx: Context, path: tuple) -> None:
        prim = op.name.removeprefix("jax.")
        if prim in COLLECTIVES:
            over = sorted(placement_axes(op, self.module.placements))
            if over:
                self.report(
                    "local/C3",
                    f"local/C3: collective {prim} over the placement axis "
                    f"{', '.join(map(repr, over))} would communicate between members; "
                    "aggregate with fed ops instead",
                    path, op, True,
                )
        operands_local = all(ctx.is_local(v.type) for v in op.operands)
        results_local = all(ctx.is_local(v.type) for v in op.results)
        if operands_local and results_local:
            return
        if prim in check_local.LAYOUT and [v.type for v in op.results] == [
            v.type for v in op.operands
        ]:
            return  # a layout change passes any value on, nested placements included
        if prim in ELEMENTWISE and self.elementwise_ok(op, ctx):
            return
        bad = next((v.type for v in op.operands if not ctx.is_local(v.type)), None)
        if bad is not None:
            self.report(
                "local/C1",
                f"local/C1: {op.name} at '{ctx.here}' reads a value of type {bad} outside a "
                "fed op: reading one member or aggregating with plain jax ops is "
                "client-to-client communication; use map_fn and the fcir reductions",
                path, op, True,
            )
        else:
            self.report(
                "local/C1",
                f"local/C1: {op.name} at '{ctx.here}' produces a placed value without a fed op",
                path, op, True,
            )

    @staticmethod
    def elementwise_ok(op: Op, ctx: Context) -> bool:
        placed = [
            v.type for v in op.operands
            if isinstance(v.type, PlacedType) and v.type.placement != SERVER
        ]
        if not placed or len({(t.placement, t.member) for t in placed}) > 1 and len(
            {(t.placement, getattr(t.member, "shape", None)) for t in placed}
        ) > 1:
            return False
        p = placed[0].placement
        for v in op.operands:
            if v.type in placed:
                continue
            member = ctx.member_of_local(v.type) if ctx.is_local(v.type) else None
            if not isinstance(member, TensorType) or member.shape != ():
                return False
        if isinstance(placed[0].member, PlacedType):  # nested: one member type throughout
            return all(t.member == placed[0].member for t in placed) and all(
                isinstance(r.type, PlacedType) and r.type.placement == p
                and _same_but_dtype(r.type.member, placed[0].member)
                for r in op.results
            )
        return all(
            isinstance(r.type, PlacedType) and r.type.placement == p
            and getattr(r.type.member, "shape", None) == placed[0].member.shape
            for r in op.results
        )


def _same_but_dtype(a, b) -> bool:
    """Two types that differ at most in their innermost tensor's dtype."""
    if isinstance(a, PlacedType) and isinstance(b, PlacedType):
        return (a.placement, a.all_equal) == (b.placement, b.all_equal) and _same_but_dtype(
            a.member, b.member)
    return isinstance(a, TensorType) and isinstance(b, TensorType) and a.shape == b.shape


def _leading(t) -> int | None:
    """Leading dimension of a tensor, or of a placed value's innermost member tensor
    (where a scan slices it)."""
    member = CF.innermost(t)
    return member.shape[0] if member is not None and member.shape else None


def placement_axes(op: Op, placements) -> set[str]:
    """The placement names among a collective's axes. Only those are communication:
    positional axes (ints) are dimensions of the member's own arrays."""
    names = {p for p, _ in placements}
    found: set[str] = set()

    def visit(a) -> None:
        if isinstance(a, str):
            if a in names:
                found.add(a)
        elif isinstance(a, tuple):
            for x in a:
                visit(x)

    for key in ("axes", "axis_name"):
        visit(op.attrs.get(key))
    return found


def verify(module: Module) -> list[Diagnostic]:
    """Every diagnostic for ``module`` (empty when it checks)."""
    expect_module(module, "fcir.check")
    return _Checker(module).run()


def check(module: Module) -> Module:
    """Raises PlacementError / IRTypeError naming the op and the violated constraint."""
    diags = verify(module)
    if not diags:
        return module
    first = next((d for d in diags if d.placement), diags[0])
    more = "" if len(diags) == 1 else f"\n(and {len(diags) - 1} more)\n" + "\n".join(
        str(d) for d in diags if d is not first
    )
    cls = PlacementError if first.placement else IRTypeError
    if first.code.startswith("privacy/"):
        cls = PrivacyError
    raise cls(str(first) + more)
