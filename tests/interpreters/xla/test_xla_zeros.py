"""The XLA backend's removal of structural zeros (fcir/interpreters/xla/zeros.py).

The zeros it starts from are the running JAX's (derivative ops, under JAX 0.12: see
test_golden_capture_mode.py for the programs that have them); here ``x - x`` stands in
for such an op, so the pass is pinned the same way on every JAX.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from corpus import case
from fcir.interpreters import reference, xla
from fcir.interpreters.xla import zeros
from test_xla import assert_bitwise, gradient

import fcir
from fcir.ir import walk
from fcir.jaxcompat import derivatives


def x_minus_x(op):
    """A stand-in source of structural zeros: ``jax.sub %x, %x`` (zero for finite x)."""
    same = op.name == "jax.sub" and op.operands[0] is op.operands[1]
    return frozenset({0}) if same else frozenset()


# One scan yields a zero (%11) and carries one (%8, from the zero %2); the next scan
# reads the zero ys as xs and adds them to its carry; %18 starts zero and stops being
# zero after one step; the zero carry is added to a result and negated.
TWO_SCANS = """\
fcir.module @two_scans ir_version=1 placements=[]
func @main(%0: f32[3]@server, %1: f32[4,3]@server) -> (f32[3]@server, f32[3]@server, f32[3]@server) {
  .args ($0, $1)
  .results ($0, $1, $2)
  %2: f32[3]@server = jax.sub %0, %0
  %3: f32[3]@server, %4: f32[3]@server, %5: f32[3]@server, %6: f32[4,3]@server, %7: f32[4,3]@server = jax.scan %0, %2, %2, %1 {jaxpr=^0, length=4, num_carry=3, num_consts=0, reverse=false, unroll=1} {
    ^r0(%8: f32[3]@server, %9: f32[3]@server, %18: f32[3]@server, %10: f32[3]@server):
      %12: f32[3]@server = jax.sin %10 {accuracy=none}
      %11: f32[3]@server = jax.sub %12, %12
      %13: f32[3]@server = jax.mul %8, %12 {out_dtype=none}
      %14: f32[3]@server = jax.add_any %9, %11
      %19: f32[3]@server = jax.add_any %18, %12
      yield %13, %14, %19, %11, %12
  }
  %15: f32[3]@server = jax.scan %3, %6, %7 {jaxpr=^0, length=4, num_carry=1, num_consts=0, reverse=false, unroll=1} {
    ^r0(%16: f32[3]@server, %17: f32[3]@server, %20: f32[3]@server):
      %21: f32[3]@server = jax.add_any %16, %17
      %22: f32[3]@server = jax.mul %21, %20 {out_dtype=none}
      yield %22
  }
  %23: f32[3]@server = jax.add_any %15, %4
  %24: f32[3]@server = jax.neg %4
  return %23, %24, %5
}
"""


def _args():
    rng = np.random.default_rng(0)
    return rng.uniform(0.5, 1.5, size=3).astype(np.float32), rng.uniform(
        0.5, 1.5, size=(4, 3)
    ).astype(np.float32)


def _scans(module):
    return [op for _, op in walk(module.main.body) if op.name == "jax.scan"]


def test_zero_scan_outputs_leave_the_scans_and_the_adds_of_them_go():
    module = fcir.parse(TWO_SCANS)
    out = zeros.without_structural_zeros(module, x_minus_x)
    fcir.check(out)
    first, second = _scans(out)
    # The zero carry and the zero ys leave the first scan; the carry that starts zero
    # but does not stay zero stays (it starts from %2, which still computes the zero).
    assert (len(first.operands), len(first.results), first.attrs["num_carry"]) == (3, 3, 2)
    assert (len(second.operands), second.attrs["num_carry"]) == (2, 1)
    ops = [op.name for _, op in walk(out.main.body)]
    assert ops.count("jax.add_any") == 1  # only %19: its other operand is not zero
    assert ops.count("jax.broadcast_in_dim") == 1  # neg's operand: no op computes it now
    args = _args()
    want = reference.run(module, *args)
    assert_bitwise(reference.run(out, *args), want)
    assert_bitwise(xla.compile(out)(*args), want)
    assert out.main.body.params == module.main.body.params
    assert fcir.parse(out.to_text()).to_text() == out.to_text()


def test_module_is_left_alone_without_structural_zeros():
    module = fcir.parse(TWO_SCANS)
    assert zeros.without_structural_zeros(module) is module  # no derivative op
    c = case("fedavg_mlp")
    grad = fcir.capture(gradient(c), *c.make_args())
    assert zeros.without_structural_zeros(grad) is grad


@pytest.mark.parametrize(
    "name", ["tanh_residual", "tanh_tangent", "tanh_cotangent", "tanh_cotangent_add"]
)
def test_zero_results_are_the_cotangents_that_are_zero_on_the_running_jax(name):
    # On JAX 0.12 tanh_tangent (g * r), tanh_cotangent (ct * r) and tanh_cotangent_add
    # (acc + ct * r) read no ans, so the cotangent of ans's tangent is zero; on 0.10.2
    # every cotangent reads its tangent.
    arity = derivatives._EXPRESSIONS[name][1]
    rng = np.random.default_rng(1)
    ans = np.tanh(rng.normal(size=5)).astype(np.float32)
    linear = [rng.normal(size=5).astype(np.float32) for _ in range(arity - 2)]
    primals = [ans] if arity == 1 else [*linear, ans, 1 - ans * ans]
    primal_p, _, cotangent_p = derivatives._SECOND[name]
    found = {}
    for mask in range(1, 2**arity):
        zero = derivatives.zero_results(f"{name}_jvp_cotangent", {"tangents": mask}, np.float32)
        if derivatives._split_of(name, ans, mask) is None:  # capture writes no such op
            assert zero == frozenset()
            continue
        s = primal_p.bind(*primals, tangents=mask)[1]
        ct = rng.normal(size=5).astype(np.float32)
        cts = cotangent_p.bind(ct, *primals, s, tangents=mask)
        assert {i for i, c in enumerate(cts) if not np.any(np.asarray(c))} == zero
        found[mask] = zero
    if name != "tanh_residual" and jax.__version_info__ >= (0, 11):
        assert found[(1 << arity) - 1] == {arity - 2}  # (..., ans, r): ans's cotangent
    else:
        assert found and not any(found.values())


# tanh_cotangent_add(acc, ct, ans, r) onto a zero acc (%5) and of a zero ct (%6).
FUSED = """\
fcir.module @fused ir_version=1 placements=[]
func @main(%0: f32[3]@server, %1: f32[3]@server) -> (f32[3]@server, f32[3]@server) {
  .args ($0, $1)
  .results ($0, $1)
  %2: f32[3]@server = jax.sub %0, %0
  %3: f32[3]@server = jax.tanh %1 {accuracy=none}
  %4: f32[3]@server = jax.tanh_residual %3
  %5: f32[3]@server = jax.tanh_cotangent_add %2, %0, %3, %4
  %6: f32[3]@server = jax.tanh_cotangent_add %1, %2, %3, %4
  return %5, %6
}
"""


def test_a_cotangent_added_onto_a_zero_is_the_cotangent_alone_and_of_a_zero_nothing():
    # As JAX's backward pass: onto an accumulator holding a symbolic zero it writes
    # tanh_cotangent alone, and a zero cotangent it does not write.
    module = fcir.parse(FUSED)
    out = zeros.without_structural_zeros(module, x_minus_x)
    fcir.check(out)
    names = [op.name for _, op in walk(out.main.body)]
    assert "jax.tanh_cotangent_add" not in names and names.count("jax.tanh_cotangent") == 1
    alone = FUSED.replace("tanh_cotangent_add %2, %0", "tanh_cotangent %0")
    alone = alone.replace("return %5, %6", "return %5, %1")
    a, b = _args()[1][:2]
    assert_bitwise(xla.compile(out)(a, b), xla.compile(fcir.parse(alone))(a, b))
    assert_bitwise(reference.run(out, a, b), reference.run(module, a, b))
