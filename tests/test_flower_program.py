"""Whole training programs on Flower: a main that runs its rounds in a server
``lax.scan``, ``fori_loop`` or ``while_loop`` exports as an app running one Flower round
per iteration (in-process grid, as test_flower_app.py), and writes what reference.run
returns for the whole program."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from corpus.compare import assert_trees_match
from fcir.interpreters import flower, reference
from flowerlib import inprocess, rounds

import fcir

pytest.importorskip("flwr", reason="the Flower tests need flwr (pip install 'fcir[flower]')")

N = rounds.NODES


def _outputs(path) -> list:
    with np.load(path) as f:
        return [f[f"arr_{i}"] for i in range(len(f.files))]


def _nodes(root, client_leaves) -> dict:
    nodes = {}
    for i in range(N):
        np.savez(root / f"n{i}.npz", *(np.asarray(x)[i] for x in client_leaves))
        nodes[40 + i] = {"partition-id": i, "data-path": str(root / f"n{i}.npz")}
    return nodes


def _reference(module, args) -> list:
    flat = jax.tree.leaves(reference.run(module, *args))
    return [np.asarray(flat[i]) for i in rounds.output_order(module)]


def _assert_same(got, want):
    assert [(g.dtype, g.shape) for g in got] == [(w.dtype, w.shape) for w in want]
    assert_trees_match(got, want, rtol=1e-5, atol=1e-6)


def test_a_scan_of_rounds_runs_one_flower_round_per_iteration_and_resumes(tmp_path, capsys):
    """scan_rounds (FedAvg with server momentum in a lax.scan over 3 rounds): one Flower
    round (one message per node) per iteration, the carry kept at the server, the losses
    stacked; the output file is reference.run's results. Checkpointed each round: a run
    started again after round 2 runs round 3 only and writes the same bytes."""
    r = rounds.corpus_round("scan_rounds")
    with pytest.raises(fcir.FcirError, match="one round per iteration"):
        from fcir.interpreters import production

        production.export(r.module)
    app = rounds.export(r, tmp_path / "app")
    plan = rounds.plan_of(app)
    assert plan["loop"]["kind"] == "scan" and plan["loop"]["length"] == 3
    nodes = _nodes(tmp_path, [x for x, c in zip(r.leaves, r.is_client) if c])
    ckpt = tmp_path / "ckpt"
    grid = inprocess.run(
        app, nodes, {"output": str(tmp_path / "o.npz"), "checkpoint-dir": str(ckpt)}
    )
    assert len(grid.sent) == 3 * N
    said = capsys.readouterr().out
    assert "round 3/3: 3/3 clients replied" in said and "ys_0=" in said, said
    got = _outputs(tmp_path / "o.npz")
    _assert_same(got, rounds.reference_outputs(r))
    assert sorted(p.name for p in ckpt.iterdir() if p.name.isdigit()) == ["2", "3"]
    import shutil

    shutil.rmtree(ckpt / "3")
    grid = inprocess.run(
        app, nodes, {"output": str(tmp_path / "p.npz"), "checkpoint-dir": str(ckpt)}
    )
    assert len(grid.sent) == N  # round 3 only
    assert "resuming after round 2" in capsys.readouterr().out
    assert [g.tobytes() for g in _outputs(tmp_path / "p.npz")] == [g.tobytes() for g in got]
    with pytest.raises(RuntimeError, match="runs its own scan of rounds"):
        inprocess.run(app, nodes, {"rounds": 3})
    from fcir.interpreters.flower.cli import run_hint

    assert run_hint(app).endswith("--run-config 'output=\"/abs/out.npz\"'")  # no rounds/state


@fcir.program(placements={"clients": N})
def fori_two_exchanges(w, lrs, x):
    """A fori_loop-style counter, a per-round learning rate scanned over (server xs),
    and two exchanges per iteration (the mean is broadcast back for a spread), then
    server code after the loop."""

    def one_round(carry, lr):
        w, step = carry
        mean = fcir.reduce_mean(
            fcir.map_fn(lambda w, x: jnp.mean(x, axis=0) - w, (fcir.broadcast(w), x))
        )
        w = w + lr * mean
        spread = fcir.reduce_mean(
            fcir.map_fn(lambda w, x: jnp.mean(jnp.square(x - w)), (fcir.broadcast(w), x))
        )
        return (w, step + 1), spread

    (w, steps), spreads = jax.lax.scan(one_round, (w, jnp.int32(0)), lrs, reverse=True)
    return {"w": w * 2.0, "steps": steps, "spreads": spreads, "last": spreads[0]}


def test_a_reverse_scan_with_server_xs_and_two_exchanges_per_iteration(tmp_path):
    w = jnp.zeros(4, jnp.float32)
    lrs = jnp.asarray([0.5, 0.25, 0.125, 0.0625], jnp.float32)
    x = jnp.asarray(np.random.default_rng(2).normal(size=(N, 6, 4)), jnp.float32)
    module = fcir.capture(fori_two_exchanges, w, lrs, x)
    app = flower.export(module, tmp_path / "app", inputs=[np.asarray(w), np.asarray(lrs)])
    grid = inprocess.run(app, _nodes(tmp_path, [x]), {"output": str(tmp_path / "o.npz")})
    assert len(grid.sent) == 4 * 2 * N  # 4 rounds, 2 exchanges each
    _assert_same(_outputs(tmp_path / "o.npz"), _reference(module, (w, lrs, x)))


@fcir.program(placements={"clients": N})
def train_until(w, target, x):
    """A while_loop over rounds: its condition (at the server) reads the carry."""

    def cond(c):
        w, loss, i = c
        return jnp.logical_and(loss > target, i < 10)

    def body(c):
        w, _, i = c
        grads, losses = fcir.map_fn(
            lambda w, x: jax.value_and_grad(lambda w: jnp.mean(jnp.square(x - w)))(w)[::-1],
            (fcir.broadcast(w), x),
        )
        return w - 0.3 * fcir.reduce_mean(grads), fcir.reduce_mean(losses), i + 1

    w, loss, i = jax.lax.while_loop(cond, body, (w, jnp.float32(jnp.inf), jnp.int32(0)))
    return w, loss, i


def test_a_while_loop_of_rounds_evaluates_its_condition_at_the_server(tmp_path):
    w = jnp.zeros(3, jnp.float32)
    x = jnp.asarray(1.0 + 0.1 * np.random.default_rng(3).normal(size=(N, 5, 3)), jnp.float32)
    target = jnp.float32(0.3)
    module = fcir.capture(train_until, w, target, x)
    want = _reference(module, (w, target, x))
    app = flower.export(module, tmp_path / "app", inputs=[np.asarray(w), np.asarray(target)])
    assert rounds.plan_of(app)["loop"]["kind"] == "while"
    grid = inprocess.run(app, _nodes(tmp_path, [x]), {"output": str(tmp_path / "o.npz")})
    rounds_run = int(want[2])
    assert 1 < rounds_run < 10 and len(grid.sent) == rounds_run * N
    _assert_same(_outputs(tmp_path / "o.npz"), want)


@fcir.program(placements={"clients": N})
def client_code_before_the_loop(w, x):
    x2 = fcir.map_fn(lambda x: 2.0 * x, x)

    def one_round(w, _):
        return fcir.reduce_mean(
            fcir.map_fn(lambda w, x: w + jnp.mean(x), (fcir.broadcast(w), x2))
        ), None

    return jax.lax.scan(one_round, w, None, length=2)[0]


def test_programs_that_are_not_a_server_loop_of_rounds_are_refused(tmp_path):
    w, x = jnp.zeros(2, jnp.float32), jnp.ones((N, 4), jnp.float32)
    module = fcir.capture(client_code_before_the_loop, w, x)
    with pytest.raises(flower.ExportError, match="before the loop"):
        flower.export(module, tmp_path / "app")
    assert not (tmp_path / "app").exists()
