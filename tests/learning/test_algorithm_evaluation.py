"""algo.evaluate: each member's mean loss (and loss_fn's metrics) over its real batches
at the state's model, weighted by examples; personalized_evaluation: the metrics on
each member's test split before and after k local steps on its training split."""

from __future__ import annotations

import jax
import numpy as np
from fcir.interpreters import reference
from learning_cases import BATCH, COUNTS, SGD, N, init_params, loss_with_metrics, make_data

import fcir
from fcir import learning


def _member(data, i, steps=None):
    return {k: v[i, :steps] for k, v in data.items()}


def test_evaluation_is_the_example_weighted_mean_of_each_member_s_mean_metrics():
    algo = learning.fedavg(loss_with_metrics, client_optimizer=SGD)
    state, data = algo.init(init_params()), make_data()
    module = fcir.capture(algo.evaluate(clients=N), state, data, COUNTS)
    got = reference.run(module, state, data, COUNTS)
    assert module.name == "fedavg_evaluation" and sorted(got) == ["loss", "mae"]
    per = []
    for i in range(N):
        steps = [loss_with_metrics(state["params"], jax.tree.map(lambda x, s=s: x[s],
                                                                 _member(data, i)))  # fmt: skip
                 for s in range(int(COUNTS[i]))]  # fmt: skip
        per.append({"loss": np.mean([loss for loss, _ in steps]),
                    "mae": np.mean([a["mae"] for _, a in steps])})  # fmt: skip
    w = COUNTS * BATCH
    for name in ("loss", "mae"):
        want = sum(wi * p[name] for wi, p in zip(w, per)) / w.sum()
        np.testing.assert_allclose(got[name], want, rtol=1e-6)


def test_personalized_evaluation_fine_tunes_each_member_on_its_own_split():
    algo = learning.fedavg(loss_with_metrics, client_optimizer=SGD)
    both = make_data(steps=4)  # each client's offset in both of its splits
    data, test = ({k: v[:, a:b] for k, v in both.items()} for a, b in ((0, 2), (2, 4)))
    state = algo.init(init_params())
    program = learning.personalized_evaluation(algo, fine_tune_steps=1).evaluate(clients=N)
    module = fcir.capture(program, state, data, test)
    got = reference.run(module, state, data, test)
    assert module.name == "fedavg_personalized_evaluation"
    assert sorted(got) == ["after", "before"] and sorted(got["after"]) == ["loss", "mae"]
    plain = fcir.capture(algo.evaluate(clients=N), state, test)
    before = reference.run(plain, state, test)
    np.testing.assert_allclose(got["before"]["loss"], before["loss"], rtol=1e-6)
    afters = []
    for i in range(N):
        tuned, _, _ = algo.train(state["params"], _member(data, i, 1), None)
        afters.append(algo.measure(tuned, _member(test, i), None)["loss"])
    np.testing.assert_allclose(got["after"]["loss"], np.mean(afters), rtol=1e-6)
    assert got["after"]["loss"] < got["before"]["loss"]  # each client's own data helps
