"""The FedAvg experiment of bench/simulate.py, on CIFAR-10 shapes, as each JAX system
runs it: the synthetic population, the round written once for fcir and DrJAX, fcir's
population and compiled round for ``xla.simulate``, and DrJAX's hand-written sampling
loop around its compiled round.

The model is bench/flower_cifar/hand_cifar/cnn.py (pfl-research's CIFAR-10 CNN in JAX),
shared with the hand-written Flower app. The population is synthetic (no download):
standard-normal images (what pfl's benchmark feeds after per-channel normalization)
and uniform labels, drawn from ``seed`` so every system, in every process, gets the
same data. Importing this module imports neither JAX nor the model (pfl's worker, in a
virtualenv without JAX, takes its population from here)."""

from __future__ import annotations

import pathlib
import sys

import numpy as np

SHAPE = (32, 32, 3)
CLASSES = 10


def model():
    """bench/flower_cifar/hand_cifar/cnn.py, the JAX model (imports JAX)."""
    folder = str(pathlib.Path(__file__).resolve().parent / "flower_cifar")
    if folder not in sys.path:
        sys.path.insert(0, folder)
    from hand_cifar import cnn

    return cnn


def population(clients: int, examples: int, seed: int = 0, shape=SHAPE):
    """Every client's data on the host: images float32[clients, examples, *shape],
    labels int32[clients, examples]."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((clients, examples, *shape), dtype=np.float32)
    y = rng.integers(0, CLASSES, (clients, examples)).astype(np.int32)
    return x, y


def as_batches(x, y, batch: int):
    """A cohort's data as local steps: [k, n, ...] -> [k, n // batch, batch, ...]."""
    k, n = y.shape
    return x.reshape(k, n // batch, batch, *x.shape[2:]), y.reshape(k, n // batch, batch)


def fedavg(cohort: int, api):
    """The FedAvg round ``(params, x@clients, y@clients) -> (params, mean loss)`` on
    ``api`` (``fcir`` or ``drjax``): broadcast, local SGD, mean delta added at server
    learning rate 1 (pfl's benchmark: central SGD, learning rate 1.0), mean loss."""
    import jax

    cnn = model()

    def cifar_fedavg(params, x, y):
        deltas, losses = api.map_fn(cnn.client_update, (api.broadcast(params), x, y))
        mean_delta = api.reduce_mean(deltas)
        return jax.tree.map(lambda p, d: p + d, params, mean_delta), api.reduce_mean(losses)

    return api.program(placements={"clients": cohort})(cifar_fedavg)


def fedavg_population(cohort: int):
    """:func:`fedavg` on fcir as ``xla.simulate`` calls a round: ``(params, (x, y),
    counts) -> (params, mean loss)``. Every client holds the same number of examples,
    so nothing is masked and the counts go unused (the mean over clients, as above)."""
    import jax

    import fcir

    cnn = model()

    def cifar_round(params, data, counts):
        del counts
        x, y = data
        deltas, losses = fcir.map_fn(cnn.client_update, (fcir.broadcast(params), x, y))
        mean_delta = fcir.reduce_mean(deltas)
        return jax.tree.map(lambda p, d: p + d, params, mean_delta), fcir.reduce_mean(losses)

    return fcir.program(placements={"clients": cohort})(cifar_round)


def population_fcir(pop, batch: int, cohort: int, seed: int = 0):
    """The population as ``fcir.Population`` (each client's data as local steps) and its
    uniform cohorts: what ``xla.simulate`` samples from (the sample differs from
    :class:`HandLoop`'s, the same kind: ``cohort`` distinct clients a round)."""
    import fcir

    return fcir.Population(as_batches(*pop, batch)).uniform(cohort, seed=seed)


def compile_population(cohorts, members: str = "auto", clients_per_step=None, seed: int = 0):
    """fcir's round for ``xla.simulate``: captured on the cohorts' shapes and compiled
    with ``members`` and ``clients_per_step`` (``xla.compile``), once."""
    from fcir.interpreters import xla

    import fcir

    params = model().init_params(seed, cohorts.population.data[0].shape[3:])
    module = fcir.capture(fedavg_population(cohorts.size), params, *cohorts.specs())
    return xla.compile(module, clients_per_step=clients_per_step, members=members)


def specs(cohort: int, examples: int, batch: int, shape=SHAPE):
    """ShapeDtypeStructs of the round's arguments."""
    import jax

    params = model().init_params(0, shape)
    p = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params)
    steps = examples // batch
    x = jax.ShapeDtypeStruct((cohort, steps, batch, *shape), np.float32)
    y = jax.ShapeDtypeStruct((cohort, steps, batch), np.int32)
    return p, x, y


def compile_drjax(cohort: int, examples: int, batch: int, shape=SHAPE):
    """The same round on DrJAX 0.2.1, ``jax.jit`` ahead of time."""
    import drjax
    import jax

    args = specs(cohort, examples, batch, shape)
    return jax.jit(fedavg(cohort, drjax)).lower(*args).compile()


class HandLoop:
    """Rounds of a compiled ``round_fn(params, x, y)`` over a population on the host:
    each round samples ``cohort`` clients uniformly without replacement, gathers their
    data and puts it on the device; the next cohort is gathered and transferred while
    the current round runs (JAX dispatches asynchronously).

    DrJAX's side of bench/simulate.py (fcir's is the population API, ``xla.simulate``,
    which runs the same kind of loop)."""

    def __init__(self, round_fn, pop_x, pop_y, cohort: int, batch: int, seed: int = 0):
        self.round_fn, self.pop_x, self.pop_y = round_fn, pop_x, pop_y
        self.cohort, self.batch = cohort, batch
        self.rng = np.random.default_rng(seed)
        self.params = model().init_params(seed, pop_x.shape[2:])
        self.losses: list = []

    def _next_cohort(self):
        import jax

        idx = np.sort(self.rng.choice(len(self.pop_y), self.cohort, replace=False))
        return jax.device_put(as_batches(self.pop_x[idx], self.pop_y[idx], self.batch))

    def run(self, rounds: int) -> list:
        """Runs ``rounds`` rounds; returns their mean losses (awaited)."""
        import jax

        data = self._next_cohort()
        losses = []
        for r in range(rounds):
            self.params, loss = self.round_fn(self.params, *data)
            losses.append(loss)
            if r + 1 < rounds:
                data = self._next_cohort()
        jax.block_until_ready((self.params, losses))
        return [float(v) for v in losses]
