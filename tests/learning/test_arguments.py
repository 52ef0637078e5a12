"""Out-of-range arguments of fcir.learning's algorithms, aggregators and rounds are an
FcirError naming the argument and its allowed range, raised when the algorithm or the
round is built (no JAX trace, no data needed)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from learning_cases import loss_fn

import fcir
from fcir import learning

SGD = optax.sgd(0.1)


def _round(algo_fn, clients):
    return lambda: algo_fn().round(clients=clients)


# (what is built, the words the message must hold)
BAD = {
    "fedprox_mu": (lambda: learning.fedprox(loss_fn, client_optimizer=SGD, mu=-0.1),
                   ["learning.fedprox", "mu must be a finite number >= 0", "-0.1"]),
    "qfedavg_q": (lambda: learning.qfedavg(loss_fn, client_optimizer=SGD, q=-1,
                                           client_learning_rate=0.1),
                  ["learning.qfedavg", "q must be a finite number >= 0"]),
    "qfedavg_lr_missing": (lambda: learning.qfedavg(loss_fn, client_optimizer=SGD),
                           ["client_learning_rate is required (> 0)"]),
    "qfedavg_lr": (lambda: learning.qfedavg(loss_fn, client_optimizer=SGD,
                                            client_learning_rate=0.0),
                   ["client_learning_rate must be a finite number > 0"]),
    "qfedavg_aggregator": (lambda: learning.qfedavg(loss_fn, client_optimizer=SGD,
                                                    client_learning_rate=0.1,
                                                    aggregator=learning.median()),
                           ["aggregator must be left out", "learning.median()"]),
    "krum_f_vs_clients": (_round(lambda: learning.fedavg(
        loss_fn, client_optimizer=SGD, aggregator=learning.krum(2)), 4),
        ["learning.krum(2)", "f must be an int in [0, 1]", "n >= f + 3", "n = 4"]),
    "multi_krum_m": (_round(lambda: learning.fedavg(
        loss_fn, client_optimizer=SGD, aggregator=learning.multi_krum(1, 9)), 7),
        ["m must be an int in [1, 7]", "got 9"]),
    "bulyan_f_vs_clients": (_round(lambda: learning.fedavg(
        loss_fn, client_optimizer=SGD, aggregator=learning.bulyan(1)), 6),
        ["f must be an int in [0, 0]", "n >= 4f + 3", "n = 6"]),
    "krum_f_negative": (lambda: learning.krum(-1), ["learning.krum", "f must be an int >= 0"]),
    "trimmed_mean_beta": (lambda: learning.trimmed_mean(0.5),
                          ["beta must be a finite number in [0, 0.5)", "0.5"]),
    "geometric_median_iters": (lambda: learning.geometric_median(iters=0),
                               ["iters must be an int >= 1"]),
    "geometric_median_eps": (lambda: learning.geometric_median(eps=0.0),
                             ["eps must be a finite number > 0"]),
    "dp_clip": (lambda: learning.dp(0.0, 1.0), ["learning.dp", "clip_norm must be a finite number > 0"]),
    "dp_noise": (lambda: learning.dp(1.0, -1.0), ["noise_multiplier must be a finite number > 0"]),
    "ddp_bits": (lambda: learning.ddp(1.0, 1.0, bits=40), ["bits must be an int in [2, 32]"]),
    "dp_adaptive_quantile": (lambda: learning.dp_adaptive(1.0, 0.5, target_quantile=1.5),
                             ["target_quantile must be a finite number in [0, 1]"]),
    "dp_adaptive_count_noise": (_round(lambda: learning.fedavg(
        loss_fn, client_optimizer=SGD, aggregator=learning.dp_adaptive(1.0, 1.0)), 8),
        ["noise_multiplier=1 needs count_stddev > 0.5"]),
    "client_optimizer_missing": (lambda: learning.fedavg(loss_fn),
                                 ["client_optimizer is required", "optax.sgd(0.1)"]),
    "client_optimizer_not_optax": (lambda: learning.fedavg(loss_fn, client_optimizer="sgd"),
                                   ["client_optimizer must be an optax optimizer", "got str"]),
    "server_optimizer_missing": (lambda: learning.fedopt(loss_fn, client_optimizer=SGD),
                                 ["server_optimizer is required"]),
    "server_optimizer_not_optax": (lambda: learning.fedopt(
        loss_fn, client_optimizer=SGD, server_optimizer=lambda g: g),
        ["server_optimizer must be an optax optimizer", "got function"]),
    "fedadam_beta_1": (lambda: learning.fedadam(loss_fn, client_optimizer=SGD, beta_1=1.0),
                       ["beta_1 must be a finite number in [0, 1)"]),
    "fedyogi_beta_2": (lambda: learning.fedyogi(loss_fn, client_optimizer=SGD, beta_2=-0.5),
                       ["beta_2 must be a finite number in [0, 1)"]),
    "fedadagrad_eta": (lambda: learning.fedadagrad(loss_fn, client_optimizer=SGD, eta=0),
                       ["eta must be a finite number > 0"]),
    "fedadam_tau": (lambda: learning.fedadam(loss_fn, client_optimizer=SGD, tau=float("nan")),
                    ["tau must be a finite number > 0", "nan"]),
    "fedavgm_momentum": (lambda: learning.fedavgm(loss_fn, client_optimizer=SGD,
                                                  server_momentum=1.0),
                         ["server_momentum must be a finite number in [0, 1)"]),
    "fedavgm_lr": (lambda: learning.fedavgm(loss_fn, client_optimizer=SGD,
                                            server_learning_rate=-1.0),
                   ["server_learning_rate must be a finite number > 0"]),
    "scaffold_lr": (lambda: learning.scaffold(loss_fn, client_optimizer=SGD,
                                              server_learning_rate=0.0),
                    ["server_learning_rate must be a finite number > 0"]),
    "scaffold_dp": (lambda: learning.scaffold(loss_fn, client_optimizer=SGD,
                                              aggregator=learning.dp(1.0, 1.0)),
                    ["learning.scaffold", "DP release", "in the clear"]),
    "scaffold_init_clients": (lambda: learning.scaffold(loss_fn, client_optimizer=SGD).init(
        jnp.zeros(2)), ["init(params, clients=n)", "one control variate per client"]),
    "scaffold_clients_total": (_round(lambda: learning.scaffold(
        loss_fn, client_optimizer=SGD, clients_total=3), 4), ["clients_total=3"]),
    "round_clients": (_round(lambda: learning.fedavg(loss_fn, client_optimizer=SGD), 0),
                      ["round", "clients must be an int >= 1", "got 0"]),
    "evaluate_clients": (lambda: learning.fedavg(loss_fn, client_optimizer=SGD).evaluate(
        clients=2.5), ["evaluate", "clients must be an int >= 1"]),
    "fine_tune_steps": (lambda: learning.personalized_evaluation(
        learning.fedavg(loss_fn, client_optimizer=SGD), fine_tune_steps=-1),
        ["fine_tune_steps must be an int >= 0"]),
    "aggregator_type": (lambda: learning.fedavg(loss_fn, client_optimizer=SGD,
                                                aggregator="median"),
                        ["aggregator must be one of fcir.learning's aggregators", "got str"]),
    "loss_fn": (lambda: learning.fedavg(None, client_optimizer=SGD),
                ["loss_fn must be a function loss_fn(params, batch) -> scalar"]),
    "params_int": (lambda: learning.fedavg(loss_fn, client_optimizer=SGD).init(
        {"w": np.zeros(2, np.int32)}), ["params['w'] is int32", "floating-point"]),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(BAD))
def test_an_out_of_range_argument_names_itself_and_its_range(case):
    build, words = BAD[case]
    with pytest.raises(fcir.FcirError) as info:
        build()
    for w in words:
        assert w in str(info.value), (case, str(info.value))


def test_data_counts_state_and_keys_of_the_wrong_kind_are_named_in_the_round():
    """Checked when the round runs (or is captured): the data's layout, counts' shape,
    a state that init did not make, a private round without a key."""
    algo = learning.fedavg(loss_fn, client_optimizer=SGD)
    rnd = algo.round(clients=2)
    state = algo.init({"b": jnp.zeros(2), "w": jnp.zeros((3, 2))})
    data = {"x": jnp.ones((2, 1, 4, 3)), "y": jnp.ones((2, 1, 4, 2))}
    with pytest.raises(fcir.LearningError, match=r"data must be a pytree of arrays \[clients=2"):
        rnd(state, {"x": jnp.ones((2, 4, 3)), "y": jnp.ones((2, 4))[:, None]})
    with pytest.raises(
        fcir.FcirError, match=r"'counts' is declared client data.*leading axis of 2"
    ):
        rnd(state, data, jnp.ones(3))
    with pytest.raises(fcir.LearningError, match=r"counts must be f32\[2\]"):
        rnd(state, data, jnp.ones((2, 2)))
    with pytest.raises(fcir.LearningError, match="the state has no 'round'"):
        rnd({"params": state["params"]}, data)
    private = learning.fedavg(loss_fn, client_optimizer=SGD, aggregator=learning.dp(1.0, 1.0))
    with pytest.raises(fcir.LearningError, match="needs a PRNG key"):
        private.round(clients=2)(private.init(state["params"]), data)
