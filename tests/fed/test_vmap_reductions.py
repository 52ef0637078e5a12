"""jax.vmap of a round over several server models: every fed reduction's batching rule
keeps client values at the clients (a batch-axis slice, move or repeat of a placed value
happens inside a fed.map, never at the server), so the batched round captures, checks
and runs like jax.jit."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fcir.interpreters import reference, xla

import fcir

N = 4
clients = fcir.program(placements={"clients": N})
WS = jnp.asarray([[0.0, 0.5, -1.0], [1.0, 1.0, 1.0], [-1.0, 2.0, 0.0]], jnp.float32)
X = jnp.asarray(np.random.default_rng(3).normal(size=(N, 3)), jnp.float32)
C = jnp.abs(X) + 0.1  # per-element weights, one per client value


def runs_like_jit(program, *args):
    module = fcir.capture(program, *args)
    want = jax.jit(program)(*args)
    np.testing.assert_allclose(reference.run(module, *args), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(xla.compile(module)(*args), want)
    return module


def _scores(w, x):
    return fcir.map_fn(lambda w, x: jnp.exp(-jnp.sum((x - w) ** 2)), (fcir.broadcast(w), x))


def _updates(w, x):
    return fcir.map_fn(lambda w, x: x - w, (fcir.broadcast(w), x))


ROUNDS = {
    # values unbatched (client data), weights batched (they depend on the model)
    "weighted_mean, batched weights": lambda w, x, c: fcir.reduce_weighted_mean(x, _scores(w, x)),
    # values batched, per-element weights unbatched
    "weighted_mean, per-element weights": lambda w, x, c: fcir.reduce_weighted_mean(
        _updates(w, x), c
    ),
    "mean": lambda w, x, c: fcir.reduce_mean(_updates(w, x)),
    "sum": lambda w, x, c: fcir.reduce_sum(_updates(w, x)),
    "max": lambda w, x, c: fcir.reduce_max(_updates(w, x)),
    "dp_sum": lambda w, x, c: fcir.dp_sum(_updates(w, x), 1.0, 0.5, jax.random.key(1)),
}


@pytest.mark.parametrize("round_", ROUNDS.values(), ids=ROUNDS.keys())
def test_vmap_over_server_models_checks_and_runs_like_jit(round_):
    runs_like_jit(clients(jax.vmap(clients(round_), (0, None, None))), WS, X, C)
