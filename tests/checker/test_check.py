"""Negative tests for the checker: one per numbered constraint.

Every ``fed.*`` op's ``constraints`` and every ``local/``, ``region/``, ``module/`` code the
checker reports has a row in ``CASES``: a good captured program, an IR mutation that
breaks exactly that constraint, and the error class ``fcir.check`` must raise.
``test_every_constraint_has_a_negative_test`` fails when a constraint has no row.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import inspect
import re
import textwrap
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fcir
from fcir import cli
from fcir.checker.check import verify
from fcir.errors import IRTypeError, PlacementError
from fcir.fed import ops as _fed_ops
from fcir.frontend.capture import capture_unchecked
from fcir.ir import Module, Op, Region, Value, walk
from fcir.ir.types import PlacedType, TensorType

FED_OPS = _fed_ops()

N = 3
f32 = jnp.float32


def sds(shape, dtype=f32):
    return jax.ShapeDtypeStruct(shape, dtype)


# --- good programs ------------------------------------------------------------------------


@fcir.program(placements={"clients": N})
def flat_round(model, data, counts, weights):
    at_clients = fcir.broadcast(model)

    def local(m, d, c):
        return m * d.mean(), c + 1

    upd, cnt = fcir.map_fn(local, (at_clients, data, counts))
    return (
        fcir.reduce_sum(upd),
        fcir.reduce_mean(upd),
        fcir.reduce_min(upd),
        fcir.reduce_max(upd),
        fcir.reduce_weighted_mean(upd, weights),
        fcir.secure_sum(cnt, bitwidth=16),
        fcir.reduce_mean(cnt),
        fcir.reduce_median(upd),
        fcir.reduce_trimmed_mean(upd, trim=1),
    )


FLAT_ARGS = (sds((2,)), sds((N, 4)), sds((N,), jnp.int32), sds((N,)))


@fcir.program(placements={"silos": 2, "clients": N})
def hierarchical_round(model, data):
    def silo(m, d):
        u = fcir.map_fn(lambda a, b: a * b.sum(), (fcir.broadcast(m), d))
        return fcir.reduce_mean(u)

    return fcir.reduce_mean(fcir.map_fn(silo, (fcir.broadcast(model), data)))


HIER_ARGS = (sds((2,)), sds((2, N, 4)))

_CAPTURED: dict[str, Module] = {}


def fresh(which: str) -> Module:
    """A private copy of a captured good program (capture runs once per session)."""
    if which not in _CAPTURED:
        fn, args = {"flat": (flat_round, FLAT_ARGS), "hier": (hierarchical_round, HIER_ARGS)}[which]
        _CAPTURED[which] = fcir.capture(fn, *args)
    return copy.deepcopy(_CAPTURED[which])


def test_good_programs_check():
    for which in ("flat", "hier"):
        m = fresh(which)
        assert verify(m) == []
        assert fcir.check(m) is m


# --- mutation helpers ---------------------------------------------------------------------


def ops_named(m: Module, name: str) -> list[Op]:
    return [op for _, op in walk(m.main.body) if op.name == name]


def op_named(m: Module, name: str, k: int = 0) -> Op:
    return ops_named(m, name)[k]


def param(m: Module, i: int) -> Value:
    return m.main.body.params[i]


def map_region(m: Module, k: int = 0) -> Region:
    return op_named(m, "fed.map", k).regions[0]


def retype(v: Value, t) -> None:
    v.type = t


def t(dtype: str, *shape: int) -> TensorType:
    return TensorType(dtype, tuple(shape))


def placed(member, placement="clients", all_equal=False) -> PlacedType:
    return PlacedType(member, placement, all_equal)


def server(member) -> PlacedType:
    return PlacedType(member, "server", True)


def set_attr(op_name: str, key: str, value, k: int = 0):
    def mutate(m):
        op = op_named(m, op_name, k)
        if value is _DELETE:
            del op.attrs[key]
        else:
            op.attrs[key] = value

    return mutate


_DELETE = object()


def set_operand(op_name: str, i: int, pick: Callable[[Module], Value], k: int = 0):
    def mutate(m):
        op_named(m, op_name, k).operands[i] = pick(m)

    return mutate


def drop_operand(op_name: str, i: int, k: int = 0):
    def mutate(m):
        del op_named(m, op_name, k).operands[i]

    return mutate


def add_operand(op_name: str, pick: Callable[[Module], Value], k: int = 0):
    def mutate(m):
        op_named(m, op_name, k).operands.append(pick(m))

    return mutate


def add_result(op_name: str, k: int = 0):
    def mutate(m):
        op = op_named(m, op_name, k)
        op.results.append(Value(op.results[0].type))

    return mutate


def retype_result(op_name: str, new_type, k: int = 0):
    def mutate(m):
        retype(op_named(m, op_name, k).results[0], new_type)

    return mutate


def reduction_cases(op: str, result_bad, program: str = "flat") -> list:
    """C1-C3 of a reduction: arity, operand placement, result type."""
    return [
        Case(op, "C1", program, add_operand(op, lambda m: param(m, 1)), "second operand"),
        Case(op, "C1", program, add_result(op), "second result"),
        Case(op, "C2", program, set_operand(op, 0, lambda m: param(m, 0)), "server operand"),
        Case(op, "C3", program, retype_result(op, result_bad), f"result {result_bad}"),
    ]


def _noop(m):
    pass


# --- the table ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
    op: str  # the fed op (or "local", "region", "module", "fed", "op")
    constraint: str  # "C2"
    program: str  # "flat", "hier", or canonical text
    mutate: Callable[[Module], None]
    what: str
    error: type | None = None  # defaults to the op's placement_constraints
    reported: str | None = None  # the code the checker reports, if not the constraint

    @property
    def code(self) -> str:
        return f"{self.op}/{self.constraint}"

    @property
    def expected_code(self) -> str:
        return self.reported or self.code

    @property
    def expected_error(self) -> type:
        if self.error is not None:
            return self.error
        rule = FED_OPS[self.op]
        return PlacementError if self.constraint in rule.placement_constraints else IRTypeError

    @property
    def id(self) -> str:
        return f"{self.code}:{re.sub(r'[^a-z0-9]+', '_', self.what.lower()).strip('_')}"


BC = "fed.broadcast"
MAP = "fed.map"
WM = "fed.weighted_mean"
SS = "fed.secure_sum"
MED = "fed.median"
TM = "fed.trimmed_mean"
KR = "fed.krum"
MK = "fed.multi_krum"
BS = "fed.bulyan_select"
BY = "fed.bulyan"
GM = "fed.geometric_median"
BE = "fed.band_edges"
MI = "fed.member_index"
# The robust selections' results feed the program's results directly here, so that a
# retyped result breaks only the op's own C3.
ROBUST = """fcir.module @robust ir_version=1 placements=[clients:3]
func @main(%0: f32[2]@server, %1: {f32[2]}@clients, %2: {i32[2]}@clients) -> (f32[2,2]@server, f32[3,2]@server, f32[2]@server, f32[2]@server, f32[2]@server, f32[9,2]@server, {i32[]}@clients) {
  %3: f32[2,2]@server = fed.krum %1 {f=0, m=2}
  %4: f32[3,2]@server = fed.bulyan_select %1 {f=0}
  %5: f32[2]@server = fed.geometric_median %1 {eps=1e-06, iters=2}
  %6: f32[2]@server = fed.multi_krum %1 {f=0, m=2}
  %7: f32[2]@server = fed.bulyan %1 {f=0}
  %8: f32[9,2]@server = fed.band_edges %1 {trim=1}
  %9: {i32[]}@clients = fed.member_index %1
  return %3, %4, %5, %6, %7, %8, %9
}
"""

PSUM_IN_MAP = """\
fcir.module @psum_in_map ir_version=1 placements=[clients:3]
func @main(%0: {f32[2]}@clients) -> (f32[2]@server) {
  %1: {f32[2]}@clients = fed.map %0 {
    ^member(%2: f32[2]):
      %3: f32[2] = jax.psum %2 {axes=["clients"], axis_index_groups=none}
      yield %3
  }
  %4: f32[2]@server = fed.sum %1
  return %4
}
"""

SERVER_PLUS_PLACED = """\
fcir.module @implicit_broadcast ir_version=1 placements=[clients:3]
func @main(%0: {f32[2]}@clients, %1: f32[2]@server) -> ({f32[2]}@clients) {
  %2: {f32[2]}@clients = jax.add %0, %1
  return %2
}
"""

# Control flow (fcir/ir/control_flow.py): a server cond choosing an aggregation, and a loop
# carrying a per-member value. Each mutation below breaks one binding of the op.
ROBUST_OR_MEAN = """\
fcir.module @robust_or_mean ir_version=1 placements=[clients:3]
func @main(%0: {f32[2]}@clients, %1: i32[]@server) -> (f32[2]@server) {
  %2: f32[2]@server = jax.cond %1, %0 {branches=[^0, ^1]} {
    ^r0(%3: {f32[2]}@clients):
      %4: f32[2]@server = fed.mean %3
      yield %4
  }, {
    ^r1(%5: {f32[2]}@clients):
      %6: f32[2]@server = fed.max %5
      yield %6
  }
  return %2
}
"""

CARRY_LOOP = """\
fcir.module @carry ir_version=1 placements=[clients:3]
func @main(%0: {f32[2]}@clients) -> ({f32[2]}@clients) {
  %1: {f32[2]}@clients = jax.scan %0 {jaxpr=^0, length=2, num_carry=1, num_consts=0, reverse=false, unroll=1} {
    ^r0(%2: {f32[2]}@clients):
      %3: f32[]@server = fcir.constant {value=dense<f32[]: 2.0>}
      %4: {f32[2]}@clients = jax.mul %2, %3
      yield %4
  }
  return %1
}
"""



def _use_before_def(m):
    r = map_region(m)  # reduce_sum, constant, div, ...: div now reads the constant too early
    r.ops[1], r.ops[2] = r.ops[2], r.ops[1]


def _yield_undefined(m):
    r = map_region(m)
    r.results[0] = Value(r.results[0].type)


def _redefine_param(m):
    r = map_region(m)
    p = r.params[0]
    r.ops.append(Op("jax.neg", [p], [p]))


def _redefine_in_func(m):
    body = m.main.body
    body.ops.append(Op("fed.sum", [op_named(m, MAP).results[0]], [body.params[0]]))


def _undeclared_placement_param(m):
    m.main.body.params.append(Value(placed(t("f32", 2), "nowhere")))


def _rename_main(m):
    m.main.name = "body"


def _broadcast_other_shape(m):
    """The broadcast's result (and everything computed from it) is f32[3] instead of
    f32[2]: only the broadcast's own rule is broken, every op after it still types."""
    op = op_named(m, BC)
    keep = op.operands[0]

    def widen(ty):
        if isinstance(ty, PlacedType):
            return dataclasses.replace(ty, member=widen(ty.member))
        return t("f32", 3) if ty == t("f32", 2) else ty

    values = {id(v): v for _, o in walk(m.main.body) for v in o.results}
    values.update({id(v): v for _, o in walk(m.main.body) for r in o.regions for v in r.params})
    for v in values.values():
        if v is not keep:
            retype(v, widen(v.type))


