"""One checkpoint resumes a whole training run exactly: server state,
optax state, typed PRNG keys, the round, the sampler and the privacy budget."""

from __future__ import annotations

import signal
import subprocess
import sys

import jax
import numpy as np
import optax
import pytest
from ckpt_testing import REPO, child_env, same_bits

from fcir import checkpoint
from fcir.errors import CheckpointError

EXAMPLE = REPO / "examples" / "resume_training.py"


def _run(*args, expect=0):
    result = subprocess.run(
        [sys.executable, str(EXAMPLE), "--rounds", "6", *args],
        capture_output=True,
        text=True,
        env=child_env(1),
        cwd=REPO,
        timeout=600,
    )
    assert result.returncode == expect, result.stdout[-2000:] + result.stderr[-3000:]
    return [line for line in result.stdout.splitlines() if line.startswith("round ")]


@pytest.mark.slow  # kills and resumes a training run: left out of the fast tier
def test_a_killed_run_resumed_from_its_checkpoint_ends_bit_for_bit_like_an_unbroken_one(tmp_path):
    ckpt = str(tmp_path / "run")
    killed = _run("--checkpoints", ckpt, "--kill-after", "3", expect=-signal.SIGKILL)
    assert killed[-1].startswith("round 3/6")
    resumed = _run("--checkpoints", ckpt, "--output", str(tmp_path / "resumed.npz"))
    assert [line.split(" |")[0] for line in resumed] == ["round 4/6", "round 5/6", "round 6/6"]
    unbroken = _run("--output", str(tmp_path / "unbroken.npz"))
    assert resumed[-1] == unbroken[-1]  # the same epsilon
    a, b = np.load(tmp_path / "resumed.npz"), np.load(tmp_path / "unbroken.npz")
    assert sorted(a.files) == sorted(b.files) and len(b.files) > 10
    for k in b.files:
        assert same_bits(a[k], b[k]), k
    assert int(a["round"]) == 6


def test_a_run_state_round_trips_optax_state_typed_keys_and_json_entries(tmp_path):
    params = {"w": jax.numpy.arange(6.0).reshape(2, 3)}
    opt = optax.adam(0.1)
    opt_state = opt.init(params)
    _, opt_state = opt.update(params, opt_state, params)
    key = jax.random.split(jax.random.key(42), 3)
    rng = np.random.default_rng(5)
    rng.random(7)
    run = {"round": 9, "sampler": rng.bit_generator.state, "privacy": {"rounds": 9, "eps": 1.5}}
    checkpoint.save(
        tmp_path / "c", {"server": params, "opt_state": opt_state, "keys": {"k": key}, "run": run}
    )
    fresh = opt.init(params)
    target = {
        "server": params,
        "opt_state": fresh,
        "keys": {"k": jax.random.split(jax.random.key(0), 3)},
    }
    out = checkpoint.restore(tmp_path / "c", {**target, "run": None})
    assert type(out["opt_state"][0]) is type(opt_state[0])
    for got, want in zip(jax.tree.leaves(out["opt_state"]), jax.tree.leaves(opt_state)):
        assert same_bits(got, want)
    assert out["keys"]["k"].dtype == key.dtype
    assert same_bits(jax.random.key_data(out["keys"]["k"]), jax.random.key_data(key))
    assert same_bits(jax.random.normal(out["keys"]["k"][1], (4,)), jax.random.normal(key[1], (4,)))
    assert out["run"] == run
    again = np.random.default_rng()
    again.bit_generator.state = out["run"]["sampler"]
    assert same_bits(again.random(5), rng.random(5))
    host = checkpoint.restore(tmp_path / "c", items=["keys"])["keys"]["k"]
    assert host.dtype == key.dtype  # keys come back as keys even without a target
    with pytest.raises(CheckpointError, match=r"'keys/k' holds PRNG keys \(threefry2x32\)"):
        checkpoint.restore(tmp_path / "c", {"keys": {"k": np.zeros((3, 2), np.uint32)}})


def test_sharded_typed_keys_restore_onto_another_sharding(tmp_path, devices):
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((8,), ("x",), devices=devices)
    keys = jax.device_put(
        jax.random.split(jax.random.key(1, impl="rbg"), 16), NamedSharding(mesh, P("x"))
    )
    checkpoint.save(tmp_path / "c", {"keys": keys})
    lay = checkpoint.read_layout(tmp_path / "c")
    assert lay.items[0].arrays.arrays[0].prng_key_impl == "rbg"
    rev = jax.sharding.Mesh(np.array(devices[::-1]), ("x",))
    target = jax.ShapeDtypeStruct(keys.shape, keys.dtype, sharding=NamedSharding(rev, P("x")))
    out = checkpoint.restore(tmp_path / "c", {"keys": target})["keys"]
    assert out.sharding == target.sharding
    assert same_bits(jax.random.key_data(out), jax.random.key_data(keys))
