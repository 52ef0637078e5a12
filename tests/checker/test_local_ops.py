"""A module that passes ``fcir.check`` is true, and runs or fails with an FcirError
naming what went wrong: local ops' result types are re-derived from their primitives
(``local/C4``), attributes and operands the primitive would refuse are check errors
(``local/C5``, ``local/C6``), values too large for XLA's shape arithmetic are
``value/C1``; collectives in a shard_map are no false positives."""

from __future__ import annotations

import dataclasses
import pathlib

import jax.numpy as jnp
import numpy as np
import pytest
from fcir.interpreters import reference, xla
from hostile_ir import FUZZ, SUM
from hypothesis import given
from hypothesis import strategies as st

import fcir
from fcir.checker import local_ops as check_local
from fcir.checker.check import verify
from fcir.errors import FcirError, InterpreterError, IRTypeError
from fcir.ir import attrs as A
from fcir.ir import walk
from fcir.ir.types import PlacedType, TensorType

GOLDEN = pathlib.Path(__file__).parents[1] / "golden"


# --- shared ------------------------------------------------------------------------------


# --- local op result types are derived, not trusted ------------------------------

# A placed elementwise op (local/C2), a constant, a multi-result op and a scan.
LOCAL = """\
fcir.module @local ir_version=1 placements=[clients:3]
func @main(%0: {f32[4]}@clients, %1: f32[4]@server) -> ({f32[4]}@clients, f32[2]@server, f32[2,4]@server) {
  %2: f32[]@server = fcir.constant {value=dense<f32[]: 2.0>}
  %3: {f32[4]}@clients = jax.mul %0, %2
  %4: f32[2]@server, %5: f32[2]@server = jax.split %1 {axis=0, sizes=[2, 2]}
  %6: f32[4]@server, %7: f32[2,4]@server = jax.scan %1 {jaxpr=^0, length=2, num_carry=1, num_consts=0, reverse=false, unroll=1} {
    ^r0(%8: f32[4]@server):
      yield %8, %8
  }
  return %3, %5, %7
}
"""

DOT = """\
fcir.module @dot ir_version=1 placements=[]
func @main(%0: f32[4]@server, %1: f32[4]@server) -> (f32[]@server) {
  %2: f32[]@server = jax.dot_general %0, %1 {dimension_numbers=[[[0], [0]], [[], []]], out_sharding=none, precision=none, preferred_element_type=f32}
  return %2
}
"""

CALL = """\
fcir.module @call ir_version=1 placements=[]
func @main(%0: f32[3]@server) -> (f32[3]@server) {
  %1: f32[3]@server = jax.jit %0 {compiler_options_kvs=[], ctx_mesh=#AbstractMesh<axis_names=[], axis_sizes=[], axis_types=[]>, donated_invars=[false], in_layouts=[none], in_shardings=[#Sharding.UNSPECIFIED], inline=false, jaxpr=^0, keep_unused=false, name="sin", out_layouts=[none], out_shardings=[#Sharding.UNSPECIFIED]} {
    ^r0(%2: f32[3]@server):
      %3: f32[3]@server = jax.sin %2 {accuracy=none}
      yield %3
  }
  return %1
}
"""


@dataclasses.dataclass
class Case:
    code: str
    text: str
    edits: tuple[tuple[str, str], ...]  # textual replacements that break the module
    what: str
    op: str  # the op the error names ("func @main" for a parameter)

    @property
    def id(self) -> str:
        return f"{self.code}:{self.what.replace(' ', '_')}"

    def module(self) -> fcir.Module:
        text = self.text
        for old, new in self.edits:
            assert old in text, old
            text = text.replace(old, new)
        return fcir.parse(text)


