"""``fcir.Population``: many clients on the host, a cohort of them sampled each round.

```python
import numpy as np
import fcir

# 100 clients with 3 to 7 examples each: padded to 7, ``counts`` says how many are real.
rng = np.random.default_rng(0)
clients = [(rng.normal(size=(n, 2)).astype(np.float32),) for n in rng.integers(3, 8, 100)]
population = fcir.Population.from_clients(clients)
cohorts = population.uniform(10, seed=0)          # 10 clients a round, without replacement
# or population.poisson(0.1, seed=0): each client at rate 0.1, padded to a fixed size
data, counts = cohorts.gather(0)                  # round 0's cohort (numpy)
assert data[0].shape == (cohorts.size, 7, 2) and counts.shape == (cohorts.size,)
```

The population's data stay on the host as numpy arrays with the clients on the leading
axis (``N``) and each client's examples padded to one length; ``counts`` (``f32[N]``)
holds each client's number of real examples. A round's cohort always has the same
shape, ``cohorts.size`` members, so one compiled round serves every round:

- ``uniform(k)``: ``k`` distinct clients drawn uniformly without replacement;
  ``cohorts.size == k``, ``cohorts.sampling_rate == k / N``.
- ``poisson(q)``: each client independently with probability ``q``; the cohort is
  padded to ``cohorts.size`` members (by default the smallest size that a round passes
  with probability below ``1e-9``; a round that draws more raises PopulationError rather
  than drop clients). A padding member has all-zero data and count 0: the round masks
  it by its count (e.g. ``fcir.reduce_weighted_mean(updates, counts)``, or a mask
  ``jnp.arange(m) < count`` over its examples, which gives a zero update).
  ``cohorts.sampling_rate == q``.

Which clients a round takes is a function of ``(seed, round)`` alone (numpy's
``default_rng([seed, round])``), so a run is reproducible and can be resumed at any
round. The privacy accountant knows the sampling: ``cohorts.epsilon(module, rounds,
delta)`` and ``cohorts.budget(module, delta, max_epsilon)`` are ``fcir.privacy.epsilon``
and ``fcir.privacy.Budget`` at ``sampling_rate=q``, amplification by Poisson
subsampling, which is exact for ``poisson(q)`` cohorts. ``uniform(k)`` cohorts are
accounted only with ``approximate=True``, at q = k/N as if Poisson (the usual
approximation, not a proven bound: fixed-size sampling is not what the accountant's
add-or-remove-one analysis covers); train private rounds on Poisson cohorts.

Running rounds over the cohorts is a backend's job:
``fcir.interpreters.xla.simulate(round_fn, state, cohorts, rounds)``.
"""

from __future__ import annotations

import math
import numbers

import jax
import numpy as np

from fcir import privacy
from fcir.errors import PopulationError, PrivacyError

__all__ = ["Cohorts", "Population"]

# A Poisson cohort's default size: exceeded in a round with probability below this.
OVERFLOW = 1e-9


def _count(who: str, name: str, value, low: int, high: int | None = None) -> int:
    ok = isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))
    if not ok or value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise PopulationError(f"{who}: {name} must be an int {bound}, got {value!r}")
    return int(value)


