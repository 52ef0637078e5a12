"""fcir.ir.canonical: capture's one layout where JAX versions emit the same computation in
another. Each rewrite moves ops or constants, never changes an operand of a sum: the
reference interpreter gives the same bits before and after, and the goldens
(tests/golden/README.md) and tests/interpreters/xla/test_xla.py's bitwise-jit tests pin it on the
corpus under every JAX."""

from __future__ import annotations

import numpy as np
from fcir.interpreters import reference

import fcir
from fcir.ir import canonical

HEAD = """fcir.module @m ir_version=1 placements=[]
func @main(%0: f32[3]@server, %1: f32[3]@server, %2: f32[3]@server) -> (f32[3]@server, f32[3]@server) {
  .args ($0, $1, $2)
  .results ($0, $1)
"""

ARGS = (
    np.array([1.5, -2.0, 3.25], np.float32),
    np.array([0.1, 0.2, 0.3], np.float32),
    np.array([7.0, 8.0, 9.0], np.float32),
)


def _module(body: str) -> fcir.Module:
    return fcir.parse(HEAD + body + "}\n")


def _rewritten(body: str, weak=lambda m: set()):
    module = _module(body)
    before = reference.run(module, *ARGS)
    canonical.canonicalize(module, weak(module))
    after = reference.run(module, *ARGS)
    for a, b in zip(before, after):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    return module.to_text()


# JAX 0.12's transposition makes both cotangents, then sums them in reverse order.
DEFERRED = """\
  %3: f32[3]@server = jax.neg %0
  %4: f32[3]@server = jax.sin %1 {accuracy=none}
  %5: f32[3]@server = jax.add_any %2, %4
  %6: f32[3]@server = jax.add_any %2, %3
  return %5, %6
"""
# JAX 0.10.2 sums each where it was made: the canonical layout.
INTERLEAVED = """\
  %3: f32[3]@server = jax.neg %0
  %4: f32[3]@server = jax.add_any %2, %3
  %5: f32[3]@server = jax.sin %1 {accuracy=none}
  %6: f32[3]@server = jax.add_any %2, %5
  return %6, %4
"""


def test_deferred_cotangent_sums_are_interleaved_with_what_they_add():
    assert _rewritten(DEFERRED) == _module(INTERLEAVED).to_text()


def test_interleaved_sums_are_already_canonical():
    assert _rewritten(INTERLEAVED) == _module(INTERLEAVED).to_text()


def test_sums_in_the_order_their_operands_were_made_keep_their_place():
    # A transposition writing two cotangents in order (0.10.2's multi-operand rules).
    body = """\
  %3: f32[3]@server = jax.neg %0
  %4: f32[3]@server = jax.sin %1 {accuracy=none}
  %5: f32[3]@server = jax.add_any %2, %3
  %6: f32[3]@server = jax.add_any %2, %4
  return %5, %6
"""
    assert _rewritten(body) == _module(body).to_text()


def test_a_sum_reading_another_producer_of_its_run_keeps_its_place():
    body = """\
  %3: f32[3]@server = jax.neg %0
  %4: f32[3]@server = jax.sin %1 {accuracy=none}
  %5: f32[3]@server = jax.add_any %3, %4
  %6: f32[3]@server = jax.add_any %2, %3
  return %5, %6
"""
    assert _rewritten(body) == _module(body).to_text()


SCAN = """\
  %3: f32[]@server = fcir.constant {value=dense<f32[]: 0.5>}
  %4: f32[3]@server = jax.scan %3, %1, %0 {jaxpr=^0, length=2, num_carry=1, num_consts=2, reverse=false, unroll=1} {
    ^r0(%5: f32[]@server, %6: f32[3]@server, %7: f32[3]@server):
      %8: f32[3]@server = jax.mul %5, %7 {out_dtype=none}
      %9: f32[3]@server = jax.add %8, %6
      %10: f32[3]@server = jax.mul %9, %5 {out_dtype=none}
      yield %10
  }
  return %4, %2
"""


def _scan_literal(module):
    return {module.main.body.ops[0].results[0]}


def test_a_scans_weakly_typed_scalar_literal_is_a_constant_at_each_use_in_its_body():
    expected = """\
  %3: f32[3]@server = jax.scan %1, %0 {jaxpr=^0, length=2, num_carry=1, num_consts=1, reverse=false, unroll=1} {
    ^r0(%4: f32[3]@server, %5: f32[3]@server):
      %6: f32[]@server = fcir.constant {value=dense<f32[]: 0.5>}
      %7: f32[3]@server = jax.mul %6, %5 {out_dtype=none}
      %8: f32[3]@server = jax.add %7, %4
      %9: f32[]@server = fcir.constant {value=dense<f32[]: 0.5>}
      %10: f32[3]@server = jax.mul %8, %9 {out_dtype=none}
      yield %10
  }
  return %3, %2
"""
    assert _rewritten(SCAN, _scan_literal) == _module(expected).to_text()


def test_other_scan_constants_stay_operands():
    # Not a weakly typed literal (e.g. optax's int32 maximum): JAX passes it on every version.
    assert _rewritten(SCAN) == _module(SCAN).to_text()
    # A constant the body yields (here as a ys) stays an operand.
    yielded = SCAN.replace(
        "%4: f32[3]@server = jax.scan", "%4: f32[3]@server, %11: f32[2]@server = jax.scan"
    ).replace("yield %10", "yield %10, %5")
    module = _module(yielded)
    text = module.to_text()
    canonical.canonicalize(module, _scan_literal(module))
    assert module.to_text() == text
