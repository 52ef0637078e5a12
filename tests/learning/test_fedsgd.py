"""learning.fedsgd (TFF's FedSGD): each member sends its mean gradient at the server's
model over the steps it holds (count), the server steps its optimizer along their
example-weighted mean. Written out in numpy below."""

from __future__ import annotations

import numpy as np
from fcir.interpreters import reference
from learning_cases import BATCH, COUNTS, N, init_params, loss_fn, make_data
from learning_cases import numpy_grad as grad

import fcir
from fcir import learning


def test_two_rounds_are_sgd_on_the_example_weighted_mean_gradient():
    algo = learning.fedsgd(loss_fn)  # server optimizer: optax.sgd(0.1), TFF's default
    data, state = make_data(), algo.init(init_params())
    module = fcir.capture(algo.round(clients=N), state, data, COUNTS)
    for _ in range(2):
        state, metrics = reference.run(module, state, data, COUNTS)
    x = {k: np.asarray(v, np.float64) for k, v in init_params().items()}
    for _ in range(2):
        total = {k: np.zeros_like(v) for k, v in x.items()}
        for i in range(N):
            steps = int(COUNTS[i])
            for s in range(steps):
                g = grad(x, {k: v[i, s].astype(np.float64) for k, v in data.items()})
                for k in x:
                    total[k] += COUNTS[i] * BATCH * g[k] / steps
        x = {k: x[k] - 0.1 * total[k] / (COUNTS.sum() * BATCH) for k in x}
    for k in x:
        np.testing.assert_allclose(state["params"][k], x[k], rtol=1e-5, atol=1e-6)
    assert sorted(metrics) == ["loss"]