def _yield_other_value(m):
    r = map_region(m)
    r.results[1] = r.results[0]


def _wrong_level_broadcast(m):
    op_named(m, BC, 1).attrs["to"] = "silos"


CASES = [
    # fed.broadcast: T@p -> T@child!
    Case(BC, "C1", "flat", add_result(BC), "two results"),
    Case(BC, "C1", "flat", drop_operand(BC, 0), "no operand"),
    Case(BC, "C2", "flat", set_operand(BC, 0, lambda m: param(m, 1)), "operand at clients"),
    Case(
        BC,
        "C2",
        "hier",
        set_operand(BC, 0, lambda m: map_region(m).params[1], 1),
        "clients-placed operand inside silo body",
    ),
    Case(BC, "C3", "flat", set_attr(BC, "to", "server"), "to server"),
    Case(BC, "C3", "flat", set_attr(BC, "to", _DELETE), "to missing"),
    Case(BC, "C3", "hier", _wrong_level_broadcast, "to silos from inside a silo"),
    Case(
        BC,
        "C4",
        "flat",
        retype_result(BC, placed(t("f32", 2))),
        "result not all-equal",
    ),
    Case(BC, "C4", "flat", _broadcast_other_shape, "result shape, consistently used"),
    # fed.map: {T...}@p -> {U...}@p
    Case(MAP, "C1", "flat", lambda m: map_region(m).params.append(Value(t("f32"))), "param"),
    Case(MAP, "C1", "flat", lambda m: op_named(m, MAP).regions.clear(), "no region"),
    Case(
        MAP,
        "C1",
        "flat",
        lambda m: op_named(m, MAP).results.append(Value(placed(t("f32")))),
        "result without a yielded value",
    ),
    Case(MAP, "C2", "flat", set_operand(MAP, 0, lambda m: param(m, 0)), "server operand"),
    Case(
        MAP,
        "C2",
        "hier",
        set_operand(MAP, 0, lambda m: map_region(m).params[0], 1),
        "silos operand mapped over clients",
    ),
    Case(
        MAP,
        "C3",
        "flat",
        lambda m: retype(map_region(m).params[1], t("f32", 7)),
        "param shape differs from operand member",
    ),
    Case(
        MAP,
        "C4",
        "flat",
        lambda m: retype(op_named(m, MAP).results[0], placed(t("f32", 2), all_equal=True)),
        "result all-equal",
    ),
    Case(MAP, "C4", "flat", _yield_other_value, "yield type differs from result member"),
    # reductions
    *reduction_cases("fed.sum", server(t("f32", 3))),
    *reduction_cases("fed.mean", server(t("f32", 2, 1))),
    Case(
        "fed.mean",
        "C2",
        "hier",
        set_operand("fed.mean", 0, lambda m: map_region(m).params[0]),
        "silo-local operand reduced inside the silo body",
    ),
    Case(
        "fed.mean",
        "C3",
        "flat",
        retype_result("fed.mean", server(t("i32")), 1),
        "mean of i32 typed i32 (must be f32)",
    ),
    *reduction_cases("fed.min", server(t("bf16", 2))),
    *reduction_cases("fed.max", placed(t("f32", 2))),
    *reduction_cases(SS, server(t("i32", 1))),
    Case(SS, "C4", "flat", set_operand(SS, 0, lambda m: param(m, 3)), "float operand"),
    *reduction_cases(MED, server(t("f32", 3))),
    Case(MED, "C4", "flat", set_operand(MED, 0, lambda m: param(m, 2)), "i32 operand"),
    *reduction_cases(TM, server(t("bf16", 2))),
    Case(TM, "C4", "flat", set_operand(TM, 0, lambda m: param(m, 2)), "i32 operand"),
    Case(TM, "C5", "flat", set_attr(TM, "trim", -1), "trim -1"),
    Case(TM, "C5", "flat", set_attr(TM, "trim", 2), "trim 2 of 3 members drops all"),
    Case(TM, "C5", "flat", set_attr(TM, "trim", True), "trim bool"),
    Case(TM, "C5", "flat", set_attr(TM, "trim", _DELETE), "trim missing"),
    *reduction_cases(KR, server(t("f32", 2)), ROBUST),
    Case(KR, "C4", ROBUST, set_operand(KR, 0, lambda m: param(m, 2)), "i32 operand"),
    Case(KR, "C5", ROBUST, set_attr(KR, "f", 1), "f 1 of 3 members leaves no neighbour"),
    Case(KR, "C5", ROBUST, set_attr(KR, "f", -1), "f -1"),
    Case(KR, "C6", ROBUST, set_attr(KR, "m", 0), "m 0"),
    Case(KR, "C6", ROBUST, set_attr(KR, "m", 4), "m 4 of 3 members"),
    *reduction_cases(MK, server(t("f32", 3)), ROBUST),
    Case(MK, "C4", ROBUST, set_operand(MK, 0, lambda m: param(m, 2)), "i32 operand"),
    Case(MK, "C5", ROBUST, set_attr(MK, "f", 1), "f 1 of 3 members leaves no neighbour"),
    Case(MK, "C6", ROBUST, set_attr(MK, "m", 4), "m 4 of 3 members"),
    *reduction_cases(BS, server(t("f32", 2, 2)), ROBUST),
    Case(BS, "C4", ROBUST, set_operand(BS, 0, lambda m: param(m, 2)), "i32 operand"),
    Case(BS, "C5", ROBUST, set_attr(BS, "f", 1), "f 1 needs 7 members, not 3"),
    *reduction_cases(BY, server(t("f32", 3)), ROBUST),
    Case(BY, "C4", ROBUST, set_operand(BY, 0, lambda m: param(m, 2)), "i32 operand"),
    Case(BY, "C5", ROBUST, set_attr(BY, "f", 1), "f 1 needs 7 members, not 3"),
    *reduction_cases(GM, server(t("f32", 3)), ROBUST),
    Case(GM, "C4", ROBUST, set_operand(GM, 0, lambda m: param(m, 2)), "i32 operand"),
    Case(GM, "C5", ROBUST, set_attr(GM, "iters", -1), "iters -1"),
    Case(GM, "C6", ROBUST, set_attr(GM, "eps", 0.0), "eps 0"),
    *reduction_cases(BE, server(t("f32", 9, 3)), ROBUST),
    Case(BE, "C4", ROBUST, set_operand(BE, 0, lambda m: param(m, 2)), "i32 operand"),
    Case(BE, "C5", ROBUST, set_attr(BE, "trim", 2), "trim 2 of 3 members keeps none"),
    *reduction_cases(MI, placed(t("f32")), ROBUST),
    Case(SS, "C5", "flat", set_attr(SS, "bitwidth", 0), "bitwidth 0"),
    Case(SS, "C5", "flat", set_attr(SS, "bitwidth", 33), "bitwidth 33 for i32"),
    Case(SS, "C5", "flat", set_attr(SS, "bitwidth", True), "bitwidth bool"),
    Case(SS, "C5", "flat", set_attr(SS, "bitwidth", "16"), "bitwidth string"),
    Case(SS, "C5", "flat", set_attr(SS, "bitwidth", _DELETE), "bitwidth missing"),
    # fed.weighted_mean
    Case(WM, "C1", "flat", drop_operand(WM, 1), "no weights"),
    Case(WM, "C2", "flat", set_operand(WM, 1, lambda m: param(m, 0)), "server weights"),
    Case(WM, "C2", "flat", set_operand(WM, 0, lambda m: param(m, 0)), "server values"),
    Case(WM, "C3", "flat", set_operand(WM, 1, lambda m: param(m, 1)), "weights f32[4]"),
    Case(
        WM,
        "C4",
        "flat",
        lambda m: retype(param(m, 3), placed(t("bool"))),
        "bool weights",
    ),
    Case(WM, "C5", "flat", retype_result(WM, server(t("f32"))), "result shape"),
    Case(WM, "C5", "flat", retype_result(WM, placed(t("f32", 2))), "result placed"),
    # local ops
    Case(
        "local",
        "C1",
        "flat",
        lambda m: m.main.body.ops.insert(
            1, Op("jax.reduce_sum", [param(m, 1)], [Value(server(t("f32", 4)))], {})
        ),
        "jnp.sum over the member axis at the server",
        error=PlacementError,
    ),
    Case(
        "local",
        "C1",
        "flat",
        lambda m: m.main.body.ops.insert(1, Op("jax.iota", [], [Value(placed(t("i32", 2)))], {})),
        "local op produces a placed value",
        error=PlacementError,
    ),
    Case(
        "local",
        "C2",
        SERVER_PLUS_PLACED,
        _noop,
        "elementwise op mixing a placed and a non-scalar server value",
        error=PlacementError,
        reported="local/C1",
    ),
    Case("local", "C3", PSUM_IN_MAP, _noop, "psum inside a map", error=PlacementError),
    # regions
    Case("region", "C1", "flat", _use_before_def, "use before def", IRTypeError),
    Case("region", "C1", "flat", _yield_undefined, "yield of undefined value", IRTypeError),
    Case("region", "C2", "flat", _redefine_param, "op redefines a param", IRTypeError),
    Case("region", "C2", "flat", _redefine_in_func, "redefined func param", IRTypeError),
    # modules
    Case(
        "module",
        "C1",
        "flat",
        lambda m: m.placements.append(("clients", N)),
        "placement repeated",
        PlacementError,
    ),
    Case(
        "module",
        "C1",
        "flat",
        lambda m: m.placements.append(("server", 2)),
        "placement named server",
        PlacementError,
    ),
    Case(
        "module",
        "C2",
        "flat",
        lambda m: m.placements.__setitem__(0, ("clients", 0)),
        "cardinality 0",
        PlacementError,
    ),
    Case("module", "C3", "flat", _rename_main, "no main", IRTypeError),
    Case(
        "module",
        "C4",
        "flat",
        _undeclared_placement_param,
        "undeclared placement",
        PlacementError,
    ),
    Case(
        "module",
        "C5",
        "flat",
        lambda m: setattr(m, "name", "my round\nfunc"),
        "module name that would not parse",
        IRTypeError,
    ),
    # unknown ops
    Case(
        "fed",
        "C0",
        "flat",
        lambda m: setattr(op_named(m, "fed.max"), "name", "fed.gather"),
        "unknown fed op",
        IRTypeError,
    ),
    Case(
        "op",
        "C0",
        "flat",
        lambda m: setattr(op_named(m, "jax.div"), "name", "torch.div"),
        "unknown namespace",
        IRTypeError,
    ),
    # control flow: operands -> region parameters, yields -> results
    # A binding the attributes cannot describe is what the primitive's own type rule
    # rejects too: fcir.checker.local_ops's local/C5 reports it in its stead.
    Case("flow", "C1", ROBUST_OR_MEAN.replace("[^0, ^1]", "[^0, ^2]"), _noop,
         "cond branch names no region", IRTypeError, reported="local/C5"),
    Case("flow", "C1", CARRY_LOOP.replace("num_consts=0", "num_consts=2"), _noop,
         "scan attributes disagree with its operands", IRTypeError, reported="local/C5"),
    Case("flow", "C2", ROBUST_OR_MEAN.replace("%5: {f32[2]}@clients", "%5: f32[2]@clients!"),
         _noop, "branch parameter typed all-equal", PlacementError),
    Case("flow", "C3", ROBUST_OR_MEAN.replace("yield %6", "yield %5"), _noop,
         "branch yields client data as a server result", PlacementError),
    Case("flow", "C3", CARRY_LOOP.replace("yield %4", "yield %3"), _noop,
         "loop yields a server scalar for a client carry", PlacementError),
    Case("flow", "C4", ROBUST_OR_MEAN.replace("jax.cond %1, %0", "jax.cond %0, %0"), _noop,
         "branch index placed at the clients", PlacementError),
    Case("local", "C1", CARRY_LOOP.replace(
        "      yield %4", "      %5: f32[2]@server = jax.reduce_sum %2 {axes=[0]}\n      yield %4"
    ), _noop,
         "server op in a loop body reads the carried client data", PlacementError,
         reported="local/C1"),
]


