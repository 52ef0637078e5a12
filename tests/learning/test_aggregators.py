"""The aggregators: DP rounds are private programs that the checker and the accountant
see as they see a hand-written DP round, the noise key is folded with the round, the
adaptive clip is server state; the robust rules resist a byzantine member."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fcir.interpreters import reference
from learning_cases import ALGORITHMS, COUNTS, N, init, init_params, make_data, round_args

import fcir


def hand_written(kind: str):
    """DP-FedAvg's release written by hand: one dp_mean (or ddp_mean, or the adaptive
    pair) of the members' updates, as docs/privacy.md writes it."""

    client_data = ("x", "key") if kind == "ddp" else ("x",)

    @fcir.program(placements={"clients": N}, private=True, client_data=client_data)
    def rnd(w, clip, key, x):
        def update(w, x):  # the model's shapes: ddp's accounting depends on them
            return jax.tree.map(lambda p: jnp.mean(x) - p, w)

        upd = fcir.map_fn(update, (fcir.broadcast(w), x))
        if kind == "dp":
            return fcir.dp_mean(upd, 1.0, 1.0, key)
        if kind == "dp_adaptive":
            return fcir.dp_mean_adaptive(upd, clip, 0.3, key)
        return fcir.ddp_mean(upd, 1.0, 1.0, key, bits=16)

    return rnd


@pytest.mark.parametrize("name", ["dp", "dp_adaptive", "ddp"])
def test_a_dp_round_is_private_and_its_epsilon_is_a_hand_written_round_s(name):
    algo = ALGORITHMS[name]()
    args = round_args(algo, init(algo), make_data(), COUNTS)
    module = fcir.capture(algo.round(clients=N), *args)
    assert module.private
    key = args[-1]
    x = make_data()["x"]
    mine = fcir.capture(hand_written(name), init_params(), jnp.float32(1.0), key, x)
    for rounds in (1, 10):
        assert fcir.privacy.epsilon(module, rounds, 1e-5) == pytest.approx(
            fcir.privacy.epsilon(mine, rounds, 1e-5), rel=1e-12
        )


def test_the_noise_key_is_folded_with_the_round_number():
    """The same key in every round (a Flower app's input) draws fresh noise each round:
    the round folds state['round'] in. Two runs of one round with one key agree."""
    algo = ALGORITHMS["dp"]()
    data = make_data()
    state, _, counts, key = round_args(algo, init(algo), data, COUNTS)
    module = fcir.capture(algo.round(clients=N), state, data, counts, key)
    first, _ = reference.run(module, state, data, counts, key)
    again, _ = reference.run(module, state, data, counts, key)
    later, _ = reference.run(module, {**state, "round": jnp.int32(1)}, data, counts, key)
    noise = [a - b for a, b in zip(jax.tree.leaves(first["params"]),
                                   jax.tree.leaves(later["params"]))]  # fmt: skip
    assert all(np.all(a == b) for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(again)))
    assert all(np.all(d != 0) for d in noise)


def test_the_adaptive_clip_is_server_state_and_a_metric():
    algo = ALGORITHMS["dp_adaptive"]()
    state = init(algo)
    assert float(state["aggregator"]["clip"]) == 1.0
    args = round_args(algo, state, make_data(), COUNTS)
    module = fcir.capture(algo.round(clients=N), *args)
    new, metrics = reference.run(module, *args)
    assert sorted(metrics) == ["clip"]  # no training loss: it would leak
    assert float(new["aggregator"]["clip"]) == float(metrics["clip"]) != 1.0


ROBUST = ["median", "trimmed_mean", "krum", "multi_krum", "bulyan", "geometric_median"]


def test_robust_aggregators_resist_a_byzantine_member_the_mean_does_not():
    """Member 0 reports labels 1000 times too large: the mean's bias moves by more than
    5 from the honest members' round (8.7 measured), the robust rules' by less than 0.5
    (0.03 to 0.16)."""
    data = make_data()
    data["y"][0] *= 1000.0
    honest = jax.tree.map(lambda x: x[1:], data)
    plain = ALGORITHMS["fedavg"]()
    start = plain.init(init_params())
    clean, _ = jax.jit(plain.round(clients=N - 1))(start, honest)
    attacked, _ = jax.jit(plain.round(clients=N))(start, data)
    far = np.max(np.abs(attacked["params"]["b"] - clean["params"]["b"]))
    assert far > 5
    for name in ROBUST:
        algo = ALGORITHMS[name]()
        state, _ = jax.jit(algo.round(clients=N))(start, data)
        off = np.max(np.abs(state["params"]["b"] - clean["params"]["b"]))
        assert off < 0.5, (name, off)
