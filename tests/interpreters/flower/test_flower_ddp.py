"""Distributed DP rounds (fcir.ddp_mean) exported to Flower and run in-process
(tests/flowerlib/inprocess.py): the clients quantize and noise on the device, the
modular sum goes through SecAgg+ exactly, and the server decodes; the outputs are the
reference interpreter's bit for bit."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fcir.interpreters import flower, reference
from flowerlib import inprocess, rounds

import fcir

pytest.importorskip("flwr", reason="the Flower tests need flwr (pip install 'fcir[flower]')")

N = rounds.NODES
BITS = 16


@fcir.program(placements={"clients": N}, private=True)
def ddp_round(w, r, seeds, x):
    """Each node holds a secret seed; the round number (public) makes each round's keys."""
    keys = fcir.map_fn(lambda k, r: jax.random.fold_in(k, r), (seeds, fcir.broadcast(r)))
    upd = fcir.map_fn(lambda w, x: jnp.mean(x, 0) - w, (fcir.broadcast(w), x))
    return w + fcir.ddp_mean(upd, 1.0, 1.0, keys, bits=BITS)


def _setup(tmp_path):
    w, r = jnp.zeros(4), jnp.int32(3)
    seeds = jax.random.key_data(jax.random.split(jax.random.key(1), N))
    x = jnp.asarray(np.random.default_rng(0).normal(size=(N, 5, 4)), jnp.float32)
    module = fcir.capture(ddp_round, w, r, seeds, x)
    app = flower.export(module, tmp_path / "app", inputs=[np.asarray(w), np.asarray(r)])
    nodes = {}
    for i in range(N):
        np.savez(tmp_path / f"n{i}.npz", np.asarray(seeds[i]), np.asarray(x[i]))
        nodes[10 + i] = {"partition-id": i, "data-path": str(tmp_path / f"n{i}.npz")}
    return module, app, nodes, (w, r, seeds, x)


def _out(path):
    with np.load(path) as f:
        return f["arr_0"]


@pytest.mark.slow  # 4 s (docs/contributing.md)
def test_ddp_round_goes_through_secagg_plus_bit_for_bit(tmp_path):
    module, app, nodes, args = _setup(tmp_path)
    plan = rounds.plan_of(app)
    (exchange,) = [s for s in plan["steps"] if s["kind"] == "exchange"]
    assert [(a["fed_op"], a["bitwidth"]) for a in exchange["aggregations"]] == [
        ("fed.secure_sum", BITS)
    ]
    (release,) = plan["privacy"]["releases"]
    assert (release["op"], release["bits"]) == ("fed.ddp_mean", BITS)
    assert plan["privacy"]["mechanism"].startswith("distributed discrete Gaussian")
    assert plan["privacy"]["epsilon_per_round"] == fcir.privacy.epsilon(module, 1, 1e-5)

    grid = inprocess.run(app, nodes, {"output": str(tmp_path / "a.npz")})
    assert len(grid.sent) == 4 * N  # SecAgg+'s four stages
    want = np.asarray(reference.run(module, *args))
    assert np.array_equal(_out(tmp_path / "a.npz"), want)


def test_without_secagg_the_server_still_only_sees_noised_residues(tmp_path, monkeypatch):
    module, app, nodes, args = _setup(tmp_path)
    replies = []

    class Recording(inprocess.Grid):
        def send_and_receive(self, messages, *, timeout=None):
            out = super().send_and_receive(messages, timeout=timeout)
            replies.extend(r for r in out if not r.has_error())
            return out

    monkeypatch.setattr(inprocess, "Grid", Recording)
    grid = inprocess.run(app, nodes, {"output": str(tmp_path / "b.npz"), "secagg": False})
    assert len(grid.sent) == N
    assert np.array_equal(_out(tmp_path / "b.npz"), np.asarray(reference.run(module, *args)))
    for reply in replies:
        (vals,) = grid.app.server.runtime.from_record(reply.content["arrays"]).values()
        assert vals.dtype == np.uint32 and int(vals.max()) < 2**BITS
        assert vals.shape == (4,)  # D = 4: one residue per rotated coordinate


@fcir.program(placements={"clients": N}, private=True)
def ddp_round_two_shares(w, r, seeds, x):
    """ddp_round with min_clients=2: each node noises for 2 shares, so 2 replies suffice."""
    keys = fcir.map_fn(lambda k, r: jax.random.fold_in(k, r), (seeds, fcir.broadcast(r)))
    upd = fcir.map_fn(lambda w, x: jnp.mean(x, 0) - w, (fcir.broadcast(w), x))
    return w + fcir.ddp_mean(upd, 1.0, 1.0, keys, bits=BITS, min_clients=2)


@pytest.mark.slow  # 6 s (docs/contributing.md)
def test_a_ddp_round_with_fewer_replies_than_min_clients_is_refused(tmp_path):
    """The plan states each exchange's min_replies (the ddp op's min_clients, the
    cardinality by default); the ServerApp refuses an exchange with fewer replies,
    saying why, and writes nothing; at min_clients replies the round is released."""
    module, app, nodes, args = _setup(tmp_path)
    (exchange,) = [s for s in rounds.plan_of(app)["steps"] if s["kind"] == "exchange"]
    assert exchange["min_replies"] == N  # by default every client's noise share
    out = tmp_path / "refused.npz"
    # min-train-nodes=1: the ddp rule, not FedAvg's two training nodes, is what refuses
    config = {"output": str(out), "secagg": False, "timeout": 1.0, "min-train-nodes": 1}
    with pytest.raises(RuntimeError, match=rf"round 1: {N - 1} of {N} sampled clients replied, "
                       rf"but the distributed DP release .* at least {N} clients"):
        inprocess.run(app, nodes, config, silent={10})
    assert not out.exists()

    two = fcir.capture(ddp_round_two_shares, *args)
    app2 = flower.export(two, tmp_path / "app2", inputs=[np.asarray(a) for a in args[:2]])
    (exchange,) = [s for s in rounds.plan_of(app2)["steps"] if s["kind"] == "exchange"]
    assert exchange["min_replies"] == 2
    (release,) = rounds.plan_of(app2)["privacy"]["releases"]
    assert release["min_clients"] == 2
    with pytest.raises(RuntimeError, match="at least 2 clients"):
        inprocess.run(app2, nodes, {**config, "output": str(out)}, silent={10, 11})
    assert not out.exists()
    inprocess.run(app2, nodes, {**config, "output": str(out)}, silent={10})
    assert out.exists() and np.all(np.isfinite(_out(out)))