class Population:
    """``N`` clients' data on the host: a pytree of numpy arrays, clients on axis 0.

    ``counts`` (length ``N``, default: every client 1) is each client's number of real
    examples: the weight of its update and the length of its mask.
    """

    def __init__(self, data, counts=None):
        leaves = [np.asarray(x) for x in jax.tree.leaves(data)]
        if not leaves:
            raise PopulationError("fcir.Population: data has no arrays")
        n = leaves[0].shape[0] if leaves[0].ndim else None
        if n is None or any(x.ndim == 0 or x.shape[0] != n for x in leaves):
            shapes = [x.shape for x in leaves]
            raise PopulationError(
                f"fcir.Population: every array needs the clients on its leading axis, one "
                f"length for all; got shapes {shapes}"
            )
        if n == 0:
            raise PopulationError("fcir.Population: no clients (leading axis of length 0)")
        self.data = jax.tree.map(np.asarray, data)
        counts = np.ones(n) if counts is None else np.asarray(counts)
        if counts.shape != (n,) or not np.all(np.isfinite(counts)) or np.any(counts < 0):
            raise PopulationError(
                f"fcir.Population: counts must be {n} finite numbers >= 0 (one per client), "
                f"got shape {counts.shape}"
            )
        self.counts = counts.astype(np.float32)

    @classmethod
    def from_clients(cls, clients) -> Population:
        """A population from a list of per-client pytrees of one structure whose leaves
        have the client's examples on axis 0, of different lengths: each leaf is padded
        with zeros to the longest, and ``counts`` is each client's length (axis 0 of
        its first leaf)."""
        clients = list(clients)
        if not clients:
            raise PopulationError("fcir.Population.from_clients: no clients")
        flat = [jax.tree.flatten(c) for c in clients]
        treedef = flat[0][1]
        if treedef.num_leaves == 0 or any(t != treedef for _, t in flat):
            raise PopulationError(
                "fcir.Population.from_clients: every client needs the same structure of "
                "arrays (and at least one)"
            )
        per_client = [[np.asarray(x) for x in leaves] for leaves, _ in flat]
        counts = np.array([c[0].shape[0] if c[0].ndim else 0 for c in per_client])
        stacked = []
        for j in range(treedef.num_leaves):
            col = [c[j] for c in per_client]
            if any(x.ndim == 0 or x.shape[0] != counts[i] for i, x in enumerate(col)):
                raise PopulationError(
                    f"fcir.Population.from_clients: leaf {j} of some client does not have "
                    "that client's examples on axis 0 (as many as its first leaf)"
                )
            if len({(x.shape[1:], x.dtype) for x in col}) != 1:
                raise PopulationError(
                    f"fcir.Population.from_clients: leaf {j} differs between clients in "
                    "shape past axis 0 or in dtype"
                )
            out = np.zeros((len(col), int(counts.max()), *col[0].shape[1:]), col[0].dtype)
            for i, x in enumerate(col):
                out[i, : len(x)] = x
            stacked.append(out)
        return cls(treedef.unflatten(stacked), counts)

    @property
    def size(self) -> int:
        """``N``, the number of clients."""
        return len(self.counts)

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in jax.tree.leaves(self.data)) + self.counts.nbytes

    def __repr__(self) -> str:
        return f"<fcir.Population of {self.size} clients, {self.nbytes / 2**20:.1f} MiB>"

    def uniform(self, k: int, seed: int = 0) -> Cohorts:
        """Cohorts of ``k`` distinct clients, drawn uniformly without replacement."""
        k = _count("fcir.Population.uniform", "k", k, 1, self.size)
        return Cohorts(self, "uniform", k, k / self.size, _seed(seed))

    def poisson(self, q: float, seed: int = 0, max_size: int | None = None) -> Cohorts:
        """Cohorts of each client taken independently with probability ``q``, padded to
        ``max_size`` members (default: exceeded with probability below 1e-9 a round)."""
        ok = isinstance(q, numbers.Real) and not isinstance(q, bool) and 0 < q <= 1
        if not ok:
            raise PopulationError(f"fcir.Population.poisson: q must be in (0, 1], got {q!r}")
        if max_size is None:
            max_size = _binomial_quantile(self.size, float(q), OVERFLOW)
        max_size = _count("fcir.Population.poisson", "max_size", max_size, 1, self.size)
        return Cohorts(self, "poisson", max_size, float(q), _seed(seed))


def _seed(seed) -> int:
    return _count("fcir.Population", "seed", seed, 0)


def _binomial_quantile(n: int, q: float, tail: float) -> int:
    """The smallest ``m`` with P(Binomial(n, q) > m) < ``tail`` (at least 1)."""
    if q >= 1.0:
        return n
    k = np.arange(n, dtype=np.float64)
    # log pmf(k + 1) - log pmf(k) = log((n - k) / (k + 1)) + log(q / (1 - q))
    steps = np.log((n - k) / (k + 1)) + math.log(q) - math.log1p(-q)
    logpmf = n * math.log1p(-q) + np.concatenate([[0.0], np.cumsum(steps)])
    above = np.cumsum(np.exp(logpmf)[::-1])[::-1]  # above[m] = P(X >= m)
    small = np.flatnonzero(np.append(above[1:], 0.0) < tail)  # P(X > m) < tail
    return max(1, int(small[0]))


