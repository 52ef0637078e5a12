"""fcir.dp_mean_adaptive against an independent implementation of Andrew et al.'s
adaptive clipping ("Differentially Private Learning with Adaptive Clipping", NeurIPS
2021, Algorithm 1 with the geometric update) in plain numpy, given the same standard
normal draws; its ε against the Rényi DP of one Gaussian mechanism with the declared
noise multiplier (the paper's Theorem 1), computed here from the formulas; the leak
check on the new clip; every interpreter in this process (reference, XLA, streamed)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fcir.interpreters import reference, xla

import fcir
from fcir.mechanisms.gaussian import standard_normal

N = 8
Z = 1.2  # the round's declared noise multiplier
SIGMA_B = 1.0  # the count's noise std (the paper's sigma_b)
GAMMA, ETA = 0.6, 0.3
ROUNDS = 4
DELTA = 1e-5
KEY = jax.random.key(7)


@fcir.program(placements={"clients": N}, private=True)
def adaptive_round(w, clip, key, xa, xb):
    """One round: each client's update is its data minus the model (two leaves)."""
    upd = fcir.map_fn(
        lambda w, a, b: {"a": a - w["a"], "b": b - w["b"]}, (fcir.broadcast(w), xa, xb)
    )
    mean, clip = fcir.dp_mean_adaptive(
        upd, clip, Z, key, target_quantile=GAMMA, learning_rate=ETA, count_stddev=SIGMA_B
    )
    return jax.tree.map(lambda p, u: p + u, w, mean), clip


def _data():
    rng = np.random.default_rng(0)
    scale = np.geomspace(0.1, 3.0, N)[:, None]  # norms spread around the clip
    xa = jnp.asarray(rng.normal(size=(N, 3)) * scale, jnp.float32)
    xb = jnp.asarray(rng.normal(size=(N, 2)) * scale, jnp.float32)
    w = {"a": jnp.zeros(3, jnp.float32), "b": jnp.zeros(2, jnp.float32)}
    return w, jnp.float32(0.5), xa, xb


@pytest.fixture(scope="module")
def module():
    w, clip, xa, xb = _data()
    return fcir.capture(adaptive_round, w, clip, KEY, xa, xb)


def _run(fn, rounds=ROUNDS):
    """``rounds`` rounds of ``fn(w, clip, key, xa, xb)``, round r keyed fold_in(KEY, r);
    the (model, clip) after each."""
    w, clip, xa, xb = _data()
    out = []
    for r in range(rounds):
        w, clip = fn(w, clip, jax.random.fold_in(KEY, r), xa, xb)
        out.append((jax.tree.map(np.asarray, w), float(clip)))
    return out


def _draws(r):
    """Round r's standard normal draws as the DP ops take them (fcir.dp_noise: leaf i of
    a release keyed k draws from fold_in(k, i)): update leaves a, b; the count."""
    k = jax.random.fold_in(KEY, r)
    ku, kb = jax.random.fold_in(k, 0), jax.random.fold_in(k, 1)
    # dp_mean's leaves are in pytree order: "a" then "b".
    na = np.asarray(standard_normal(jax.random.fold_in(ku, 0), (3,)), np.float64)
    nb = np.asarray(standard_normal(jax.random.fold_in(ku, 1), (2,)), np.float64)
    nc = float(standard_normal(jax.random.fold_in(kb, 0), ()))
    return np.concatenate([na, nb]), nc


def paper(rounds=ROUNDS):
    """Andrew et al., Algorithm 1 (DP-FedAvg with adaptive clipping, geometric update),
    in float64, written from the paper: with m clients and the total noise multiplier
    z, the count is noised with std sigma_b and the update with noise multiplier
    z_delta = (z^-2 - (2 sigma_b)^-2)^(-1/2)."""
    w0, c0, xa, xb = _data()
    x = np.concatenate([np.asarray(xa, np.float64), np.asarray(xb, np.float64)], axis=1)
    w = np.concatenate([np.asarray(w0["a"]), np.asarray(w0["b"])]).astype(np.float64)
    clip = float(c0)
    z_delta = (Z**-2 - (2 * SIGMA_B) ** -2) ** -0.5
    out = []
    for r in range(rounds):
        noise, count_noise = _draws(r)
        deltas = x - w
        norms = np.linalg.norm(deltas, axis=1)
        clipped = deltas * np.minimum(1.0, clip / norms)[:, None]
        b = (norms <= clip).astype(np.float64)
        w = w + (clipped.sum(axis=0) + z_delta * clip * noise) / N
        b_tilde = (b.sum() + SIGMA_B * count_noise) / N
        clip = clip * math.exp(-ETA * (b_tilde - GAMMA))
        out.append((w.copy(), clip))
    return out


