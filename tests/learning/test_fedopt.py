"""learning.fedopt (TFF's FedOpt): with an optax Adam on the server, three rounds are
a hand-written optax loop's (local SGD by hand, the example-weighted mean model, Adam
on ``params - mean``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from fcir.interpreters import reference
from learning_cases import BATCH, COUNTS, LR, N, init_params, loss_fn, make_data

import fcir
from fcir import learning


def by_hand(params, data, counts, server, rounds):
    """FedOpt written out: no fcir, one client at a time."""
    opt_state = server.init(params)
    grad = jax.grad(loss_fn)
    for _ in range(rounds):
        models, weights = [], []
        for i in range(N):
            w = params
            for s in range(int(counts[i])):
                batch = {k: v[i, s] for k, v in data.items()}
                w = jax.tree.map(lambda p, g: p - LR * g, w, grad(w, batch))
            models.append(w)
            weights.append(counts[i] * BATCH)
        mean = {k: sum(wi * m[k] for wi, m in zip(weights, models)) / sum(weights) for k in params}
        pseudo = jax.tree.map(jnp.subtract, params, mean)
        updates, opt_state = server.update(pseudo, opt_state, params)
        params = optax.apply_updates(params, updates)
    return params


def test_fedopt_with_adam_is_a_hand_written_optax_loop():
    server = optax.adam(0.05)
    algo = learning.fedopt(loss_fn, client_optimizer=optax.sgd(LR), server_optimizer=server)
    data, state = make_data(), algo.init(init_params())
    module = fcir.capture(algo.round(clients=N), state, data, COUNTS)
    for _ in range(3):
        state, _ = reference.run(module, state, data, COUNTS)
    want = by_hand(init_params(), data, COUNTS, server, 3)
    for k in want:
        np.testing.assert_allclose(state["params"][k], want[k], rtol=1e-5, atol=1e-6)
    assert int(state["opt_state"][0].count) == 3  # Adam's own step count, in the state
