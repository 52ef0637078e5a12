"""DP-FedAvg on Flower's Simulation Engine with a privacy budget, resumed from a checkpoint.

The private FedAvg round of ``examples/dp_fedavg_digits.py`` (softmax regression on
scikit-learn's digits, split non-IID over ``--nodes`` clients) is exported to a Flower
app and trained on virtual SuperNodes (``fcir flower simulate``'s Python API) with run
config ``max-epsilon``: the ServerApp spends a ``fcir.privacy.Budget`` of the round,
prints the cumulative ε after each round, and stops before the round that would take
it past ``--max-epsilon``.

The training runs twice, as an interrupted job would: first ``--first-rounds`` rounds
with ``checkpoint-dir`` (each round's checkpoint keeps the budget spent), then the
same run again with ``num-server-rounds=--rounds``. The second run resumes after the first's last
round *and* its ε: it runs only the rounds the budget has left, not a fresh budget's.

The round releases the clients' mean update through ``fcir.dp_mean`` (central DP: the
server adds the noise; its key is a server input) or, with ``--ddp-bits B``,
``fcir.ddp_mean`` (distributed DP: each node noises its own update with a key from its
own secret seed and the public round number, and the sum goes through SecAgg+). The
round number is state (output ``r + 1`` feeds input ``r``), so every round draws fresh
noise::

    pip install -e ".[flower,examples]"
    python examples/dp_flower_training.py --nodes 30 --rounds 20 --max-epsilon 6

(the defaults: 6 of the 20 rounds fit in ε = 6 at δ = 1e-5, and the model reaches
about 0.8 held-out accuracy). Its time is the two Simulation Engine runs': Ray, the
SuperLink and the actors each import Flower and jax, about 110 CPU seconds in all
(measured on a busy 2-core machine, load average 15, where it took nearly 5 minutes;
the rounds themselves take a fraction of a second each), so at least a minute on 2
CPU cores. One Ray actor serves
all the nodes by default: a second one (``--actors 2``) imports jax and compiles the
client work again, about 20 CPU seconds more, for rounds that take milliseconds.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from dp_fedavg_digits import SERVER_LR, accuracy, init_model, load_clients, local_update

import fcir


def make_round(nodes: int, clip_norm: float, noise_multiplier: float, ddp_bits: int | None):
    """The private round ``(model, r, key or seeds, client_data) -> (model, r + 1)``."""
    if ddp_bits is None:

        @fcir.program(placements={"clients": nodes}, private=True)
        def dp_round(model, r, key, client_data):
            """Central DP: ``key`` (raw bits, a server input) noised at round ``r``."""
            updates, _ = fcir.map_fn(local_update, (fcir.broadcast(model), *client_data))
            noise_key = jax.random.fold_in(key, r)
            mean = fcir.dp_mean(updates, clip_norm, noise_multiplier, noise_key)
            return jax.tree.map(lambda p, u: p + SERVER_LR * u, model, mean), r + 1

        return dp_round

    @fcir.program(placements={"clients": nodes}, private=True)
    def ddp_round(model, r, seeds, client_data):
        """Distributed DP: each node's secret seed and the public round make its key."""
        keys = fcir.map_fn(jax.random.fold_in, (seeds, fcir.broadcast(r)))
        updates, _ = fcir.map_fn(local_update, (fcir.broadcast(model), *client_data))
        mean = fcir.ddp_mean(updates, clip_norm, noise_multiplier, keys, bits=ddp_bits)
        return jax.tree.map(lambda p, u: p + SERVER_LR * u, model, mean), r + 1

    return ddp_round


def round_args(nodes: int, seed: int, ddp_bits: int | None, alpha: float = 0.5):
    """(the round's arguments, the held-out test set). Keys are raw bits (uint32[2]):
    the Flower wire types have no key dtype."""
    clients, test = load_clients(nodes, alpha, seed)
    key = jax.random.key(seed)
    if ddp_bits is None:
        secret = jax.random.key_data(key)
    else:
        secret = jax.random.key_data(jax.random.split(key, nodes))
    return (init_model(), jnp.int32(1), secret, clients), test