def rdp_gaussian_epsilon(z, rounds, delta):
    """ε of ``rounds`` compositions of the Gaussian mechanism with noise multiplier z:
    RDP α/(2z²) per round (Mironov 2017), to (ε, δ) by Balle et al. 2020's Proposition
    12, minimized over the orders 1.1..10.9 (step 0.1), 11..63, 128, 256, 512, 1024."""
    orders = np.concatenate(
        [1 + np.arange(1, 100) / 10.0, np.arange(11, 64), [128, 256, 512, 1024]]
    )
    rdp = rounds * orders / (2 * z**2)
    eps = rdp + np.log1p(-1 / orders) - np.log(delta * orders) / (orders - 1)
    return float(max(0.0, eps.min()))


def test_clip_trajectory_and_epsilon_match_the_paper(module):
    want = paper()
    got = _run(lambda *a: reference.run(module, *a))
    clips = [c for _, c in got]
    np.testing.assert_allclose(clips, [c for _, c in want], rtol=1e-6, atol=1e-6)
    assert len(set(np.round(clips, 4))) == ROUNDS  # the clip moved every round
    for (gw, _), (ww, _) in zip(got, want):
        np.testing.assert_allclose(np.concatenate([gw["a"], gw["b"]]), ww, rtol=1e-5, atol=1e-5)
    for rounds in (1, ROUNDS, 100):
        eps = fcir.privacy.epsilon(module, rounds, DELTA)
        assert eps == pytest.approx(rdp_gaussian_epsilon(Z, rounds, DELTA), rel=1e-6)

    # The round's IR (no op of its own) round-trips through text and protobuf, and the
    # accountant reads the same releases from either.
    for again in (fcir.parse(module.to_text()), fcir.Module.deserialize(module.serialize())):
        assert again.to_text() == module.to_text()
        assert fcir.privacy.releases(again) == fcir.privacy.releases(module)

    # Poisson-sampled rounds: the round's two releases merge into one Gaussian with z.
    @fcir.program(placements={"clients": N}, private=True)
    def fixed_clip(w, key, xa):
        return w + fcir.dp_mean(
            fcir.map_fn(lambda w, a: a - w, (fcir.broadcast(w), xa)), 1.0, Z, key
        )

    w, _, xa, _ = _data()
    plain = fcir.capture(fixed_clip, w["a"], KEY, xa)
    sampled = fcir.privacy.epsilon(module, 50, DELTA, sampling_rate=0.2)
    assert sampled == pytest.approx(fcir.privacy.epsilon(plain, 50, DELTA, 0.2), rel=1e-9)
    # The two releases the accountant reads: the update's and the count's.
    rels = fcir.privacy.releases(module)
    assert [(r.op, r.clip_norm) for r in rels] == [("fed.dp_mean", 1.0), ("fed.dp_sum", 0.5)]
    z_update = fcir.fed.dp_adaptive.update_noise_multiplier(Z, SIGMA_B)
    assert [r.noise_multiplier for r in rels] == [z_update, 2 * SIGMA_B]
    assert z_update > Z


def test_xla_and_streamed_rounds_carry_the_reference_clip(module):
    want = _run(lambda *a: reference.run(module, *a), 2)
    for exe in (xla.compile(module), xla.compile(module, clients_per_step=3)):
        got = _run(exe, 2)
        for (gw, gc), (ww, wc) in zip(got, want):
            assert gc == pytest.approx(wc, rel=1e-6)
            np.testing.assert_allclose(gw["a"], ww["a"], rtol=1e-5, atol=1e-6)