CASES = [
    Case("local/C4", SUM, (("f32[]", "f32[1000]"),), "reduce_sum of f32[4] declared f32[1000]",
         "jax.reduce_sum"),
    Case("local/C4", SUM, (("axes=[0]", "axes=[]"),), "attribute changes the result type",
         "jax.reduce_sum"),
    Case("local/C4", LOCAL, (("%3: {f32[4]}@clients = jax.mul", "%3: {i32[4]}@clients = jax.mul"),
                             ("-> ({f32[4]}@clients", "-> ({i32[4]}@clients")),
         "placed elementwise member dtype", "jax.mul"),
    Case("local/C4", LOCAL, (("dense<f32[]: 2.0>", "dense<f32[1]: [2.0]>"),),
         "constant value of another type", "fcir.constant"),
    Case("local/C4", LOCAL, (("sizes=[2, 2]", "sizes=[1, 3]"),), "split sizes", "jax.split"),
    Case("local/C4", LOCAL, (("length=2", "length=3"),), "scan length", "jax.scan"),
    Case("local/C5", DOT, (("precision=none", "precision=3"),),
         "precision that aborts lowering", "jax.dot_general"),
    Case("local/C5", DOT, (("out_sharding=none", "out_sharding=true"),),
         "mistyped out_sharding", "jax.dot_general"),
    Case("local/C5", DOT, (("precision=none", "precision=#Nowhere.HIGHEST"),),
         "enum of no JAX type", "jax.dot_general"),
    Case("local/C5", DOT, (("%1: f32[4]@server)", "%1: f32[5]@server)"),),
         "operands the primitive refuses", "jax.dot_general"),
    Case("local/C5", CALL, (("jaxpr=^0", "jaxpr=^1"),), "region reference out of range",
         "jax.jit"),
    Case("local/C5", CALL, (("in_shardings=[#Sharding.UNSPECIFIED]", "in_shardings=[]"),),
         "one sharding per operand", "jax.jit"),
    Case("local/C6", CALL, (("^r0(%2: f32[3]@server)", "^r0(%2: f32[3]@server, %9: f32[]@server)"),),
         "call region takes another signature", "jax.jit"),
    Case("value/C1", SUM.replace("  %2: f32[]@server = jax.reduce_sum %1 {axes=[0], out_sharding=none}\n",
                                 "").replace("f32[]@server", "f32[4]@server").replace("%2", "%1"),
         (("clients:3", "clients:99999999"), ("f32[4]", "f32[99999999999]")),
         "99999999 clients of f32[99999999999]", "func @main"),
]


def test_every_check_local_constraint_has_a_case():
    assert {c.code for c in CASES} == set(check_local.CONSTRAINTS)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_check_local_violation_is_reported(case: Case):
    m = case.module()
    assert [d.code for d in verify(m)] == [case.code], [str(d) for d in verify(m)]
    with pytest.raises(IRTypeError) as info:
        fcir.check(m)
    msg = str(info.value)
    assert msg.startswith(case.op), msg  # names the op (and its place in the module)
    assert f"{case.code}: " in msg


def test_reduce_sum_declared_f32_1000_is_an_error_that_names_the_derived_type():
    m = CASES[0].module()
    with pytest.raises(IRTypeError, match=r"^jax.reduce_sum \(op 1, defining %2\): local/C4: "
                       r"result 0 has type f32\[1000\]@server .* primitive gives f32\[\]"):
        fcir.check(m)
    assert fcir.check(fcir.parse(SUM))  # the unbroken module checks


def test_good_modules_check_and_run():
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    m = fcir.check(fcir.parse(LOCAL))
    a, b, c = reference.run(m, x, x[0])
    np.testing.assert_array_equal(a, 2 * x)
    np.testing.assert_array_equal(b, x[0, 2:])
    np.testing.assert_array_equal(c, np.stack([x[0], x[0]]))
    fcir.check(fcir.parse(CALL))
    fcir.check(fcir.parse(DOT))


@pytest.mark.parametrize("path", sorted(GOLDEN.glob("*.fcir")), ids=lambda p: p.stem)
def test_every_golden_checks(path):
    """The derivation has no false positives on the corpus (and its gradients)."""
    fcir.check(fcir.parse(path.read_text()))


def test_check_derives_each_signature_once():
    """Checking stays linear: ops with one signature share one abstract evaluation."""

    @fcir.program(placements={"clients": 2})
    def chain(w, x):
        def body(w, x):
            y = w * x
            for _ in range(40):
                y = jnp.sin(y) + x
            return y

        return fcir.reduce_mean(fcir.map_fn(body, (fcir.broadcast(w), x)))

    m = fcir.capture(chain, jnp.ones(3), jnp.ones((2, 3)))
    check_local.clear_cache()
    fcir.check(m)
    ops = sum(1 for _ in walk(m.main.body))
    assert ops > 80 and len(check_local._CACHE) <= 6


def test_xla_failure_at_run_time_is_an_interpreter_error_naming_the_program():
    # 2**50 bytes: past any address space, so XLA's allocation fails on every machine.
    n = 1 << 48
    text = f"""\
fcir.module @huge ir_version=1 placements=[]
func @main(%0: f32[]@server) -> (f32[{n}]@server) {{
  %1: f32[{n}]@server = jax.broadcast_in_dim %0 {{broadcast_dimensions=[], shape=[{n}], sharding=none}}
  return %1
}}
"""
    exe = xla.compile(fcir.parse(text))
    with pytest.raises(InterpreterError, match="@huge: XLA could not run the program"):
        exe(np.float32(1))