# fed.dp_sum / fed.dp_mean: ({T..}@child, key) -> (T..), from canonical text.
DP_TEXT = """\
fcir.module @dp ir_version=1 placements=[clients:3]
func @main(%0: {f32[2]}@clients, %1: {f32[]}@clients, %2: u32[2]@server, %3: f32[2]@server) \
-> (f32[2]@server, f32[]@server) {
  %4: f32[2]@server, %5: f32[]@server = OP %0, %1, %2 {clip_norm=1.0, noise_multiplier=1.1}
  return %4, %5
}
"""


def _int_dp_operand(op):
    def mutate(m):
        retype(param(m, 1), placed(t("i32")))
        retype(op_named(m, op).results[1], server(t("i32")))

    return mutate


def dp_cases(op: str) -> list:
    text = DP_TEXT.replace("OP", op)
    return [
        Case(op, "C1", text, add_result(op), "more results than values"),
        Case(op, "C1", text, lambda m: op_named(m, op).operands.clear(), "no operands"),
        Case(op, "C2", text, set_operand(op, 0, lambda m: param(m, 3)), "server value"),
        Case(op, "C3", text, set_operand(op, 2, lambda m: param(m, 3)), "f32 key"),
        Case(op, "C3", text, set_operand(op, 2, lambda m: param(m, 0)), "placed key"),
        Case(op, "C4", text, _int_dp_operand(op), "integer values"),
        Case(op, "C5", text, set_attr(op, "clip_norm", 0.0), "zero clip norm"),
        Case(op, "C5", text, set_attr(op, "noise_multiplier", -1.0), "negative noise"),
        Case(op, "C5", text, set_attr(op, "clip_norm", 1), "int clip norm"),
        Case(op, "C6", text, retype_result(op, server(t("f32", 3))), "result shape"),
        Case(op, "C7", text, set_attr(op, "clip_norm", 2e38), "clipped sum overflows f32"),
        Case(op, "C8", text, set_attr(op, "gamma", 0.1), "gamma not a power of two"),
        Case(op, "C8", text, set_attr(op, "gamma", 2.0**-30), "grid integers past 2**24"),
    ]


