"""Bad arguments to public functions are FcirErrors naming the argument."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from fcir.interpreters import production, reference, xla

import fcir
from fcir.report import dot, traffic

N = 4


@fcir.program(placements={"clients": N}, private=True)
def _private_round(w, x, key):
    deltas = fcir.map_fn(lambda w, x: x - w, (fcir.broadcast(w), x))
    return fcir.dp_mean(deltas, 1.0, 1.0, key)


@fcir.program(placements={"clients": N})
def _round(w, x):
    return fcir.reduce_mean(fcir.map_fn(lambda w, x: x - w, (fcir.broadcast(w), x)))


def _modules():
    private = fcir.capture(_private_round, jnp.zeros(3), jnp.ones((N, 3)), jax.random.key(0))
    plain = fcir.capture(_round, jnp.zeros(3), jnp.ones((N, 3)))
    return private, plain


def _in_program(body, *args):
    return lambda: fcir.capture(fcir.program(placements={"clients": N})(body), *args)


# --- bad arguments to public functions are FcirErrors naming the argument --------

_PRIVATE, _PLAIN = _modules()
_BAD_CALLS = {
    "epsilon delta=None": (lambda: fcir.privacy.epsilon(_PRIVATE, 10, None), "delta"),
    "epsilon delta='x'": (lambda: fcir.privacy.epsilon(_PRIVATE, 10, "x"), "delta"),
    "epsilon sampling_rate=None": (
        lambda: fcir.privacy.epsilon(_PRIVATE, 10, 1e-5, sampling_rate=None),
        "sampling_rate",
    ),
    "epsilon of None": (lambda: fcir.privacy.epsilon(None, 10, 1e-5), "fcir.Module"),
    "round_cost delta=None": (lambda: fcir.privacy.round_cost(_PRIVATE, None), "delta"),
    "leaks of a function": (lambda: fcir.privacy.leaks(_round), "fcir.Module"),
    "capture(None)": (lambda: fcir.capture(None), "fn must be a function"),
    "map_fn(None, x)": (
        _in_program(lambda x: fcir.map_fn(None, x), jnp.ones((N, 3))),
        "fn must be a function",
    ),
    "dp_mean key=None": (
        _in_program(lambda x: fcir.dp_mean(x, 1.0, 1.0, None), jnp.ones((N, 3))),
        "key",
    ),
    "check(None)": (lambda: fcir.check(None), "fcir.Module"),
    "xla.compile(None)": (lambda: xla.compile(None), "fcir.Module"),
    "reference.run(text)": (lambda: reference.run(_PLAIN.to_text(), 1.0), "fcir.Module"),
    "production.export(None)": (lambda: production.export(None), "fcir.Module"),
    "communication_bytes(None)": (lambda: traffic.communication_bytes(None), "fcir.Module"),
    "to_dot(None)": (lambda: dot.to_dot(None), "fcir.Module"),
}


@pytest.mark.parametrize("call", _BAD_CALLS, ids=list(_BAD_CALLS))
def test_bad_arguments_to_public_functions_are_fcir_errors_naming_them(call):
    fn, words = _BAD_CALLS[call]
    with pytest.raises(fcir.FcirError, match=words):
        fn()