def test_a_clip_moved_by_an_un_noised_count_is_a_leak():
    @fcir.program(placements={"clients": N}, private=True)
    def plain_quantile(w, clip, key, xa, xb):
        upd = fcir.map_fn(lambda w, a: a - w, (fcir.broadcast(w["a"]), xa))
        bits = fcir.map_fn(
            lambda c, u: (jnp.linalg.norm(u) <= c).astype(jnp.float32), (fcir.broadcast(clip), upd)
        )
        mean = fcir.dp_mean(upd, 1.0, Z, key)
        clip = clip * jnp.exp(-ETA * (fcir.reduce_mean(bits) - GAMMA))
        return {"a": w["a"] + mean, "b": w["b"]}, clip

    w, clip, xa, xb = _data()
    with pytest.raises(fcir.PrivacyError, match=r"privacy/C1: fed.mean releases a value derived"):
        fcir.capture(plain_quantile, w, clip, KEY, xa, xb)
    # The adaptive round passes the same check (capture ran it) and its new clip is no leak.
    assert fcir.privacy.leaks(fcir.capture(adaptive_round, w, clip, KEY, xa, xb)) == []


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"count_stddev": 0.5}, r"noise_multiplier=1.2 needs count_stddev > 0.6"),
        ({"target_quantile": 1.5}, r"target_quantile must be a Python number in \[0, 1\]"),
        ({"learning_rate": -1.0}, r"learning_rate must be a Python number in \[0, inf\]"),
    ],
)
def test_bad_hyperparameters_are_refused_while_tracing(kwargs, match):
    @fcir.program(placements={"clients": N}, private=True)
    def bad(clip, key, x):
        return fcir.dp_mean_adaptive(x, clip, Z, key, **kwargs)

    with pytest.raises(fcir.PlacementError, match=match):
        fcir.capture(bad, jnp.float32(1.0), KEY, jnp.ones((N, 2), jnp.float32))


@pytest.mark.slow  # the digits example end to end (docs/contributing.md)
def test_the_digits_example_adapts_its_clip_at_the_float_mode_s_epsilon(tmp_path):
    pytest.importorskip("sklearn")
    from examples_testing import load

    curves = load("dp_fedavg_digits").main(
        ["--rounds", "2", "--ddp-bits", "--mode", "adaptive", "--output", str(tmp_path / "a.png")]
    )
    assert len(curves["dp_fedavg"]) == 2 and len(curves["clip"]) == 2
    assert 0.5 != curves["clip"][0] != curves["clip"][1]  # --clip-norm 0.5 is the first clip
    # The example's z = 4 in total, as in --mode float.
    want = [rdp_gaussian_epsilon(4.0, r, 1e-5) for r in (1, 2)]
    np.testing.assert_allclose(curves["epsilon"], want, rtol=1e-6)


@pytest.mark.slow  # 6 s (docs/contributing.md)
def test_distributed_adaptive_clipping_is_accounted_at_the_declared_z():
    """fcir.ddp_mean_adaptive: both releases calibrated so the accountant's noise
    multipliers compose to Z (ε at most, and within 1e-6 of, the Gaussian's); streamed
    as unstreamed; the clip moves."""

    @fcir.program(placements={"clients": N}, private=True)
    def ddp_round(w, clip, keys, xa):
        upd = fcir.map_fn(lambda w, a: a - w, (fcir.broadcast(w), xa))
        mean, clip = fcir.ddp_mean_adaptive(
            upd, clip, Z, keys, bits=16, target_quantile=GAMMA, count_stddev=SIGMA_B
        )
        return w + mean, clip

    w, clip, xa, _ = _data()
    args = (w["a"], clip, jax.random.split(KEY, N), xa)
    module = fcir.capture(ddp_round, *args)
    rels = fcir.privacy.releases(module)
    assert [(r.op, r.clip_norm) for r in rels] == [("fed.ddp_mean", 1.0), ("fed.ddp_sum", 0.5)]
    accounted = sum(r.accounted_noise_multiplier**-2 for r in rels) ** -0.5
    assert accounted == pytest.approx(Z, rel=1e-8) and accounted >= Z
    for rounds in (1, 100):
        eps = fcir.privacy.epsilon(module, rounds, DELTA)
        want = rdp_gaussian_epsilon(Z, rounds, DELTA)
        assert eps <= want and eps == pytest.approx(want, rel=1e-6)
    got = xla.compile(module)(*args)
    streamed = xla.compile(module, clients_per_step=3)(*args)
    assert float(got[1]) != float(clip)
    np.testing.assert_array_equal(np.asarray(streamed[1]), np.asarray(got[1]))
    np.testing.assert_allclose(streamed[0], got[0], rtol=1e-6, atol=1e-7)
