"""learning.scaffold is the paper's update rule (Karimireddy et al. 2020, option II,
full participation), written below in numpy float64: local steps with corrected
gradients, ``c_i+ = c_i - c + (x - y_i) / (K lr)``, the server's model and control the
means of the members' deltas. Each client's control stays at the client: in the state
it is member ``i``'s row, never an input to the server's arithmetic."""

from __future__ import annotations

import jax
import numpy as np
import optax
from fcir.interpreters import reference
from learning_cases import LR, STEPS, N, init_params, loss_fn, make_data
from learning_cases import numpy_grad as grad

import fcir
from fcir import learning


def by_paper(x, data, rounds, server_lr=1.0):
    x = {k: np.asarray(v, np.float64) for k, v in x.items()}
    c = {k: np.zeros_like(v) for k, v in x.items()}
    ci = [{k: np.zeros_like(v) for k, v in x.items()} for _ in range(N)]
    for _ in range(rounds):
        dys, dcs = [], []
        for i in range(N):
            y = dict(x)
            for s in range(STEPS):
                g = grad(y, {k: v[i, s].astype(np.float64) for k, v in data.items()})
                y = {k: y[k] - LR * (g[k] - ci[i][k] + c[k]) for k in y}
            new = {k: ci[i][k] - c[k] + (x[k] - y[k]) / (STEPS * LR) for k in y}
            dys.append({k: y[k] - x[k] for k in y})
            dcs.append({k: new[k] - ci[i][k] for k in y})
            ci[i] = new
        x = {k: x[k] + server_lr * np.mean([d[k] for d in dys], 0) for k in x}
        c = {k: c[k] + np.mean([d[k] for d in dcs], 0) for k in c}
    return x, c, ci


def test_three_rounds_are_the_paper_s_option_ii_rule():
    algo = learning.scaffold(loss_fn, client_optimizer=optax.sgd(LR))
    data, state = make_data(), algo.init(init_params(), clients=N)
    module = fcir.capture(algo.round(clients=N), state, data)
    for _ in range(3):
        state, _ = reference.run(module, state, data)
    x, c, ci = by_paper(init_params(), data, 3)
    for k in x:
        np.testing.assert_allclose(state["params"][k], x[k], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(state["control"][k], c[k], rtol=1e-5, atol=1e-5)
        got = np.asarray(state["client_controls"][k])
        np.testing.assert_allclose(got, np.stack([m[k] for m in ci]), rtol=1e-5, atol=1e-5)
    assert np.max(np.abs(state["control"]["w"])) > 0.1  # the controls are not zero


def test_the_clients_controls_go_in_at_the_clients_and_never_reach_the_server():
    """In the round's IR each control is a client-placed argument and result, read only
    inside the members' map; the server sees the mean of their deltas alone."""
    algo = learning.scaffold(loss_fn, client_optimizer=optax.sgd(LR))
    state = algo.init(init_params(), clients=N)
    module = fcir.capture(algo.round(clients=N), state, make_data())
    leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    params = module.main.body.params
    controls = [v for (path, _), v in zip(leaves, params) if "client_controls" in str(path)]
    assert controls and all(str(v.type).startswith("{") and "@clients" in str(v.type)
                            for v in controls)  # fmt: skip
    readers = {op.name for op in module.main.body.ops if any(v in op.operands for v in controls)}
    assert readers == {"fed.map"}
