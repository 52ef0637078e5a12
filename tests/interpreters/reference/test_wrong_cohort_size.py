"""Called with another number of members than captured, every backend tells one story:
what the argument needs, and to capture the program again."""

import jax.numpy as jnp
import pytest
from fcir.interpreters import reference, xla

import fcir


@fcir.program(placements={"clients": 8})
def _round(w, x):
    return fcir.reduce_mean(fcir.map_fn(lambda w, x: w + x.mean(0), (fcir.broadcast(w), x)))


def test_reference_and_xla_say_the_same_about_a_wrong_cohort_size():
    w, x = jnp.zeros(4), jnp.ones((8, 16, 4))
    module = fcir.capture(_round, w, x)
    seven = jnp.ones((7, 16, 4))
    with pytest.raises(fcir.InterpreterError) as ref:
        reference.run(module, w, seven)
    with pytest.raises(fcir.PlacementError) as compiled:
        xla.compile(module)(w, seven)
    said = str(ref.value)
    assert said.endswith(
        "needs an array of f32[8,16,4], got f32[7,16,4]: it is placed, one member per "
        "clients (8 clients); capture the program again for the new number of members"
    ), said
    assert str(compiled.value) == said


def test_a_wrong_dtype_is_not_blamed_on_the_cohort():
    w, x = jnp.zeros(4), jnp.ones((8, 16, 4))
    module = fcir.capture(_round, w, x)
    with pytest.raises(fcir.InterpreterError) as e:
        reference.run(module, w, x.astype(jnp.int32))
    assert "capture the program again" not in str(e.value)