# A small module with a placed elementwise op, a call, control flow and attributes.
FUZZ_BASE = """\
fcir.module @fz ir_version=1 placements=[clients:2]
func @main(%0: {f32[3]}@clients, %1: f32[3]@server, %2: i32[]@server) -> (f32[3]@server, f32[]@server, f32[3]@server) {
  %3: {f32[3]}@clients = jax.sin %0 {accuracy=none}
  %4: f32[3]@server = fed.mean %3
  %5: f32[]@server = jax.dot_general %4, %1 {dimension_numbers=[[[0], [0]], [[], []]], out_sharding=none, precision=none, preferred_element_type=f32}
  %6: f32[]@server = jax.convert_element_type %2 {new_dtype=f32, sharding=none, weak_type=false}
  %7: f32[3]@server = jax.broadcast_in_dim %5 {broadcast_dimensions=[], shape=[3], sharding=none}
  %8: f32[3]@server = jax.cumsum %7 {axis=0, reverse=false}
  return %8, %5, %4
}
"""

_POOL = [None, True, False, 0, 1, 3, -1, 2**40, 1.5, "x", (), (0,), (1, 0), (3,), (None,),
         A.DType("i8"), A.DType("f16"), A.Enum("Precision", "HIGHEST"),
         A.Enum("Sharding", "UNSPECIFIED"), A.RegionRef(0),
         A.Record("PartitionSpec", (("spec", ("x",)),))]


@st.composite
def _mutated(draw):
    m = fcir.parse(FUZZ_BASE)
    ops = [op for _, op in walk(m.main.body)]
    values = [*m.main.body.params, *(v for op in ops for v in op.results)]
    for _ in range(draw(st.integers(1, 2))):
        if draw(st.booleans()):
            v = draw(st.sampled_from(values))
            t = v.type
            member = t.member if isinstance(t, PlacedType) else t
            shape = draw(st.lists(st.integers(0, 4), max_size=2).map(tuple))
            dtype = draw(st.sampled_from(["f32", "f16", "i32", "bool", member.dtype]))
            new = TensorType(dtype, shape)
            v.type = dataclasses.replace(t, member=new) if isinstance(t, PlacedType) else new
        else:
            op = draw(st.sampled_from([op for op in ops if op.attrs]))
            key = draw(st.sampled_from(sorted(op.attrs)))
            op.attrs[key] = draw(st.sampled_from(_POOL))
    return m


@FUZZ
@given(_mutated())
def test_mutated_module_that_checks_runs_or_raises_an_fcir_error(m):
    try:
        fcir.check(m)
    except FcirError:
        return
    from fcir.ir.types import runtime_type

    args = [np.ones(runtime_type(v.type, m.cardinality).shape,
                    runtime_type(v.type, m.cardinality).np_dtype) for v in m.main.body.params]
    try:
        reference.run(m, *args)
    except FcirError:
        pass


def test_fuzz_base_checks_and_runs():
    m = fcir.check(fcir.parse(FUZZ_BASE))
    reference.run(m, np.ones((2, 3), np.float32), np.ones(3, np.float32), np.int32(2))


def test_check_cache_tells_true_from_one():
    # True == 1 in Python: a derivation cached for weak_type=1 (an error) must not be
    # what weak_type=true gets, in either order.
    bad = FUZZ_BASE.replace("weak_type=false", "weak_type=1")
    good = FUZZ_BASE.replace("weak_type=false", "weak_type=true")
    for _ in range(2):
        with pytest.raises(FcirError, match="weak_type must be true or false, got 1"):
            fcir.check(fcir.parse(bad))
        fcir.check(fcir.parse(good))


def test_collectives_in_a_shard_map_are_not_false_positives():
    """A collective's type needs its axis sizes, bound only by the enclosing shard_map's
    mesh: check leaves them (and shard_map's per-shard region) underived."""
    text = """\
fcir.module @sm ir_version=1 placements=[]
func @main(%0: f32[4]@server) -> (f32[4]@server) {
  %1: f32[4]@server = jax.shard_map %0 {check_vma=true, in_specs=[#PartitionSpec<spec=["i"]>], jaxpr=^0:open, mesh=#AbstractMesh<axis_names=["i"], axis_sizes=[1], axis_types=[#AxisType.Explicit]>, newly_manual_axes=["i"], out_specs=[#PartitionSpec<spec=[]>]} {
    ^r0(%2: f32[4]@server):
      %3: f32[4]@server = jax.psum_invariant %2 {axes=["i"]}
      yield %3
  }
  return %1
}
"""
    assert verify(fcir.parse(text)) == []
