"""``fed.ddp_*/C3`` at run time: every member needs its own key. The type rule refuses
one key broadcast to the members; the reference interpreter and the XLA executable
also refuse members' keys with a duplicate (``jnp.tile(key, n)`` passed as client data),
which they see on the host before running."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fcir.interpreters import reference, xla

import fcir
from fcir.errors import InterpreterError
from fcir.privacy import keys as dp_keys

N = 5


@fcir.program(placements={"clients": N}, private=True)
def ddp_round(w, keys, x):
    upd = fcir.map_fn(lambda w, x: x - w, (fcir.broadcast(w), x))
    return w + fcir.ddp_mean(upd, 1.0, 1.1, keys, bits=16)


def _args(keys):
    return jnp.zeros(3), keys, jax.random.normal(jax.random.key(1), (N, 3))


@pytest.fixture(scope="module")
def module():
    return fcir.capture(ddp_round, *_args(jax.random.split(jax.random.key(0), N)))


def _tiled():
    return jnp.tile(jax.random.key(7)[None], N)


def _one_repeated():
    keys = jax.random.split(jax.random.key(0), N)
    return keys.at[3].set(keys[1])


def test_the_reference_refuses_members_keys_that_are_all_equal(module):
    with pytest.raises(InterpreterError, match=r"fed\.ddp_mean/C3: .*all 5 keys are equal"):
        reference.run(module, *_args(_tiled()))


def test_the_reference_refuses_one_key_given_to_two_members(module):
    with pytest.raises(InterpreterError, match=r"fed\.ddp_mean/C3: .*members 1 and 3 have"):
        reference.run(module, *_args(_one_repeated()))


@pytest.mark.parametrize("raw", [False, True], ids=["typed-keys", "uint32-key-data"])
def test_the_xla_executable_refuses_duplicate_members_keys_before_running(raw):
    keys = jax.random.split(jax.random.key(0), N)
    if raw:
        keys = jax.random.key_data(keys)
    m = fcir.capture(ddp_round, *_args(keys))
    exe = xla.compile(m)
    assert np.array_equal(exe(*_args(keys)), reference.run(m, *_args(keys)))
    tiled, repeated = _tiled(), _one_repeated()
    if raw:
        tiled, repeated = jax.random.key_data(tiled), jax.random.key_data(repeated)
    with pytest.raises(InterpreterError, match=r"ddp_mean/C3: .*all 5 keys are equal.*split"):
        exe(*_args(tiled))
    with pytest.raises(InterpreterError, match=r"members 1 and 3 have the same key \(4 distinct"):
        exe(*_args(np.asarray(repeated) if raw else repeated))  # host arrays too


def test_inside_jit_the_keys_are_traced_and_stay_the_callers_duty(module):
    """docs/privacy.md: a backend checks concrete keys only; under jax.jit nothing can."""
    exe = xla.compile(module)
    out = jax.jit(exe)(*_args(_tiled()))
    assert out.shape == (3,) and np.isfinite(np.asarray(out)).all()


def test_duplicate_members_names_the_first_repeat_and_counts_distinct_keys():
    rows = np.array([[1, 2], [3, 4], [1, 2], [3, 4], [5, 6]], np.uint32)
    assert dp_keys.duplicate_members(rows) == (0, 2, 3)
    assert dp_keys.duplicate_members(rows[[0, 1, 4]]) is None
    assert dp_keys.duplicate_members(jax.ShapeDtypeStruct((5, 2), np.uint32)) is None


def test_the_keys_argument_is_the_one_a_compiled_program_checks(module):
    assert [(i, op.name) for i, op in dp_keys.ddp_key_arguments(module)] == [(1, "fed.ddp_mean")]