CASES += dp_cases("fed.dp_sum") + dp_cases("fed.dp_mean")


# fed.ddp_sum / fed.ddp_mean: ({T..}@child, {key}@child) -> (T..).
DDP_TEXT = """\
fcir.module @ddp ir_version=1 placements=[clients:3]
func @main(%0: {f32[2]}@clients, %1: {f32[]}@clients, %2: {u32[2]}@clients, \
%3: f32[2]@server, %4: u32[2]@server) -> (f32[2]@server, f32[]@server) {
  %5: f32[2]@server, %6: f32[]@server = OP %0, %1, %2 {bits=16, clip_norm=1.0, \
noise_multiplier=1.1}
  return %5, %6
}
"""


def _broadcast_keys(op):
    def mutate(m):
        from fcir.ir import Op, Value
        from fcir.ir.types import PlacedType

        key = param(m, 4)
        out = Value(PlacedType(t("u32", 2), "clients", True))
        m.main.body.ops.insert(0, Op("fed.broadcast", [key], [out], {"to": "clients"}))
        op_named(m, op).operands[2] = out

    return mutate


def ddp_cases(op: str) -> list:
    text = DDP_TEXT.replace("OP", op)
    return [
        Case(op, "C1", text, add_result(op), "more results than values"),
        Case(op, "C1", text, lambda m: op_named(m, op).operands.clear(), "no operands"),
        Case(op, "C2", text, set_operand(op, 0, lambda m: param(m, 3)), "server value"),
        Case(op, "C3", text, set_operand(op, 2, lambda m: param(m, 4)), "server key"),
        Case(op, "C3", text, set_operand(op, 2, lambda m: param(m, 0)), "f32 keys"),
        Case(op, "C3", text, _broadcast_keys(op), "one key broadcast to all"),
        Case(op, "C4", text, _int_dp_operand(op), "integer values"),
        Case(op, "C5", text, set_attr(op, "clip_norm", 0.0), "zero clip norm"),
        Case(op, "C5", text, set_attr(op, "noise_multiplier", -1.0), "negative noise"),
        Case(op, "C6", text, retype_result(op, server(t("f32", 3))), "result shape"),
        Case(op, "C7", text, set_attr(op, "bits", 40), "bits above 24"),
        Case(op, "C7", text, set_attr(op, "bits", 16.0), "float bits"),
        Case(op, "C8", text, set_attr(op, "min_clients", 3), "min_clients = n (absent)"),
        Case(op, "C8", text, set_attr(op, "min_clients", 0), "min_clients 0"),
        Case(op, "C8", text, set_attr(op, "min_clients", 2.0), "float min_clients"),
    ]


