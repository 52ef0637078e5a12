"""A private Flower app run for several rounds must not draw the same DP noise in every
round: every server input that no state feeds, and every client input, is the same in
each round, so a key derived from them alone is too, and the difference of two rounds'
releases is noise-free while the accountant composes them as independent releases.
The ServerApp refuses such a run before round 1 (plan.json's privacy ``keys``, from
fcir.privacy.keys.key_arguments at export)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fcir.interpreters import flower, reference
from fcir.interpreters.flower.cli import run_hint
from flowerlib import files, inprocess, rounds
from flowerlib.programs import CLIP, Z, private_fedavg

import fcir
from fcir.privacy.keys import key_arguments

pytest.importorskip("flwr", reason="the Flower tests need flwr (pip install 'fcir[flower]')")

N = rounds.NODES
KEY = jax.random.key_data(jax.random.key(3))


class CountingGrid(inprocess.Grid):
    """The in-process grid; ``SENT`` counts the messages of every run."""

    SENT: list = []

    def send_and_receive(self, messages, *, timeout=None):
        CountingGrid.SENT += list(messages)
        return super().send_and_receive(messages, timeout=timeout)


@pytest.fixture
def counting(monkeypatch):
    CountingGrid.SENT = []
    monkeypatch.setattr(inprocess, "Grid", CountingGrid)
    return CountingGrid


def _leaky_app(tmp_path):
    """private_fedavg ``(w, b, key, x, y) -> (w', b')``: state w, b; the key is a server
    input no state feeds."""
    rng = np.random.default_rng(0)
    w, b = jnp.zeros((4, 2), jnp.float32), jnp.full((2,), 0.1, jnp.float32)
    x = jnp.asarray(rng.normal(size=(N, 5, 4)), jnp.float32)
    y = jnp.asarray(rng.normal(size=(N, 5, 2)), jnp.float32)
    module = fcir.capture(private_fedavg(fcir.dp_mean), w, b, KEY, x, y)
    app = flower.export(module, tmp_path / "app", inputs=[np.asarray(w), np.asarray(b), KEY])
    nodes = files.write_nodes(tmp_path, [[x[i], y[i]] for i in range(N)], 10)
    return app, nodes


def test_a_key_no_state_feeds_is_refused_before_round_1_naming_the_release(tmp_path, counting):
    app, nodes = _leaky_app(tmp_path)
    plan = rounds.plan_of(app)
    assert plan["privacy"]["keys"] == [
        {"op": "fed.dp_mean", "clip_norm": CLIP, "noise_multiplier": Z, "arguments": [2]}
    ]
    with pytest.raises(
        Exception, match="fed.dp_mean \\(clip_norm=0.5, noise_multiplier=1.1\\)"
    ) as e:
        inprocess.run(app, nodes, {"num-server-rounds": 3})
    assert type(e.value).__name__ == "AppError"
    assert "its key is the same every round" in str(e.value)
    assert "jax.random.fold_in(key, r)" in str(e.value) and "num-server-rounds=1" in str(e.value)
    assert counting.SENT == []  # before round 1: nothing reached a client
    # fcir export's "run it:" hint suggests one round, not the refused num-server-rounds=3.
    assert run_hint(app).endswith("--run-config 'num-server-rounds=1'")
    # state="none" repeats the round on purpose: the same noise again, refused too.
    with pytest.raises(Exception, match="same every round"):
        inprocess.run(app, nodes, {"num-server-rounds": 2, "state": "none"})


def test_the_same_round_with_rounds_1_runs(tmp_path, counting):
    app, nodes = _leaky_app(tmp_path)
    inprocess.run(app, nodes, {"output": str(tmp_path / "o.npz")})
    assert len(files.read_outputs(tmp_path / "o.npz")) == 2 and len(counting.SENT) == N


@fcir.program(placements={"clients": N}, private=True)
def drift(w, r, key, x):
    """Every round releases the same clipped mean (the clients' data do not change) plus
    the noise of the key folded with the round number: the increment of w is the noise."""
    upd = fcir.map_fn(lambda x: jnp.mean(x, axis=0), (x,))
    return w + fcir.dp_mean(upd, 1.0, 1.0, jax.random.fold_in(key, r)), r + 1


@pytest.mark.slow  # 4 s (docs/contributing.md)
def test_a_round_folding_its_state_fed_counter_draws_fresh_noise_each_round(tmp_path):
    w, r = jnp.zeros((3,), jnp.float32), jnp.int32(0)
    x = jnp.asarray(np.random.default_rng(1).normal(size=(N, 4, 3)), jnp.float32)
    module = fcir.capture(drift, w, r, KEY, x)
    app = flower.export(module, tmp_path / "app", inputs=[np.asarray(w), np.asarray(r), KEY])
    assert rounds.plan_of(app)["privacy"]["keys"][0]["arguments"] == [1, 2]
    assert run_hint(app).endswith('--run-config \'num-server-rounds=3 state="0=0,1=1"\'')
    nodes = files.write_nodes(tmp_path, [[x[i]] for i in range(N)], 10)
    ws = [np.asarray(w)]
    for k in (1, 2, 3):  # deterministic runs: w after k rounds
        out = str(tmp_path / f"o{k}.npz")
        inprocess.run(app, nodes, {"num-server-rounds": k, "output": out})
        got_w, got_r = files.read_outputs(out)
        assert int(got_r) == k
        ws.append(got_w)
    # The rounds ran as the reference interpreter runs the round 3 times.
    ref_w, ref_r = w, r
    for k in (1, 2, 3):
        ref_w, ref_r = reference.run(module, ref_w, ref_r, KEY, x)
        np.testing.assert_allclose(ws[k], np.asarray(ref_w), rtol=1e-5, atol=1e-5)
    steps = [ws[k] - ws[k - 1] for k in (1, 2, 3)]  # mean + noise of round k
    for a in range(3):
        for c in range(a + 1, 3):
            assert np.min(np.abs(steps[a] - steps[c])) > 1e-3, (a, c)  # noises differ


@fcir.program(placements={"clients": N}, private=True)
def ddp_unfolded(w, r, seeds, x):
    """Per-client keys folded with r, but r is not state: (w, r, seeds, x) -> w."""
    keys = fcir.map_fn(lambda k, r: jax.random.fold_in(k, r), (seeds, fcir.broadcast(r)))
    upd = fcir.map_fn(lambda w, x: jnp.mean(x, 0) - w, (fcir.broadcast(w), x))
    return w + fcir.ddp_mean(upd, 1.0, 1.0, keys, bits=16)


@fcir.program(placements={"clients": N}, private=True)
def ddp_folded(w, r, seeds, x):
    """The same round with its counter as state: (w, r, seeds, x) -> (w, r + 1)."""
    return ddp_unfolded.__wrapped__(w, r, seeds, x), r + 1


def _ddp_app(tmp_path, program):
    w, r = jnp.zeros(4), jnp.int32(0)
    seeds = jax.random.key_data(jax.random.split(jax.random.key(1), N))
    x = jnp.asarray(np.random.default_rng(0).normal(size=(N, 5, 4)), jnp.float32)
    module = fcir.capture(program, w, r, seeds, x)
    app = flower.export(module, tmp_path / "app", inputs=[np.asarray(w), np.asarray(r)])
    nodes = files.write_nodes(tmp_path, [[seeds[i], x[i]] for i in range(N)], 10)
    return module, app, nodes, (w, r, seeds, x)


def test_a_ddp_round_whose_client_keys_no_state_changes_is_refused(tmp_path, counting):
    _, app, nodes, _ = _ddp_app(tmp_path, ddp_unfolded)
    with pytest.raises(Exception, match="fed.ddp_mean .*its key is the same every round") as e:
        inprocess.run(app, nodes, {"num-server-rounds": 2, "state": "0=0"})  # w feeds w
    assert type(e.value).__name__ == "AppError" and counting.SENT == []


def test_a_ddp_round_folding_a_state_fed_counter_runs_several_rounds(tmp_path):
    module, app, nodes, (w, r, seeds, x) = _ddp_app(tmp_path, ddp_folded)
    out = str(tmp_path / "o.npz")
    inprocess.run(app, nodes, {"num-server-rounds": 2, "output": out})
    for _ in range(2):
        w, r = reference.run(module, w, r, seeds, x)
    got = files.read_outputs(out)
    np.testing.assert_allclose(got[0], np.asarray(w), rtol=1e-6, atol=1e-6)  # float32 ulps
    assert int(got[1]) == 2


def test_key_arguments_follows_operands_and_gives_nested_releases_the_enclosing_ops():
    @fcir.program(placements={"clients": N}, private=True)
    def nested(w, r, key, other, x):
        k0, k1 = jax.random.fold_in(key, 0), jax.random.fold_in(key, 1)

        def body(w, i):
            upd = fcir.map_fn(lambda w, x: jnp.mean(x, 0) - w, (fcir.broadcast(w), x))
            return w + fcir.dp_mean(upd, 1.0, 1.0, jax.random.fold_in(k0, i)), None

        w, _ = jax.lax.scan(body, w, jnp.arange(2))
        top = fcir.map_fn(lambda x: jnp.mean(x, 0), (x,))
        return w + fcir.dp_mean(top, 2.0, 1.0, jax.random.fold_in(k1, r)) + other

    w, x = jnp.zeros((2,), jnp.float32), jnp.ones((N, 4, 2), jnp.float32)
    module = fcir.capture(nested, w, jnp.int32(0), KEY, jnp.float32(1), x)
    got = [(op.attrs["clip_norm"], sorted(deps)) for op, deps in key_arguments(module)]
    # The scan's release takes every operand of the scan (w, key, x: over-approximated);
    # the top-level one its key's (key, r); neither depends on `other` (3).
    assert got == [(1.0, [0, 2, 4]), (2.0, [1, 2])]
