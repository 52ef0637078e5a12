"""fcir.canonical: the forms JAX versions trace differently capture to one IR text, and
the canonical IR runs to the same numbers."""

from __future__ import annotations

import pathlib

import jax
import numpy as np
from fcir.interpreters import reference

import fcir
from fcir.canonical import canonicalize

HEADER = """fcir.module @m ir_version=1 placements=[clients:3]
func @main(%0: f32[3]@server, %1: f32[3]@server) -> (f32[3]@server) {
  .args ($0, $1)
  .results $0
"""

# One sum of three cotangents, accumulated as JAX 0.10.2 and as JAX 0.12 do.
SUM_0_10 = (
    HEADER
    + """  %2: f32[3]@server = jax.add_any %0, %1
  %3: f32[]@server = fcir.constant {value=dense<f32[]: 0.5>}
  %4: f32[3]@server = jax.mul %3, %1 {out_dtype=none}
  %5: f32[3]@server = jax.add_any %2, %4
  %6: f32[3]@server = jax.neg %5
  return %6
}
"""
)
SUM_0_12 = (
    HEADER
    + """  %2: f32[]@server = fcir.constant {value=dense<f32[]: 0.5>}
  %3: f32[3]@server = jax.mul %2, %1 {out_dtype=none}
  %4: f32[3]@server = jax.add_any %0, %3
  %5: f32[3]@server = jax.add_any %1, %4
  %6: f32[3]@server = jax.neg %5
  return %6
}
"""
)
SUM_CANONICAL = (
    HEADER
    + """  %2: f32[]@server = fcir.constant {value=dense<f32[]: 0.5>}
  %3: f32[3]@server = jax.mul %2, %1 {out_dtype=none}
  %4: f32[3]@server = jax.add_any %0, %1
  %5: f32[3]@server = jax.add_any %4, %3
  %6: f32[3]@server = jax.neg %5
  return %6
}
"""
)


def _canonical_text(text: str) -> str:
    return canonicalize(fcir.parse(text)).to_text()


def _run(text: str):
    args = (np.arange(3, dtype=np.float32), np.array([1.0, -2.0, 0.25], np.float32))
    return np.asarray(reference.run(fcir.parse(text), *args))


def test_a_sum_of_cotangents_adds_its_terms_in_definition_order_whatever_the_jax():
    assert _canonical_text(SUM_0_10) == SUM_CANONICAL
    assert _canonical_text(SUM_0_12) == SUM_CANONICAL
    np.testing.assert_allclose(_run(SUM_CANONICAL), _run(SUM_0_12), rtol=1e-6)


def test_an_add_any_read_twice_stays_a_term_of_the_sums_that_read_it():
    text = (
        HEADER
        + """  %2: f32[3]@server = jax.add_any %1, %0
  %3: f32[3]@server = jax.add_any %2, %2
  return %3
}
"""
    )
    # %2 is read twice: it is not folded into %3 (that would compute it twice).
    out = _canonical_text(text)
    assert "jax.add_any %0, %1" in out and "jax.add_any %2, %2" in out
    np.testing.assert_allclose(_run(out), _run(text))


# A map yielding one residual twice and a map reading it twice (JAX 0.10.2's form of a
# gradient's residuals), and the one-result, one-parameter form JAX 0.12 traces.
TWICE = """fcir.module @m ir_version=1 placements=[clients:3]
func @main(%0: {f32[2]}@clients) -> (f32[2]@server) {
  .args ($0,)
  .results $0
  %1: {f32[2]}@clients, %2: {f32[2]}@clients = fed.map %0 {
    ^member(%3: f32[2]):
      %4: f32[2] = jax.sin %3 {accuracy=none}
      yield %4, %4
  }
  %5: {f32[2]}@clients = fed.map %1, %2 {
    ^member(%6: f32[2], %7: f32[2]):
      %8: f32[2] = jax.mul %6, %7 {out_dtype=none}
      yield %8
  }
  %9: f32[2]@server = fed.sum %5
  return %9
}
"""
ONCE = """fcir.module @m ir_version=1 placements=[clients:3]
func @main(%0: {f32[2]}@clients) -> (f32[2]@server) {
  .args ($0,)
  .results $0
  %1: {f32[2]}@clients = fed.map %0 {
    ^member(%2: f32[2]):
      %3: f32[2] = jax.sin %2 {accuracy=none}
      yield %3
  }
  %4: {f32[2]}@clients = fed.map %1, %1 {
    ^member(%5: f32[2], %6: f32[2]):
      %7: f32[2] = jax.mul %5, %6 {out_dtype=none}
      yield %7
  }
  %8: f32[2]@server = fed.sum %4
  return %8
}
"""


def test_a_value_yielded_or_passed_twice_is_one_result_and_one_parameter():
    canonical = _canonical_text(TWICE)
    assert canonical == _canonical_text(ONCE)
    assert "fed.map %1 {" in canonical and "yield %3\n" in canonical
    x = np.array([[0.5, 1.0], [2.0, -1.0], [0.0, 3.0]], np.float32)
    np.testing.assert_allclose(
        reference.run(fcir.parse(canonical), x), reference.run(fcir.parse(TWICE), x), rtol=1e-6
    )


def test_no_captured_scan_takes_a_scalar_constant_as_a_const_operand():
    # JAX 0.12 passes the literals 0.9 and 0.999 of optax's Adam bias correction to the
    # forward scan of DiLoCo's gradient as constant operands; JAX 0.10.2 keeps them in
    # the body. Capture keeps them in the body on both.
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).parent))
    from corpus import case

    c = case("diloco")
    grad = jax.grad(lambda *a: c.loss(c.fn(*a)), c.grad_argnums)
    module = fcir.capture(grad, *c.make_args(), name="diloco_grad")
    producers = {}
    scans = 0
    for _, op in fcir.ir.walk(module.main.body):
        for v in op.results:
            producers[v] = op
        if op.name == "jax.scan":
            scans += 1
            for v in op.operands[: op.attrs["num_consts"]]:
                made = producers.get(v)
                t = getattr(v.type, "member", v.type)
                scalar = made is not None and made.name == "fcir.constant" and t.shape == ()
                assert not scalar, "a scan takes a scalar constant as a const operand"
    assert scans >= 2
