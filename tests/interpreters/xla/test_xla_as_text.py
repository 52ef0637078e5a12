"""An executable's text in an unknown dialect is an FcirError naming the dialects."""

from __future__ import annotations

import jax.numpy as jnp
import pytest
from fcir.interpreters import xla

import fcir


@fcir.program(placements={"clients": 3})
def _mean_update(w, x):
    return fcir.reduce_mean(fcir.map_fn(lambda w, x: x - w, (fcir.broadcast(w), x)))


def test_executable_as_text_of_an_unknown_dialect_is_an_fcir_error_naming_the_dialects():
    exe = xla.compile(fcir.capture(_mean_update, jnp.zeros(2), jnp.ones((3, 2))))
    with pytest.raises(fcir.InterpreterError, match="stablehlo, hlo, optimized_hlo.*'mlir'"):
        exe.as_text("mlir")
