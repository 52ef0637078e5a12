"""Soundness: a module that passes ``fcir.check`` is true, and runs or fails with an
FcirError naming what went wrong (issue 10, defects 3, 5, 6, 7 and 10).

* defect 5: local ops' result types are re-derived from their primitives (``local/C4``),
  attributes and operands the primitive would refuse are check errors (``local/C5``,
  ``local/C6``), and values too large for XLA's shape arithmetic are ``value/C1``;
* defect 3: a program calling a program declared with other cardinalities is refused at
  capture;
* defect 6: the reference interpreter's ``secure_sum`` wraps like jit;
* defect 7: module, func and placement names are ASCII identifiers everywhere;
* defect 10: hostile integers in text are ParseErrors.
"""

from __future__ import annotations

import pathlib

import jax
import numpy as np
import pytest
from fcir.interpreters import reference
from hypothesis import HealthCheck, settings

import fcir

GOLDEN = pathlib.Path(__file__).parent / "golden"

FUZZ = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


# --- shared ------------------------------------------------------------------------------

SUM = """\
fcir.module @p ir_version=1 placements=[clients:3]
func @main(%0: {f32[4]}@clients) -> (f32[]@server) {
  %1: f32[4]@server = fed.sum %0
  %2: f32[]@server = jax.reduce_sum %1 {axes=[0], out_sharding=none}
  return %2
}
"""


def _round_trips(m: fcir.Module) -> None:
    text = m.to_text()
    assert fcir.parse(text).to_text() == text
    assert fcir.Module.deserialize(m.serialize()).to_text() == text


# --- defect 6: secure_sum wraps in the reference interpreter as in jit ---------------------


@pytest.mark.parametrize("dtype", ["int8", "int16", "int32", "uint8", "uint16", "uint32"])
def test_reference_secure_sum_wraps_like_jit(dtype):
    bits = np.iinfo(dtype).bits
    widths = sorted({1, bits // 2, bits - 1, bits})

    @fcir.program(placements={"clients": 3})
    def sums(x):
        return tuple(fcir.secure_sum(x, bitwidth=b) for b in widths)

    info = np.iinfo(dtype)
    rng = np.random.default_rng(bits)
    x = rng.integers(info.min, info.max, size=(3, 4), endpoint=True).astype(dtype)
    x[:, 0] = 1 << (bits - 2)  # 3 × 2**(bits-2) wraps a signed full-width sum
    x[:, 1] = info.max
    expected = jax.jit(sums)(x)
    got = reference.run(fcir.capture(sums, x), x)
    for w, e, g in zip(widths, expected, got):
        assert g.dtype == e.dtype and np.array_equal(g, e), (dtype, w, e, g)


def test_int32_full_width_secure_sum_is_minus_2_to_the_30():
    @fcir.program(placements={"clients": 3})
    def s(x):
        return fcir.secure_sum(x, bitwidth=32)

    x = np.full((3, 2), 1 << 30, np.int32)
    np.testing.assert_array_equal(reference.run(fcir.capture(s, x), x), [-(1 << 30)] * 2)


