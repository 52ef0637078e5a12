"""A training run that survives being killed: everything it needs is in one checkpoint.

DP-FedAdam over a population of clients: each round a sampler (a numpy Generator)
picks a cohort, every cohort member runs local SGD, the server takes the DP mean of
their updates (``fcir.dp_mean``, keyed by a typed ``jax.random.key`` split each round)
and applies Adam (optax) to it. After every ``--save-every`` rounds the whole run goes
into one checkpoint of a ``CheckpointManager``, saved asynchronously:

- ``server``: the model; ``opt_state``: optax's Adam state;
- ``keys``: the typed PRNG key the next round splits;
- ``run`` (plain JSON): the round, the sampler's bit-generator state, and the privacy
  budget spent so far (rounds, δ, sampling rate, ε).

Started again with the same ``--checkpoints`` directory, the run resumes from the
newest committed step and ends bit for bit where an unbroken run ends::

    python examples/resume_training.py --rounds 8 --checkpoints /tmp/run --kill-after 5
    python examples/resume_training.py --rounds 8 --checkpoints /tmp/run --output a.npz
    python examples/resume_training.py --rounds 8 --output b.npz   # the same bits

``--kill-after R`` SIGKILLs the process right after round R is committed (a crash).
"""

from __future__ import annotations

import argparse
import os
import signal

import _mlp as mlp
import jax
import jax.numpy as jnp
import numpy as np
import optax
from fcir.interpreters import xla

import fcir
from fcir import checkpoint

POPULATION, COHORT, LOCAL_STEPS, BATCH, CLIENT_LR = 32, 4, 3, 8, 0.1
CLIP_NORM, NOISE_MULTIPLIER, DELTA = 1.0, 1.1, 1e-5
SERVER_OPT = optax.adam(learning_rate=0.05)


def client_update(params, x, y):
    trained, _ = mlp.sgd(params, x, y, CLIENT_LR)
    return jax.tree.map(jnp.subtract, trained, params)


@fcir.program(placements={"clients": COHORT}, private=True)
def dp_fedadam_round(params, opt_state, key, x, y):
    deltas = fcir.map_fn(client_update, (fcir.broadcast(params), x, y))
    mean = fcir.dp_mean(deltas, CLIP_NORM, NOISE_MULTIPLIER, key)
    updates, opt_state = SERVER_OPT.update(jax.tree.map(jnp.negative, mean), opt_state, params)
    return optax.apply_updates(params, updates), opt_state


def population_data():
    """Every client's data, fixed for the run (a real run reads it from the clients)."""
    return mlp.client_data(np.random.default_rng(7), (POPULATION,), LOCAL_STEPS, BATCH)


def fresh_state(seed: int) -> dict:
    params = mlp.init_params(seed)
    return {
        "server": params,
        "opt_state": SERVER_OPT.init(params),
        "keys": {"key": jax.random.key(seed)},
        "run": {
            "round": 0,
            "sampler": np.random.default_rng(seed).bit_generator.state,
            "privacy": {"rounds": 0, "delta": DELTA, "sampling_rate": COHORT / POPULATION,
                        "epsilon": 0.0},
        },
    }  # fmt: skip


def resume(manager: checkpoint.CheckpointManager, seed: int) -> dict:
    """The newest committed state, restored onto the fresh state's shardings and dtypes."""
    state = fresh_state(seed)
    if manager.latest_step() is None:
        return state
    target = {k: state[k] for k in ("server", "opt_state", "keys")}
    target["run"] = None  # JSON: comes back as it was saved
    return manager.restore(manager.latest_step(), target)


def train(rounds: int, seed: int = 0, directory: str | None = None, save_every: int = 1,
          kill_after: int | None = None) -> dict:  # fmt: skip
    x_all, y_all = population_data()
    init = fresh_state(seed)
    module = fcir.capture(
        dp_fedadam_round, init["server"], init["opt_state"], init["keys"]["key"],
        x_all[:COHORT], y_all[:COHORT],
    )  # fmt: skip
    step = xla.compile(module)
    manager = None
    if directory is not None:
        manager = checkpoint.CheckpointManager(directory, max_to_keep=2)
        state = resume(manager, seed)
    else:
        state = init
    params, opt_state, key = state["server"], state["opt_state"], state["keys"]["key"]
    run = state["run"]
    sampler = np.random.default_rng()
    sampler.bit_generator.state = run["sampler"]
    for r in range(run["round"] + 1, rounds + 1):
        cohort = sampler.choice(POPULATION, COHORT, replace=False)
        key, round_key = jax.random.split(key)
        params, opt_state = step(params, opt_state, round_key, x_all[cohort], y_all[cohort])
        privacy = dict(run["privacy"], rounds=r)
        privacy["epsilon"] = fcir.privacy.epsilon(module, r, DELTA, privacy["sampling_rate"])
        run = {"round": r, "sampler": sampler.bit_generator.state, "privacy": privacy}
        print(f"round {r}/{rounds} | epsilon {privacy['epsilon']:.3f}", flush=True)
        if manager is not None and (r % save_every == 0 or r == rounds):
            state = {"server": params, "opt_state": opt_state, "keys": {"key": key}, "run": run}
            manager.save(r, state, force=True)  # asynchronous: training goes on
            if kill_after is not None and r >= kill_after:
                manager.wait_until_finished()
                os.kill(os.getpid(), signal.SIGKILL)  # a crash, right after the commit
    if manager is not None:
        manager.wait_until_finished()
    return {"server": params, "opt_state": opt_state, "key": key, "run": run}


def final_arrays(out: dict) -> dict[str, np.ndarray]:
    """Every number the run ends with, flat, for a bit-for-bit comparison."""
    leaves = jax.tree.leaves({"server": out["server"], "opt_state": out["opt_state"]})
    arrays = {f"leaf{i}": np.asarray(a) for i, a in enumerate(leaves)}
    arrays["key"] = np.asarray(jax.random.key_data(out["key"]))
    arrays["round"] = np.asarray(out["run"]["round"])
    arrays["epsilon"] = np.asarray(out["run"]["privacy"]["epsilon"])
    return arrays


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoints", help="CheckpointManager directory or URL (resumes)")
    parser.add_argument("--save-every", type=int, default=1)
    parser.add_argument("--kill-after", type=int, help="SIGKILL after this round's commit")
    parser.add_argument("--output", help="write the final state's arrays to this .npz")
    args = parser.parse_args(argv)
    out = train(args.rounds, args.seed, args.checkpoints, args.save_every, args.kill_after)
    if args.output:
        np.savez(args.output, **final_arrays(out))
    return out


if __name__ == "__main__":
    main()
