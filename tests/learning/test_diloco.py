"""learning.diloco is DiLoCo's update rule (Douillard et al. 2023, Algorithm 1), written
below in numpy float64: each member runs AdamW from the server's model (fresh moments
each round), the outer gradient is the model minus the mean of the members' models,
and the outer step is SGD with Nesterov momentum (0.7, 0.9, the paper's, by default)."""

from __future__ import annotations

import numpy as np
import optax
from fcir.interpreters import reference
from learning_cases import STEPS, N, init_params, loss_fn, make_data
from learning_cases import numpy_grad as grad

import fcir
from fcir import learning

INNER_LR, WD, B1, B2, EPS = 0.05, 1e-4, 0.9, 0.999, 1e-8
OUTER_LR, MOMENTUM = 0.7, 0.9


def adamw(p, data, i):
    m = {k: np.zeros_like(v) for k, v in p.items()}
    v = {k: np.zeros_like(x) for k, x in p.items()}
    for t in range(1, STEPS + 1):
        g = grad(p, {k: x[i, t - 1].astype(np.float64) for k, x in data.items()})
        m = {k: B1 * m[k] + (1 - B1) * g[k] for k in p}
        v = {k: B2 * v[k] + (1 - B2) * g[k] ** 2 for k in p}
        step = {k: m[k] / (1 - B1**t) / (np.sqrt(v[k] / (1 - B2**t)) + EPS) for k in p}
        p = {k: p[k] - INNER_LR * (step[k] + WD * p[k]) for k in p}
    return p


def by_paper(x, data, rounds):
    x = {k: np.asarray(v, np.float64) for k, v in x.items()}
    buf = {k: np.zeros_like(v) for k, v in x.items()}
    for _ in range(rounds):
        models = [adamw(x, data, i) for i in range(N)]
        outer = {k: x[k] - np.mean([m[k] for m in models], 0) for k in x}
        buf = {k: MOMENTUM * buf[k] + outer[k] for k in x}
        x = {k: x[k] - OUTER_LR * (outer[k] + MOMENTUM * buf[k]) for k in x}
    return x


def test_three_rounds_are_the_paper_s_inner_adamw_and_outer_nesterov():
    algo = learning.diloco(loss_fn, client_optimizer=optax.adamw(INNER_LR, weight_decay=WD))
    data, state = make_data(), algo.init(init_params())
    module = fcir.capture(algo.round(clients=N), state, data)
    for _ in range(3):
        state, _ = reference.run(module, state, data)
    want = by_paper(init_params(), data, 3)
    for k in want:
        np.testing.assert_allclose(state["params"][k], want[k], rtol=2e-5, atol=1e-6)
    assert np.max(np.abs(want["w"] - init_params()["w"])) > 0.1  # it trains
