"""FedAvg and DP-FedAvg on real data: scikit-learn's handwritten digits.

The digits data set (1797 8x8 images, 10 classes) ships with scikit-learn, so nothing
is downloaded. A fifth is held out for testing; the rest is split over 50 clients
non-IID: for each class, its images are divided among the clients in proportions drawn
from a Dirichlet distribution (``--alpha``; small alpha, few classes per client).

Both runs train the same small classifier (softmax regression on the 64 pixels) with
the same rounds: the server broadcasts the model, every client takes a few full-batch
gradient steps on its own images, and the server moves the model by the clients' mean
update. FedAvg averages with ``fcir.reduce_mean``. DP-FedAvg averages with
``fcir.dp_mean``: each client's update is clipped to L2 norm ``--clip-norm``, and the
server adds Gaussian noise of std ``--noise-multiplier * --clip-norm`` to the sum. Its
round is an ``@fcir.program(..., private=True)``, so ``fcir.capture`` *checks* that no
client data reaches the server any other way (returning the mean client loss too, as
the FedAvg round does, would be rejected), and ``fcir.privacy.epsilon`` reads the noise
from the captured round to give ε after each round (client-level DP, δ = ``--delta``).

Distributed DP (``--ddp-bits 16 20``, the default) trains the same round with
``fcir.ddp_mean`` instead: each client clips, quantizes and noises its own update into
integers modulo ``2**bits`` and the server only decodes their secure sum, so it never
sees an un-noised value. Its noise multiplier is calibrated
(``fcir.mechanisms.ddgauss.noise_multiplier_for``) so that ``fcir.privacy.epsilon`` gives the same ε
as the central run's after every round: the curves compare accuracy at equal privacy.

``--mode`` chooses how the central run's ``fcir.dp_mean`` releases (``MODES``):
``float`` (the default) adds float Gaussian noise, whose ε is about real numbers, not
the floats released; ``exact`` (``exact=True``, ``fcir.mechanisms.lattice``) rounds the
clipped updates to a power-of-two grid, adds integer discrete Gaussian noise and
releases lattice points, so ε holds for the released bits; its noise multiplier is
raised by the rounding's share of the sensitivity
(``fcir.mechanisms.lattice.noise_multiplier_for``), so ε is the float run's.

``--mode adaptive`` trains the central run with adaptive clipping instead
(``fcir.dp_mean_adaptive``, Andrew et al. 2021): ``--clip-norm`` is only the first
round's clip; each client also reports the noised bit "my update's norm is at most the
clip", and the server moves the clip toward the ``--target-quantile`` of the update
norms. The round's noise multiplier stays ``--noise-multiplier`` in total (the update
gets a larger one, the count the rest), so ε per round is the float mode's.

With ``--max-epsilon E`` a ``fcir.privacy.Budget`` of the private round is spent
each round, and training stops before the round that would pass ε = E.

With ``--cohort K`` the clients are a population (``fcir.Population``) from which each
round samples a cohort, every client independently at rate q = K / ``--clients``
(Poisson sampling, padded to a fixed number of members with zero data that train to a
zero update); the accountant amplifies ε by that sampling (``cohorts.epsilon``), and
the server divides the cohort's sum by K, the expected cohort (distributed DP, whose
noise is shared among the members, is not run then). A population ten times the
cohort::

    python examples/dp_fedavg_digits.py --clients 500 --cohort 50 --rounds 40

Each round prints test accuracy and ε; at the end one PNG shows both::

    pip install -e ".[examples]"
    python examples/dp_fedavg_digits.py --rounds 40 --output dp_fedavg_digits.png
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

import fcir

NUM_CLIENTS = 50
CLASSES = 10
PIXELS = 64
LOCAL_STEPS = 5
LOCAL_LR = 0.5
SERVER_LR = 1.0


def load_clients(num_clients: int, alpha: float, seed: int):
    """(client data, held-out test set). Client data are padded to one size with a mask:
    ``x`` f32[n, m, 64], ``y`` i32[n, m], ``mask`` f32[n, m] (1 for a real image)."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int32)
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(y))
    test, train = order[: len(y) // 5], order[len(y) // 5 :]
    shares: list[list[int]] = [[] for _ in range(num_clients)]
    for c in range(CLASSES):
        idx = train[y[train] == c]
        rng.shuffle(idx)
        cuts = (np.cumsum(rng.dirichlet([alpha] * num_clients))[:-1] * len(idx)).astype(int)
        for k, part in enumerate(np.split(idx, cuts)):
            shares[k].extend(part.tolist())
    m = max(1, max(len(s) for s in shares))
    cx = np.zeros((num_clients, m, PIXELS), np.float32)
    cy = np.zeros((num_clients, m), np.int32)
    mask = np.zeros((num_clients, m), np.float32)
    for k, s in enumerate(shares):
        cx[k, : len(s)], cy[k, : len(s)], mask[k, : len(s)] = x[s], y[s], 1.0
    return (jnp.asarray(cx), jnp.asarray(cy), jnp.asarray(mask)), (x[test], y[test])


def init_model():
    return {"w": jnp.zeros((PIXELS, CLASSES), jnp.float32), "b": jnp.zeros((CLASSES,))}


def logits(model, x):
    return x @ model["w"] + model["b"]


def loss_fn(model, x, y, mask):
    """Mean cross-entropy over a client's real images (padding masked out)."""
    logp = jax.nn.log_softmax(logits(model, x))
    nll = -jnp.take_along_axis(logp, y[:, None], axis=1)[:, 0]
    return jnp.sum(nll * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def local_update(model, x, y, mask):
    """One client's work: LOCAL_STEPS gradient steps; returns (update, final loss)."""

    def step(m, _):
        loss, g = jax.value_and_grad(loss_fn)(m, x, y, mask)
        return jax.tree.map(lambda p, d: p - LOCAL_LR * d, m, g), loss

    new, losses = jax.lax.scan(step, model, None, length=LOCAL_STEPS)
    return jax.tree.map(lambda a, b: a - b, new, model), losses[-1]


def float_mean(updates, clip_norm: float, noise_multiplier: float, key):
    """Central DP with float Gaussian noise (``fcir.dp_mean``'s default)."""
    return fcir.dp_mean(updates, clip_norm, noise_multiplier, key)


def exact_mean(updates, clip_norm: float, noise_multiplier: float, key):
    """Central DP on a lattice, at the ε of ``noise_multiplier`` in float mode: the
    noise is raised by the grid's share of the sensitivity."""
    from fcir.mechanisms import lattice

    dim = sum(int(np.prod(u.shape[1:])) for u in jax.tree.leaves(updates))
    gamma = lattice.default_gamma(clip_norm, dim)
    z = lattice.noise_multiplier_for(noise_multiplier, clip_norm, dim, gamma)
    return fcir.dp_mean(updates, clip_norm, z, key, exact=True, gamma=gamma)


# --mode: how the central DP round releases its mean, all at the same ε.
MODES = {"float": float_mean, "exact": exact_mean}


def make_rounds(num_clients: int, clip_norm: float, noise_multiplier: float,
                mode: str = "float", server_lr: float = SERVER_LR):
    @fcir.program(placements={"clients": num_clients})
    def fedavg_round(model, client_data):
        """FedAvg: the new model and the mean client loss."""
        updates, losses = fcir.map_fn(local_update, (fcir.broadcast(model), *client_data))
        mean = fcir.reduce_mean(updates)
        new = jax.tree.map(lambda p, u: p + server_lr * u, model, mean)
        return new, fcir.reduce_mean(losses)

    @fcir.program(placements={"clients": num_clients}, private=True)
    def dp_fedavg_round(model, key, client_data):
        """DP-FedAvg: the new model only (a plain mean of the losses would leak)."""
        updates, _ = fcir.map_fn(local_update, (fcir.broadcast(model), *client_data))
        mean = MODES[mode](updates, clip_norm, noise_multiplier, key)
        return jax.tree.map(lambda p, u: p + server_lr * u, model, mean)

    return fedavg_round, dp_fedavg_round


def make_adaptive_round(num_clients: int, noise_multiplier: float, target_quantile: float,
                        clip_learning_rate: float, count_stddev: float | None,
                        server_lr: float = SERVER_LR):
    @fcir.program(placements={"clients": num_clients}, private=True)
    def adaptive_fedavg_round(model, clip, key, client_data):
        """DP-FedAvg with adaptive clipping: the clip is state, ``(model, clip)`` in and out."""
        updates, _ = fcir.map_fn(local_update, (fcir.broadcast(model), *client_data))
        mean, clip = fcir.dp_mean_adaptive(
            updates, clip, noise_multiplier, key, target_quantile=target_quantile,
            learning_rate=clip_learning_rate, count_stddev=count_stddev,
        )
        return jax.tree.map(lambda p, u: p + server_lr * u, model, mean), clip

    return adaptive_fedavg_round


def make_ddp_round(num_clients: int, clip_norm: float, noise_multiplier: float, bits: int):
    @fcir.program(placements={"clients": num_clients}, private=True)
    def ddp_fedavg_round(model, keys, client_data):
        """Distributed DP-FedAvg: ``keys`` holds one PRNG key per client (client data)."""
        updates, _ = fcir.map_fn(local_update, (fcir.broadcast(model), *client_data))
        mean = fcir.ddp_mean(updates, clip_norm, noise_multiplier, keys, bits=bits)
        return jax.tree.map(lambda p, u: p + SERVER_LR * u, model, mean)

    return ddp_fedavg_round


def ddp_noise_multiplier(num_clients: int, clip_norm: float, central: float, bits: int):
    """The ddp noise multiplier accounted like central DP's ``central`` (same ε)."""
    from fcir.mechanisms import ddgauss as ddp

    dim = PIXELS * CLASSES + CLASSES
    return ddp.noise_multiplier_for(central, dim, num_clients, clip_norm, bits)


def round_keys(key, r: int, num_clients: int):
    """Round ``r``'s client keys: distinct per client and per round."""
    return jax.random.split(jax.random.fold_in(key, r), num_clients)


def accuracy(model, x, y) -> float:
    return float(np.mean(np.argmax(np.asarray(logits(model, x)), axis=1) == y))


def make_example_args(num_clients: int = NUM_CLIENTS, seed: int = 0):
    clients, _ = load_clients(num_clients, 0.5, seed)
    return init_model(), jax.random.key(seed), clients


def make_fedavg_example_args(num_clients: int = NUM_CLIENTS, seed: int = 0):
    model, _, clients = make_example_args(num_clients, seed)
    return model, clients


def make_ddp_example_args(num_clients: int = NUM_CLIENTS, seed: int = 0):
    clients, _ = load_clients(num_clients, 0.5, seed)
    return init_model(), round_keys(jax.random.key(seed), 1, num_clients), clients


EXAMPLE_ARGS = {
    "dp_fedavg_round": make_example_args,
    "fedavg_round": make_fedavg_example_args,
    "ddp_fedavg_round": make_ddp_example_args,
}
fedavg_round, dp_fedavg_round = make_rounds(NUM_CLIENTS, 0.5, 4.0)
ddp_fedavg_round = make_ddp_round(NUM_CLIENTS, 0.5, 4.0, 16)


def figure(fedavg_acc, dp_acc, eps, delta: float, noise_multiplier: float, num_clients: int,
           ddp: dict | None = None, mode: str = "float"):
    """The two panels (accuracy, ε) as a matplotlib Figure. ``ddp``: bits -> (accuracy
    per round, ε per round, noise multiplier)."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    rounds = np.arange(1, len(fedavg_acc) + 1)
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4), constrained_layout=True)
    a1.plot(rounds, fedavg_acc, "o-", ms=3, label="FedAvg")
    central = "central, adaptive clip" if mode == "adaptive" else "central"
    a1.plot(rounds, dp_acc, "s-", ms=3, label=f"DP-FedAvg, {central} (z={noise_multiplier:g})")
    for i, (bits, (acc, _, z)) in enumerate(sorted((ddp or {}).items())):
        a1.plot(rounds, acc, "^v"[i % 2] + "-", ms=3,
                label=f"DP-FedAvg, distributed, {bits} bits (z={z:.3g})")
    a1.set_ylabel("held-out accuracy")
    a1.set_ylim(0, 1)
    a1.legend(loc="lower right")
    a1.set_title(f"digits, {num_clients} non-IID clients")
    a2.plot(rounds, eps, "s-", ms=4, color="C1", label="central")
    for i, (bits, (_, e, _)) in enumerate(sorted((ddp or {}).items())):
        a2.plot(rounds, e, ".:", ms=3, color=f"C{i + 2}", label=f"distributed, {bits} bits")
    if ddp:
        a2.legend(loc="lower right")
    a2.set_ylabel("ε")
    a2.set_title(f"DP-FedAvg privacy spent (δ={delta:g}, RDP)")
    for ax in (a1, a2):
        ax.set_xlabel("round")
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # whole rounds, also for 2 or 3
    return fig


def plot(path: str, fedavg_acc, dp_acc, eps, delta: float, noise_multiplier: float,
         num_clients: int, ddp: dict | None = None, mode: str = "float") -> None:
    import matplotlib.pyplot as plt

    fig = figure(fedavg_acc, dp_acc, eps, delta, noise_multiplier, num_clients, ddp, mode)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, its combinations checked."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--clients", type=int, default=NUM_CLIENTS)
    parser.add_argument("--alpha", type=float, default=0.5, help="Dirichlet concentration")
    parser.add_argument("--clip-norm", type=float, default=0.5)
    parser.add_argument("--noise-multiplier", type=float, default=4.0)
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-epsilon", type=float, default=None,
                        help="stop before the round whose ε would pass this")
    parser.add_argument("--ddp-bits", type=int, nargs="*", default=None,
                        help="secure-sum widths of the distributed DP runs (none: skip; "
                        "default 16 20, none with --cohort)")
    parser.add_argument("--cohort", type=int, default=None,
                        help="clients expected per round, Poisson-sampled from --clients "
                        "(default: every client every round)")
    parser.add_argument("--mode", choices=[*sorted(MODES), "adaptive"], default="float",
                        help="how the central DP mean releases, at the same ε in every mode: "
                        "fcir.dp_mean at --clip-norm with float noise (float) or on a lattice "
                        "(exact), or fcir.dp_mean_adaptive starting from --clip-norm (adaptive)")
    parser.add_argument("--target-quantile", type=float, default=0.5,
                        help="adaptive: the quantile of update norms the clip moves to")
    parser.add_argument("--clip-learning-rate", type=float, default=0.2,
                        help="adaptive: the clip's geometric step")
    parser.add_argument("--count-stddev", type=float, default=None,
                        help="adaptive: the noise std of the clients' count (default clients/20)")
    parser.add_argument("--output", default="dp_fedavg_digits.png", help="the PNG to write")
    args = parser.parse_args(argv)
    if args.cohort is not None and args.ddp_bits:
        parser.error("--ddp-bits with --cohort: a sampled round of fcir.ddp_mean sums only "
                     "the cohort's noise shares, which no ε bounds")
    if args.cohort is not None and args.mode == "adaptive":
        parser.error("--mode adaptive with --cohort: a cohort's padding members would "
                     "count as clients under the clip and bias its quantile")
    if args.cohort is not None and args.mode == "exact":
        parser.error("--mode exact with --cohort: an exact release is accounted without "
                     "amplification by sampling (fcir.privacy refuses it)")
    if args.cohort is not None and not 0 < args.cohort <= args.clients:
        parser.error(f"--cohort must be in [1, --clients={args.clients}]")
    if args.ddp_bits is None:
        args.ddp_bits = [16, 20] if args.cohort is None else []
    return args


def main(argv: list[str] | None = None) -> dict:
    """Runs both trainings, prints each round, writes the PNG; returns the curves."""
    args = parse_args(argv)

    start = time.perf_counter()
    clients, (x_test, y_test) = load_clients(args.clients, args.alpha, args.seed)
    cohorts, members, server_lr = None, args.clients, SERVER_LR
    if args.cohort is not None:
        # The clients' data stay on the host; each round takes a fixed-size cohort.
        counts = np.asarray(clients[2]).sum(1)
        population = fcir.Population(tuple(np.asarray(c) for c in clients), counts)
        cohorts = population.poisson(args.cohort / args.clients, seed=args.seed)
        # The means over cohorts.size members, padding's zero updates included, times
        # size / K: the cohort's sum over the expected cohort, as DP-FedAvg's estimator.
        members, server_lr = cohorts.size, SERVER_LR * cohorts.size / args.cohort
    plain, private = make_rounds(members, args.clip_norm, args.noise_multiplier,
                                 "float" if args.mode == "adaptive" else args.mode, server_lr)
    model, key = init_model(), jax.random.key(args.seed)
    adaptive = args.mode == "adaptive"
    clip = jnp.float32(args.clip_norm)  # adaptive: the clip is the round's state
    if adaptive:
        private = make_adaptive_round(members, args.noise_multiplier, args.target_quantile,
                                      args.clip_learning_rate, args.count_stddev, server_lr)
    # Capturing the private round runs the leak check; the accountant reads its DP ops.
    example = clients if cohorts is None else cohorts.specs()[0]
    state = (model, clip) if adaptive else (model,)
    module = fcir.capture(private, *state, key, example)
    run_plain, run_private = jax.jit(plain), jax.jit(private)

    ddp_runs = {}  # bits -> [jitted round, module, model, accuracies, epsilons, z]
    for bits in args.ddp_bits:
        z = ddp_noise_multiplier(args.clients, args.clip_norm, args.noise_multiplier, bits)
        rnd = make_ddp_round(args.clients, args.clip_norm, z, bits)
        ddp_module = fcir.capture(rnd, model, round_keys(key, 1, args.clients), clients)
        ddp_runs[bits] = [jax.jit(rnd), ddp_module, model, [], [], z]

    budget = None
    if args.max_epsilon is not None and cohorts is not None:
        budget = cohorts.budget(module, args.delta, args.max_epsilon)
    elif args.max_epsilon is not None:
        budget = fcir.privacy.Budget(module, args.delta, args.max_epsilon)

    fedavg_acc, dp_acc, eps, clips, dp_seconds = [], [], [], [], []
    m_plain = m_dp = model
    for r in range(1, args.rounds + 1):
        if budget is not None and not budget.can_spend():
            print(f"stopping before round {r}: ε would pass --max-epsilon "
                  f"{args.max_epsilon:g} (spent ε {budget.epsilon:.2f} in {budget.rounds} rounds)")
            break
        if budget is not None:
            budget.spend()
        data = clients
        if cohorts is not None:  # round r's cohort: gathered on the host, put on the device
            idx, sampled = cohorts.indices(r)
            data = jax.device_put(cohorts.take(idx, sampled)[0])
        m_plain, loss = run_plain(m_plain, data)
        tick = time.perf_counter()
        if adaptive:
            m_dp, clip = jax.block_until_ready(run_private(m_dp, clip, jax.random.fold_in(key, r), data))
            clips.append(float(clip))
        else:
            m_dp = jax.block_until_ready(run_private(m_dp, jax.random.fold_in(key, r), data))
        dp_seconds.append(time.perf_counter() - tick)
        if cohorts is not None:  # the mean loss of the sampled clients (padding's is 0)
            loss = loss * cohorts.size / max(int(sampled.sum()), 1)
        fedavg_acc.append(accuracy(m_plain, x_test, y_test))
        dp_acc.append(accuracy(m_dp, x_test, y_test))
        eps.append(fcir.privacy.epsilon(module, r, args.delta) if cohorts is None
                   else cohorts.epsilon(module, r, args.delta))
        line = (
            f"round {r}/{args.rounds} | FedAvg acc {fedavg_acc[-1]:.3f} "
            f"(loss {float(loss):.3f}) | DP-FedAvg acc {dp_acc[-1]:.3f} | "
            f"ε {eps[-1]:.2f} at δ={args.delta:g}"
        )
        if adaptive:
            line += f" | next clip {clips[-1]:.3f}"
        for bits, run in ddp_runs.items():
            run[2] = run[0](run[2], round_keys(key, r, args.clients), clients)
            run[3].append(accuracy(run[2], x_test, y_test))
            run[4].append(fcir.privacy.epsilon(run[1], r, args.delta))
            line += f" | DDP-{bits} acc {run[3][-1]:.3f} (ε {run[4][-1]:.2f})"
        print(line)
    ddp = {bits: (run[3], run[4], run[5]) for bits, run in ddp_runs.items()}
    plot(args.output, fedavg_acc, dp_acc, eps, args.delta, args.noise_multiplier, args.clients,
         ddp, args.mode)
    print(f"wrote {args.output} ({time.perf_counter() - start:.1f} s)")
    # the first round compiles: the time per round is the median of the others
    per_round = float(np.median(dp_seconds[1:])) if len(dp_seconds) > 1 else None
    if per_round is not None:
        print(f"DP-FedAvg ({args.mode}) round: {1e3 * per_round:.2f} ms (median, after the first)")
    return {"fedavg": fedavg_acc, "dp_fedavg": dp_acc, "epsilon": eps, "mode": args.mode,
            "dp_round_seconds": per_round, **({"clip": clips} if adaptive else {}),
            **{f"ddp_{bits}": acc for bits, (acc, _, _) in ddp.items()},
            **{f"ddp_{bits}_epsilon": e for bits, (_, e, _) in ddp.items()}}


if __name__ == "__main__":
    main()