class Cohorts:
    """How a :class:`Population`'s cohorts are sampled, round by round (from
    ``Population.uniform`` / ``Population.poisson``)."""

    def __init__(self, population: Population, kind: str, size: int, rate: float, seed: int):
        self.population = population
        self.kind = kind
        self.size = size  # the cohort's fixed number of members (padding included)
        self.sampling_rate = rate  # k/N or q: what the accountant takes
        self.seed = seed

    def privacy_sampling_rate(self, approximate: bool = False) -> float:
        """The rate ``fcir.privacy`` accounts these cohorts' rounds at: ``q`` for Poisson
        cohorts. Uniform cohorts of ``k`` have no add-or-remove-one bound in the
        accountant; ``approximate=True`` takes ``k / N`` as if Poisson (the usual
        approximation), else a PrivacyError."""
        if self.kind == "uniform" and not approximate:
            raise PrivacyError(
                f"fcir.Cohorts: uniform cohorts of {self.size} of {self.population.size} "
                "clients (fixed size, without replacement) are not what the accountant's "
                "add-or-remove-one analysis of subsampling covers; sample Poisson cohorts "
                f"(Population.poisson({self.sampling_rate:g})) for an exact bound, or pass "
                f"approximate=True to account q = k/N = {self.sampling_rate:g} as if Poisson"
            )
        return self.sampling_rate

    def epsilon(self, module, rounds: int, delta: float, *, approximate: bool = False,
                accountant: str = "rdp") -> float:
        """ε of ``rounds`` rounds of the private round ``module`` over these cohorts:
        ``fcir.privacy.epsilon`` at :meth:`privacy_sampling_rate`."""
        rate = self.privacy_sampling_rate(approximate)
        return privacy.epsilon(module, rounds, delta, rate, accountant=accountant)

    def budget(self, module, delta: float, max_epsilon: float, *, approximate: bool = False,
               accountant: str = "rdp") -> privacy.Budget:
        """A ``fcir.privacy.Budget`` of ``module``'s rounds over these cohorts."""
        rate = self.privacy_sampling_rate(approximate)
        return privacy.Budget(module, delta, max_epsilon, rate, accountant=accountant)

    def __repr__(self) -> str:
        how = f"k={self.size}" if self.kind == "uniform" else f"q={self.sampling_rate:g}"
        return (
            f"<fcir.Cohorts {self.kind} {how} of {self.population.size} clients, "
            f"size {self.size}, seed {self.seed}>"
        )

    def indices(self, r: int) -> tuple[np.ndarray, np.ndarray]:
        """Round ``r``'s cohort: (``int32[size]`` client indices, ``bool[size]`` real
        member). Padding members (Poisson only, at the end) have index ``N``."""
        r = _count("fcir.Cohorts.indices", "round", r, 0)
        n = self.population.size
        rng = np.random.default_rng([self.seed, r])
        if self.kind == "uniform":
            chosen = np.sort(rng.choice(n, self.size, replace=False))
        else:
            chosen = np.flatnonzero(rng.random(n) < self.sampling_rate)
            if len(chosen) > self.size:
                raise PopulationError(
                    f"fcir.Cohorts: round {r} sampled {len(chosen)} clients at rate "
                    f"{self.sampling_rate:g}, more than the cohort's fixed size "
                    f"{self.size}; pass a larger max_size to Population.poisson (dropping "
                    "clients would change the sampling the accountant assumes)"
                )
        idx = np.full(self.size, n, np.int32)
        idx[: len(chosen)] = chosen
        valid = np.zeros(self.size, bool)
        valid[: len(chosen)] = True
        return idx, valid

    def plan(self, first: int, rounds: int) -> tuple[np.ndarray, np.ndarray]:
        """Rounds ``first .. first + rounds - 1``: stacked :meth:`indices`."""
        pairs = [self.indices(first + i) for i in range(rounds)]
        idx = np.stack([p[0] for p in pairs]) if pairs else np.zeros((0, self.size), np.int32)
        valid = np.stack([p[1] for p in pairs]) if pairs else np.zeros((0, self.size), bool)
        return idx, valid

    def specs(self):
        """A cohort's shapes and dtypes, as :meth:`gather` returns it:
        ``jax.ShapeDtypeStruct`` pytrees (data, counts), for ``fcir.capture``."""

        def one(x):
            return jax.ShapeDtypeStruct((self.size, *x.shape[1:]), x.dtype)

        return jax.tree.map(one, self.population.data), jax.ShapeDtypeStruct((self.size,), np.float32)

    def gather(self, r: int):
        """Round ``r``'s cohort as numpy: (data with ``size`` members on axis 0, counts
        ``f32[size]``); padding members are zeros with count 0."""
        idx, valid = self.indices(r)
        return self.take(idx, valid)

    def empty(self):
        """Uninitialized arrays of a cohort's shapes and dtypes, as :meth:`gather` returns
        them: room for :meth:`take` to fill (``out=``)."""

        def one(x):
            return np.empty((self.size, *x.shape[1:]), x.dtype)

        return jax.tree.map(one, self.population.data), np.empty(self.size, np.float32)

    def take(self, idx: np.ndarray, valid: np.ndarray, out=None):
        """The members ``idx`` (with ``valid``) of the population, as :meth:`gather`.

        ``out`` (from :meth:`empty`) is filled and returned instead of new arrays: a
        loop that reuses its arrays writes into memory it has touched before, where new
        arrays of a large cohort cost a page fault per page, which was most of a gather's
        time on a TPU host."""
        real = idx[valid]
        k = len(real)
        data, counts = self.empty() if out is None else out
        pop = self.population
        for x, o in zip(jax.tree.leaves(pop.data), jax.tree.leaves(data)):
            np.take(x, real, axis=0, out=o[:k], mode="clip")  # "clip": into out, unbuffered
            o[k:] = 0
        np.take(pop.counts, real, out=counts[:k], mode="clip")
        counts[k:] = 0
        return data, counts
