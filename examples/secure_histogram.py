"""Federated analytics: a histogram over clients' private values, by secure summation.

Each client turns its values (say, app ratings 0-9) into a histogram; the server only
ever sees the sum over clients, computed by ``fcir.secure_sum`` -- secure aggregation
in production, where the sum is modulo ``2**bitwidth``. The bitwidth is chosen so the
true sum cannot wrap: with ``clients * items < 2**bitwidth`` the modular sum is the
sum. Each "round" is one day of data; the server adds up the days::

    python examples/secure_histogram.py --rounds 7 --clients 100 --items 20
    fcir export --target production examples/secure_histogram.py:secure_histogram_round -o bundle/
"""

from __future__ import annotations

import argparse

import jax.numpy as jnp
import numpy as np
from fcir.interpreters import xla

import fcir
from fcir.report.progress import RoundProgress

CLIENTS, ITEMS, BINS = 100, 20, 10


def client_histogram(values):
    """int32[items] in [0, BINS) -> int32[BINS]"""
    return jnp.sum(values[:, None] == jnp.arange(BINS), axis=0, dtype=jnp.int32)


def make_round(clients: int, items: int):
    bitwidth = (clients * items).bit_length()  # clients * items < 2**bitwidth: no wrap

    @fcir.program(placements={"clients": clients})
    def secure_histogram_round(values):
        return fcir.secure_sum(fcir.map_fn(client_histogram, values), bitwidth=bitwidth)

    return secure_histogram_round


secure_histogram_round = make_round(CLIENTS, ITEMS)


def client_values(rng: np.random.Generator, clients: int, items: int) -> np.ndarray:
    """int32[clients, items]: each client rates around its own taste."""
    taste = rng.integers(2, BINS, (clients, 1))
    return np.clip(taste + rng.integers(-2, 2, (clients, items)), 0, BINS - 1).astype(np.int32)


EXAMPLE_ARGS = {
    "secure_histogram_round": lambda: (client_values(np.random.default_rng(0), CLIENTS, ITEMS),)
}


def main(argv: list[str] | None = None) -> np.ndarray:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7, help="days of data")
    parser.add_argument("--clients", type=int, default=CLIENTS)
    parser.add_argument("--items", type=int, default=ITEMS, help="values per client per day")
    args = parser.parse_args(argv)

    rng = np.random.default_rng(0)
    module = fcir.capture(make_round(args.clients, args.items),
                          client_values(rng, args.clients, args.items))  # fmt: skip
    step = xla.compile(module)
    total, plain = np.zeros(BINS, np.int64), np.zeros(BINS, np.int64)
    progress = RoundProgress(args.rounds, module=module, name="day")
    for _ in progress:
        values = client_values(rng, args.clients, args.items)
        total += np.asarray(step(values))
        plain += np.bincount(values.reshape(-1), minlength=BINS)  # what no server may see
        progress.log(values=total.sum())
    assert (total == plain).all(), "secure sum wrapped: raise the bitwidth"
    for b, count in enumerate(total):
        print(f"{b:>2} {'#' * round(60 * count / total.max()):<60} {count}")
    return total


if __name__ == "__main__":
    main()