CASES += ddp_cases("fed.ddp_sum") + ddp_cases("fed.ddp_mean")

def build(case: Case) -> Module:
    if case.program in ("flat", "hier"):
        m = fresh(case.program)
    else:
        m = fcir.parse(case.program)
    case.mutate(m)
    return m


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_violation_is_reported(case: Case):
    m = build(case)
    diags = verify(m)
    assert [d.code for d in diags] == [case.expected_code], [str(d) for d in diags]
    (diag,) = diags
    assert diag.placement == (case.expected_error is PlacementError)
    with pytest.raises(case.expected_error) as info:
        fcir.check(m)
    msg = str(info.value)
    # The message quotes the constraint ("fed.broadcast/C2: ...") and names the op.
    assert f"{case.expected_code}: " in msg
    if case.op in FED_OPS:
        op_name = case.op
        assert msg.startswith(f"{op_name} (op "), msg
        assert FED_OPS[case.op].constraints[case.constraint] in msg
    elif case.op in ("local", "fed", "op"):
        assert re.match(r"^[a-z_]+\.[a-z_.]+ \(op [\d/]+", msg), msg
    elif case.op == "region":
        assert re.match(r"^(func @main|[a-z_]+\.[a-z_.]+ \(op [\d/]+)", msg), msg


def checker_codes() -> set[str]:
    """Every ``area/Cn`` code the checker reports or documents."""
    # fcir.check is also the name of the function; import the module itself.
    src = inspect.getsource(importlib.import_module("fcir.checker.check"))
    return set(re.findall(r"\b((?:local|region|module|fed|op|flow)/C\d+)\b", src))


