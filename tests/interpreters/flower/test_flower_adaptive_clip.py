"""fcir.dp_mean_adaptive exported: the production bundle computes the reference's round,
and a Flower app run in-process (tests/flowerlib/inprocess.py) carries the clip from
round to round as state, to the reference's clip after the same rounds."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fcir.interpreters import flower, production, reference
from flowerlib import files, inprocess, rounds

import fcir

pytest.importorskip("flwr", reason="the Flower tests need flwr (pip install 'fcir[flower]')")

N = rounds.NODES
KEY = jax.random.key_data(jax.random.key(5))  # production wire types carry raw key bits


@fcir.program(placements={"clients": N}, private=True)
def adaptive_rounds(w, clip, r, key, x):
    """``(w, clip, r, key, x) -> (w', clip', r + 1)``: the clip and the round number are
    state; the round number is folded into the key so each round draws fresh noise."""
    upd = fcir.map_fn(lambda w, x: x - w, (fcir.broadcast(w), x))
    mean, clip = fcir.dp_mean_adaptive(
        upd, clip, 1.0, jax.random.fold_in(key, r), target_quantile=0.7, count_stddev=1.0
    )
    return w + mean, clip, r + 1


@pytest.mark.slow  # 9 s (docs/contributing.md)
def test_the_bundle_and_a_flower_run_carry_the_reference_clip(tmp_path):
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.normal(size=(N, 4)) * np.array([[0.2], [1.0], [4.0]]), jnp.float32)
    w, clip, r0 = jnp.zeros(4, jnp.float32), jnp.float32(0.5), jnp.int32(0)
    module = fcir.capture(adaptive_rounds, w, clip, r0, KEY, x)

    bundle = production.export(module).write(tmp_path / "bundle")
    got = production.run_bundle(bundle, w, clip, r0, KEY, x)
    want = reference.run(module, w, clip, r0, KEY, x)
    assert float(got[1]) == pytest.approx(float(want[1]), rel=1e-6)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-6)

    app = flower.export(
        module, tmp_path / "app", inputs=[np.asarray(w), np.asarray(clip), np.asarray(r0), KEY]
    )
    privacy = rounds.plan_of(app)["privacy"]
    assert [(r["op"], r["clip_norm"]) for r in privacy["releases"]] == [
        ("fed.dp_mean", 1.0),
        ("fed.dp_sum", 0.5),
    ]
    assert privacy["epsilon_per_round"] == fcir.privacy.epsilon(module, 1, 1e-5)
    nodes = files.write_nodes(tmp_path, [[x[i]] for i in range(N)], 10)
    inprocess.run(app, nodes, {"output": str(tmp_path / "o.npz"), "num-server-rounds": 3})
    out = files.read_outputs(tmp_path / "o.npz")
    state = (w, clip, r0)
    clips = []
    for _ in range(3):
        state = reference.run(module, *state, KEY, x)
        clips.append(float(state[1]))
    assert len(set(clips)) == 3  # the clip moved each round
    assert int(out[2]) == 3
    assert float(out[1]) == pytest.approx(clips[-1], rel=1e-6)
    np.testing.assert_allclose(out[0], state[0], rtol=1e-5, atol=1e-6)
