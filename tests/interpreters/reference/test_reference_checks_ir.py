"""The reference checks a parsed module before running it, as xla does, once per module."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from fcir.interpreters import reference, xla

import fcir

# --- the reference ran IR that fcir check (and xla) refuse ---------------------------------


@fcir.program(placements={"clients": 3})
def _spread(w, x):
    return fcir.reduce_mean(fcir.map_fn(lambda w, x: w * x, (fcir.broadcast(w), x)))


def test_the_reference_refuses_an_ill_typed_ir_file_naming_the_op_as_xla_does():
    w, x = jnp.ones(2), jnp.ones((3, 2))
    text = fcir.capture(_spread, w, x).to_text()
    # An edited file: the mean (and so the program) now claims to give f16, while the
    # members are f32.
    edited = text.replace("f32[2]@server = fed.mean", "f16[2]@server = fed.mean")
    edited = edited.replace("-> (f32[2]@server)", "-> (f16[2]@server)")
    assert edited != text
    module = fcir.parse(edited)
    with pytest.raises(fcir.FcirError, match=r"fed\.mean.*C3"):
        xla.compile(module)
    with pytest.raises(fcir.FcirError, match=r"fed\.mean.*C3"):
        reference.run(module, w, x)
    # The file as written runs, and a parsed module is checked once, not per call.
    good = fcir.parse(text)
    assert np.asarray(reference.run(good, w, x)).tolist() == [1.0, 1.0]
    from fcir.frontend import jaxpr_cache as captured

    assert captured.checked(good)