def test_every_constraint_has_a_negative_test():
    want = {f"{name}/{c}" for name, rule in FED_OPS.items() for c in rule.constraints}
    want |= checker_codes()
    assert {"local/C1", "local/C2", "local/C3", "region/C1", "region/C2"} <= want
    assert {"module/C1", "module/C2", "module/C3", "module/C4"} <= want
    have = {c.code for c in CASES}
    missing = sorted(want - have)
    assert not missing, f"constraints without a negative test in CASES: {missing}"
    assert sorted(have - want) == [], "CASES name constraints that do not exist"


def test_placement_constraints_are_declared_constraints():
    for name, rule in FED_OPS.items():
        assert rule.placement_constraints <= set(rule.constraints), name
        for code, text in rule.constraints.items():
            assert re.fullmatch(r"C\d+", code) and text, (name, code)


def test_all_violations_are_listed():
    m = fresh("flat")
    op_named(m, BC).attrs["to"] = "server"
    retype(op_named(m, "fed.sum").results[0], server(t("f32", 9)))
    diags = verify(m)
    assert [d.code for d in diags] == ["fed.broadcast/C3", "fed.sum/C3"]
    with pytest.raises(PlacementError) as info:
        fcir.check(m)
    assert "(and 1 more)" in str(info.value) and "fed.sum/C3" in str(info.value)