def planned_rounds(module, delta: float, max_epsilon: float, rounds: int) -> int:
    """How many of ``rounds`` a ``fcir.privacy.Budget`` of ``module`` lets run."""
    budget = fcir.privacy.Budget(module, delta, max_epsilon)
    while budget.rounds < rounds and budget.can_spend():
        budget.spend()
    return budget.rounds


def _outputs(path) -> list[np.ndarray]:
    with np.load(path) as f:
        return [f[f"arr_{i}"] for i in range(len(f.files))]


def main(argv: list[str] | None = None) -> dict:
    """Exports, trains twice on the Simulation Engine (the second run resuming the
    first's checkpoint and budget); returns what ran."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=20, help="rounds asked for")
    parser.add_argument(
        "--first-rounds", type=int, default=2, help="rounds of the first run, before the resume"
    )
    parser.add_argument("--max-epsilon", type=float, default=6.0)
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--clip-norm", type=float, default=0.5)
    parser.add_argument("--noise-multiplier", type=float, default=2.0)
    parser.add_argument(
        "--ddp-bits",
        type=int,
        default=None,
        help="distributed DP (fcir.ddp_mean) with this secure-sum width",
    )
    parser.add_argument("--actors", type=int, default=1, help="Ray actors, each a CPU (default: 1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dir", default=None, help="work folder (default: a new temporary one)")
    args = parser.parse_args(argv)

    from fcir.interpreters import flower
    from fcir.interpreters.flower import data
    from fcir.interpreters.flower.simulation import simulate

    start = time.perf_counter()
    work = pathlib.Path(args.dir or tempfile.mkdtemp(prefix="dp-flower-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    rnd = make_round(args.nodes, args.clip_norm, args.noise_multiplier, args.ddp_bits)
    round_in, (x_test, y_test) = round_args(args.nodes, args.seed, args.ddp_bits)
    # Capturing the private round runs the leak check; the budget reads its DP op.
    module = fcir.capture(rnd, *round_in)
    server, _ = data.split_arguments(module, round_in, work / "data")
    app = flower.export(module, work / "app", inputs=_outputs(server))
    planned = planned_rounds(module, args.delta, args.max_epsilon, args.rounds)
    print(
        f"ε per round {fcir.privacy.epsilon(module, 1, args.delta):.4g} at δ={args.delta:g}: "
        f"a budget of max-epsilon={args.max_epsilon:g} allows {planned} of "
        f"{args.rounds} rounds",
        flush=True,
    )

    ckpt, out = work / "checkpoint", work / "model.npz"
    common = f'max-epsilon={args.max_epsilon!r} checkpoint-dir="{ckpt}" output="{out}"'
    # simulate() starts flwr in a subprocess (fork + exec): jax's warning about fork()
    # in a multithreaded process does not apply.
    warnings.filterwarnings("ignore", message=r"os\.fork\(\) was called")
    logs = []
    for label, rounds in (("first run", args.first_rounds), ("resumed run", args.rounds)):
        print(f"--- {label}: num-server-rounds={rounds} ---", flush=True)
        result = simulate(
            app,
            args.nodes,
            work / "data",
            f"num-server-rounds={rounds} {common}",
            actors=args.actors,
            root=work / f"sim{len(logs)}",
            echo=sys.stdout,
        )
        if not result.ok:
            raise SystemExit(f"{label} failed: {result.failure()}")
        logs.append(result.log)

    from fcir.checkpoint import CheckpointManager

    manager = CheckpointManager(ckpt)
    saved = manager.restore(manager.latest_step())["meta"]["budget"]
    ran = json.loads(str(saved))["rounds"]  # the budget the checkpoint keeps
    outs = _outputs(out)
    model = jax.tree.unflatten(jax.tree.structure(init_model()), outs[:-1])
    spent = fcir.privacy.epsilon(module, ran, args.delta)
    print(
        f"{ran} rounds ran in all (the budget planned {planned}), ε {spent:.4g} spent of "
        f"{args.max_epsilon:g}; test accuracy {accuracy(model, x_test, y_test):.3f} "
        f"({time.perf_counter() - start:.0f} s); the model: {out}",
        flush=True,
    )
    return {
        "module": module,
        "planned": planned,
        "rounds": ran,
        "epsilon": spent,
        "outputs": outs,
        "logs": logs,
        "work": work,
    }


if __name__ == "__main__":
    main()