def test_local_c2_elementwise_on_placed_values_is_per_member():
    """The local/C2 exception: elementwise ops on one placement stay per-member."""

    @fcir.program(placements={"clients": N})
    def scaled(x):
        y = x * 2.0 + 1.0
        return fcir.reduce_sum(y)

    m = fcir.capture(scaled, sds((N, 2)))
    muls = ops_named(m, "jax.mul")
    assert muls and all(str(op.results[0].type) == "{f32[2]}@clients" for op in muls)


# --- client-to-client communication in real programs -----------------------------------


@fcir.program(placements={"clients": N})
def reads_one_member(x):
    doubled = fcir.map_fn(lambda a: a * 2, x)
    return x[0] + fcir.reduce_sum(doubled)


@fcir.program(placements={"clients": N})
def sums_member_axis(x):
    doubled = fcir.map_fn(lambda a: a * 2, x)
    return jnp.sum(x, 0) + fcir.reduce_sum(doubled)


@fcir.program(placements={"clients": N})
def psum_in_body(x):
    return fcir.reduce_sum(fcir.map_fn(lambda a: jax.lax.psum(a, "clients"), x))


@fcir.program(placements={"clients": N})
def implicit_broadcast(model, x):
    # model is a server value used per member without fcir.broadcast
    return fcir.reduce_sum(x * model)


C2C = {
    "reads_one_member": (reads_one_member, (sds((N, 2)),)),
    "sums_member_axis": (sums_member_axis, (sds((N, 2)),)),
    "implicit_broadcast": (implicit_broadcast, (sds((2,)), sds((N, 2)))),
}


@pytest.mark.parametrize("name", sorted(C2C))
def test_client_to_client_is_rejected_by_capture(name):
    fn, args = C2C[name]
    with pytest.raises(PlacementError, match=r"local/C1: .*client-to-client") as info:
        fcir.capture(fn, *args)
    assert re.match(r"^jax\.\w+ \(op \d+", str(info.value))


@pytest.mark.parametrize("name", sorted(C2C))
def test_client_to_client_is_reported_for_unchecked_capture(name):
    fn, args = C2C[name]
    m = capture_unchecked(fn, *args)
    codes = [d.code for d in verify(m)]
    assert codes[0] == "local/C1", codes
    # The module still prints and parses, so `fcir check` can report it from a file.
    assert [d.code for d in verify(fcir.parse(m.to_text()))] == codes


def test_collective_over_placement_axis_fails_at_trace_time():
    with pytest.raises(PlacementError, match="client-to-client") as info:
        fcir.capture(psum_in_body, sds((N, 2)))
    assert "'clients'" in str(info.value)
    with pytest.raises(PlacementError, match="collective over the placement axis"):
        jax.jit(psum_in_body).trace(jnp.ones((N, 2)))


def test_fcir_check_reports_client_to_client(tmp_path, capsys):
    src = tmp_path / "c2c.py"
    src.write_text(
        textwrap.dedent(
            """
            import jax, jax.numpy as jnp, fcir

            @fcir.program(placements={"clients": 3})
            def bad(x):
                return jnp.sum(x, 0) + fcir.reduce_sum(fcir.map_fn(lambda a: a * 2, x))

            @fcir.program(placements={"clients": 3})
            def good(x):
                return fcir.reduce_sum(fcir.map_fn(lambda a: a * 2, x))

            EXAMPLE_ARGS = {"bad": lambda: jnp.ones((3, 2)), "good": lambda: jnp.ones((3, 2))}
            """
        )
    )
    assert cli.main(["check", f"{src}:bad"]) == 1
    out = capsys.readouterr().out
    assert "local/C1" in out and "jax.reduce_sum" in out and "1 error(s)" in out
    assert cli.main(["check", f"{src}:good"]) == 0
    assert "ok" in capsys.readouterr().out
    # Also from an IR file written from the unchecked capture.
    ir = tmp_path / "bad.fcir"
    ir.write_text(capture_unchecked(sums_member_axis, sds((N, 2))).to_text())
    assert cli.main(["check", str(ir)]) == 1
    assert "local/C1" in capsys.readouterr().out


# --- cardinality --------------------------------------------------------------------------


@fcir.program(placements={"clients": N})
def mapped(x):
    return fcir.reduce_sum(fcir.map_fn(jnp.sin, x))


@fcir.program(placements={"clients": N})
def reduced(x):
    return fcir.reduce_mean(x)


@fcir.program(placements={"clients": N})
def weighted(x, w):
    return fcir.reduce_weighted_mean(x, w)


@pytest.mark.parametrize(
    "fn,args",
    [
        (mapped, (sds((N + 1, 2)),)),
        (mapped, (sds(()),)),
        (reduced, (sds((N - 1,)),)),
        (weighted, (sds((N, 2)), sds((N + 2,)))),
    ],
    ids=["map_fn", "map_fn_scalar", "reduce_mean", "weighted_mean_weights"],
)
def test_cardinality_mismatch_is_placement_error_at_trace_time(fn, args):
    with pytest.raises(PlacementError, match=rf"cardinality of 'clients' \({N}\)"):
        fcir.capture(fn, *args)
    with pytest.raises(PlacementError):
        jax.eval_shape(fn, *args)
    concrete = [np.zeros(a.shape, np.float32) for a in args]
    with pytest.raises(PlacementError):
        jax.jit(fn)(*concrete)
