"""``fcir.Population``: many clients on the host, a cohort of them sampled each round.

```python
import numpy as np
import fcir

# 100 clients with 3 to 7 examples each, kept as their examples (ragged).
rng = np.random.default_rng(0)
clients = [(rng.normal(size=(n, 2)).astype(np.float32),) for n in rng.integers(3, 8, 100)]
population = fcir.Population.from_clients(clients)
assert population.data[0].shape == (population.counts.sum(), 2)  # every example once
cohorts = population.uniform(10, seed=0)          # 10 clients a round, without replacement
# or population.poisson(0.1, seed=0): each client at rate 0.1, padded to a fixed size
data, counts = cohorts.gather(0)                  # round 0's cohort (numpy), padded to 7
assert data[0].shape == (cohorts.size, 7, 2) and counts.shape == (cohorts.size,)
bucketed = population.uniform(2, seed=0, padding="bucket")  # to 4 when both have <= 4
assert bucketed.lengths == (1, 2, 4, 7) and bucketed.specs(0)[0][0].shape[1] in (4, 7)
```

The population's data stay on the host as numpy arrays, read-only (the class says
when they are the caller's own). ``from_clients`` keeps each leaf's examples
concatenated (``[total examples, ...]``, client ``i``'s at ``offsets[i]:offsets[i +
1]``), so the host holds the examples and no padding;
``Population(data, counts)`` takes data already padded, clients on the leading axis,
and a member gets its client's slice as it is. ``counts`` (``f32[N]``) holds each
client's number of real examples. A cohort's members are padded with zeros to one
number of examples: by default the population's longest client, so every round has
the same shape and one compiled round serves them all; with ``padding="bucket"`` the
round's longest member rounded up to a power of two, so that a round's memory and
compute follow the clients it drew (one compiled round per length). A cohort always
has ``cohorts.size`` members:

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

import bisect
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
    """``N`` clients' data on the host, in one of two layouts.

    ``Population(data, counts=None)``: **dense**. ``data`` is a pytree of numpy arrays
    with the clients on axis 0, each client's slice what a member of a cohort gets as it
    is (no examples axis is needed); ``counts`` (length ``N``, default: every client 1)
    is each client's number of real examples: the weight of its update and the length
    of its mask.

    ``Population.from_clients(clients)``: **ragged**. Each leaf keeps the clients'
    examples concatenated, ``[total examples, ...]``, client ``i``'s rows at
    ``offsets[i]:offsets[i + 1]`` (:meth:`client` returns them), so host memory follows
    the examples, not ``N`` times the longest client; ``counts`` is each client's
    number of examples. A cohort pads its members' examples with zeros to one length,
    the population's longest or a bucket (``padding=`` of :meth:`uniform`).

    A population is what its data were when it was made: its arrays are read-only and
    no one writes to them. ``from_clients`` builds arrays of its own; ``Population``
    keeps a read-only copy of an array the caller can still write to, and shares one
    that is read-only down to its memory (``x.flags.writeable = False`` on an array
    that owns it, or ``np.load(path, mmap_mode="r")``), so that a large population is
    not held twice. ``xla.simulate``'s device loop relies on this to keep the
    population on the device from one call to the next.
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
        self.data = jax.tree.unflatten(jax.tree.structure(data), map(_read_only, leaves))
        counts = np.ones(n) if counts is None else np.asarray(counts)
        if counts.shape != (n,) or not np.all(np.isfinite(counts)) or np.any(counts < 0):
            raise PopulationError(
                f"fcir.Population: counts must be {n} finite numbers >= 0 (one per client), "
                f"got shape {counts.shape}"
            )
        self.counts = _frozen(counts.astype(np.float32))
        self.offsets = None  # dense: whole client slices
        self._rows = None

    @classmethod
    def from_clients(cls, clients) -> Population:
        """A ragged population from a list of per-client pytrees of one structure whose
        leaves have the client's examples on axis 0, as many in each leaf and any number
        per client: each leaf's examples are concatenated in client order, and
        ``counts`` is each client's number of examples (axis 0 of its first leaf)."""
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
        rows = np.array([c[0].shape[0] if c[0].ndim else 0 for c in per_client], np.int64)
        stacked = []
        for j in range(treedef.num_leaves):
            col = [c[j] for c in per_client]
            if any(x.ndim == 0 or x.shape[0] != rows[i] for i, x in enumerate(col)):
                raise PopulationError(
                    f"fcir.Population.from_clients: leaf {j} of some client does not have "
                    "that client's examples on axis 0 (as many as its first leaf)"
                )
            if len({(x.shape[1:], x.dtype) for x in col}) != 1:
                raise PopulationError(
                    f"fcir.Population.from_clients: leaf {j} differs between clients in "
                    "shape past axis 0 or in dtype"
                )
            stacked.append(_frozen(np.concatenate(col)))  # its own: no copy
        self = cls.__new__(cls)
        self.data = treedef.unflatten(stacked)
        self.counts = _frozen(rows.astype(np.float32))
        self.offsets = _frozen(np.concatenate([[0], np.cumsum(rows)]).astype(np.int64))
        self._rows = _frozen(rows)
        return self

    def client(self, i: int):
        """Client ``i``'s data: its rows of each leaf (ragged), or its slice (dense)."""
        i = _count("fcir.Population.client", "i", i, 0, self.size - 1)
        if self.offsets is None:
            return jax.tree.map(lambda x: x[i], self.data)
        a, b = self.offsets[i], self.offsets[i + 1]
        return jax.tree.map(lambda x: x[a:b], self.data)

    @property
    def longest(self) -> int | None:
        """The most examples a client has (ragged), what a cohort padded to the
        population's longest holds per member; None for a dense population."""
        return None if self._rows is None else int(self._rows.max())

    @property
    def size(self) -> int:
        """``N``, the number of clients."""
        return len(self.counts)

    @property
    def nbytes(self) -> int:
        """Bytes of the population on the host: its arrays, counts and offsets."""
        extra = 0 if self.offsets is None else self.offsets.nbytes
        return sum(x.nbytes for x in jax.tree.leaves(self.data)) + self.counts.nbytes + extra

    def __repr__(self) -> str:
        mib = f"{self.nbytes / 2**20:.1f} MiB"
        if self.offsets is None:
            return f"<fcir.Population of {self.size} clients, {mib}>"
        return (
            f"<fcir.Population of {self.size} clients, {int(self.offsets[-1])} examples "
            f"(at most {self.longest} a client), {mib}>"
        )

    def uniform(self, k: int, seed: int = 0, *, padding="population") -> Cohorts:
        """Cohorts of ``k`` distinct clients, drawn uniformly without replacement;
        ``padding`` as :meth:`poisson`'s."""
        k = _count("fcir.Population.uniform", "k", k, 1, self.size)
        return Cohorts(self, "uniform", k, k / self.size, _seed(seed), padding)

    def poisson(
        self, q: float, seed: int = 0, max_size: int | None = None, *, padding="population"
    ) -> Cohorts:
        """Cohorts of each client taken independently with probability ``q``, padded to
        ``max_size`` members (default: exceeded with probability below 1e-9 a round).

        ``padding`` (ragged populations, from :meth:`from_clients`): how many examples
        a member of a round's cohort holds, its own followed by zeros. ``"population"``
        (the default): the population's longest client, every round one shape (one
        compiled round). ``"bucket"``: the longest member of the round rounded up to a
        power of two (at most the population's longest), so that a round's memory and
        compute follow its members' data, at the price of one compiled round per
        length that occurs. A sequence of ints: those lengths as the buckets (the
        population's longest is always the last)."""
        ok = isinstance(q, numbers.Real) and not isinstance(q, bool) and 0 < q <= 1
        if not ok:
            raise PopulationError(f"fcir.Population.poisson: q must be in (0, 1], got {q!r}")
        if max_size is None:
            max_size = _binomial_quantile(self.size, float(q), OVERFLOW)
        max_size = _count("fcir.Population.poisson", "max_size", max_size, 1, self.size)
        return Cohorts(self, "poisson", max_size, float(q), _seed(seed), padding)


def _lengths(who: str, population: Population, padding) -> tuple[int, ...] | None:
    """The example lengths that ``padding`` pads a cohort's members to, shortest first
    (None: a dense population's members are whole client slices)."""
    if isinstance(padding, str) and padding == "population":
        return None if population.offsets is None else (population.longest,)
    if isinstance(padding, str) and padding == "bucket":
        longest = population.longest or 0
        buckets = [1 << j for j in range(longest.bit_length())]  # powers of two below it
    elif (
        isinstance(padding, (list, tuple))
        and padding
        and all(
            isinstance(b, numbers.Integral) and not isinstance(b, (bool, np.bool_)) and b >= 1
            for b in padding
        )
    ):
        buckets = [int(b) for b in padding]
    else:
        raise PopulationError(
            f"{who}: padding must be 'population', 'bucket' or a sequence of lengths >= 1, "
            f"got {padding!r}"
        )
    if population.offsets is None:
        raise PopulationError(
            f"{who}: padding={padding!r} pads each round's members to the round's own "
            "longest, which needs each client's examples apart; this population was given "
            "as whole padded clients (fcir.Population(data, counts)): build it with "
            "fcir.Population.from_clients(list of per-client data), or keep "
            "padding='population'"
        )
    longest = population.longest
    return tuple(sorted({b for b in buckets if b < longest} | {longest}))


def _frozen(x: np.ndarray) -> np.ndarray:
    """``x``, an array no one else holds, made read-only."""
    x.flags.writeable = False
    return x


def _read_only(x) -> np.ndarray:
    """A leaf of a dense population as the population keeps it: read-only, and never
    written to by anyone: the caller's own array where it is read-only down to its
    memory (a read-only array, or a view whose every base is read-only: no one can
    write to it), else a read-only copy (the caller may write to the array it gave)."""
    x = np.asarray(x)
    base = x
    while isinstance(base, np.ndarray):
        if base.flags.writeable:
            return _frozen(np.array(x, order="C"))
        base = base.base
    return x


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
    ``Population.uniform`` / ``Population.poisson``).

    ``lengths``: the example lengths a round's members may be padded to (one with
    ``padding="population"``; None for a dense population, whose members are whole
    client slices); :meth:`length` says round ``r``'s, :meth:`specs` its shapes."""

    def __init__(
        self,
        population: Population,
        kind: str,
        size: int,
        rate: float,
        seed: int,
        padding="population",
    ):
        self.population = population
        self.kind = kind
        self.size = size  # the cohort's fixed number of members (padding included)
        self.sampling_rate = rate  # k/N or q: what the accountant takes
        self.seed = seed
        self.padding = padding
        self.lengths = _lengths(f"fcir.Population.{kind}", population, padding)

    @property
    def bucketed(self) -> bool:
        """Whether rounds may differ in shape (more than one padded length)."""
        return self.lengths is not None and len(self.lengths) > 1

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

    def epsilon(
        self,
        module,
        rounds: int,
        delta: float,
        *,
        approximate: bool = False,
        accountant: str = "rdp",
    ) -> float:
        """ε of ``rounds`` rounds of the private round ``module`` over these cohorts:
        ``fcir.privacy.epsilon`` at :meth:`privacy_sampling_rate`."""
        rate = self.privacy_sampling_rate(approximate)
        return privacy.epsilon(module, rounds, delta, rate, accountant=accountant)

    def budget(
        self,
        module,
        delta: float,
        max_epsilon: float,
        *,
        approximate: bool = False,
        accountant: str = "rdp",
    ) -> privacy.Budget:
        """A ``fcir.privacy.Budget`` of ``module``'s rounds over these cohorts."""
        rate = self.privacy_sampling_rate(approximate)
        return privacy.Budget(module, delta, max_epsilon, rate, accountant=accountant)

    def __repr__(self) -> str:
        how = f"k={self.size}" if self.kind == "uniform" else f"q={self.sampling_rate:g}"
        pad = "" if not self.bucketed else f", example lengths {self.lengths}"
        return (
            f"<fcir.Cohorts {self.kind} {how} of {self.population.size} clients, "
            f"size {self.size}, seed {self.seed}{pad}>"
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

    def length(self, r: int) -> int | None:
        """Round ``r``'s example length: each member's examples padded to it (None for
        a dense population)."""
        return self._length(*self.indices(r))

    def _length(self, idx: np.ndarray, valid: np.ndarray) -> int | None:
        """The example length of the cohort ``idx`` (with ``valid``): the smallest of
        :attr:`lengths` that holds its longest member."""
        if not self.bucketed:
            return None if self.lengths is None else self.lengths[0]
        real = idx[valid]
        longest = int(self.population._rows[real].max()) if len(real) else 0
        return self.lengths[bisect.bisect_left(self.lengths, longest)]

    def _round_length(self, r, who: str) -> int | None:
        if r is not None:
            return self.length(r)
        if self.bucketed:
            raise PopulationError(
                f"fcir.Cohorts.{who}: these cohorts pad each round to its own members "
                f"(padding={self.padding!r}: example lengths {self.lengths}), so a round's "
                f"shapes depend on the round: pass it, {who}(r); or sample with "
                "padding='population' for one shape"
            )
        return None if self.lengths is None else self.lengths[0]

    def specs(self, r: int | None = None):
        """A cohort's shapes and dtypes, as :meth:`gather` returns round ``r``'s:
        ``jax.ShapeDtypeStruct`` pytrees (data, counts), for ``fcir.capture``. Without
        ``r``, the shapes every round has (bucketed cohorts need ``r``)."""
        return self._specs(self._round_length(r, "specs"))

    def _specs(self, length: int | None):
        def one(x):
            return jax.ShapeDtypeStruct(self._member_shape(x, length), x.dtype)

        return jax.tree.map(one, self.population.data), jax.ShapeDtypeStruct(
            (self.size,), np.float32
        )

    def _member_shape(self, x: np.ndarray, length: int | None) -> tuple[int, ...]:
        """A cohort's shape of the population leaf ``x``: ``size`` members of a client's
        slice (dense) or of ``length`` examples (ragged)."""
        if length is None:
            return (self.size, *x.shape[1:])
        return (self.size, length, *x.shape[1:])

    def gather(self, r: int):
        """Round ``r``'s cohort as numpy: (data with ``size`` members on axis 0, counts
        ``f32[size]``); padding members are zeros with count 0, and so are a member's
        examples past its own (ragged populations)."""
        idx, valid = self.indices(r)
        return self.take(idx, valid)

    def empty(self, r: int | None = None):
        """Uninitialized arrays of a cohort's shapes and dtypes, as :meth:`gather`
        returns round ``r``'s (without ``r``, every round's: bucketed cohorts need it):
        room for :meth:`take` to fill (``out=``)."""
        return self._empty(self._round_length(r, "empty"))

    def _empty(self, length: int | None):
        def one(x):
            return np.empty(self._member_shape(x, length), x.dtype)

        return jax.tree.map(one, self.population.data), np.empty(self.size, np.float32)

    def take(self, idx: np.ndarray, valid: np.ndarray, out=None):
        """The members ``idx`` (with ``valid``) of the population, as :meth:`gather`.

        ``out`` (from :meth:`empty`, of the members' shapes) is filled and returned
        instead of new arrays: a loop that reuses its arrays writes into memory it has
        touched before, where new arrays of a large cohort cost a page fault per page,
        which was most of a gather's time on a TPU host."""
        length = self._length(idx, valid)
        if out is None:
            data, counts = self._empty(length)
        else:
            data, counts = out
            want = self._member_shape(jax.tree.leaves(self.population.data)[0], length)
            if jax.tree.leaves(data)[0].shape != want:
                raise PopulationError(
                    f"fcir.Cohorts.take: out holds members of shape "
                    f"{jax.tree.leaves(data)[0].shape[1:]}, these members need {want[1:]}: "
                    "pass out=cohorts.empty(r) for round r"
                )
        real = idx[valid]
        k = len(real)
        pop = self.population
        if pop.offsets is None:
            for x, o in zip(jax.tree.leaves(pop.data), jax.tree.leaves(data)):
                np.take(x, real, axis=0, out=o[:k], mode="clip")  # "clip": into out, unbuffered
                o[k:] = 0
        else:
            _take_rows(pop, real, data)
        np.take(pop.counts, real, out=counts[:k], mode="clip")
        counts[k:] = 0
        return data, counts


def _take_rows(pop: Population, real: np.ndarray, data) -> None:
    """Fills ``data`` (members ``[size, length, ...]``) with the examples of the clients
    ``real`` of a ragged population, each member's own rows then zeros; members past
    ``len(real)`` all zeros.

    Two ways, the same bytes: where most of the members' windows are examples, one
    ``np.take`` of every window's rows per leaf (then the padding rows zeroed), as fast
    as the memory for any number of members; where most is padding (a skewed population
    padded to its longest), a copy and a contiguous fill per member and leaf, since
    gathering and then zeroing the padding rows touched them twice (measured 48 against
    84 ms for 50 CIFAR-shaped members padded to 708 examples, and 5 against 0.1 ms
    for 1,000 members of 20 two-value examples the other way)."""
    k = len(real)
    starts, rows = pop.offsets[real], pop._rows[real]
    length = jax.tree.leaves(data)[0].shape[1]
    leaves = zip(jax.tree.leaves(pop.data), jax.tree.leaves(data))
    if 2 * int(rows.sum()) >= k * length:
        pos = np.arange(length)
        pad = pos >= rows[:, None]  # [k, length]
        at = np.where(pad, 0, starts[:, None] + pos)
        for x, o in leaves:
            np.take(x, at, axis=0, out=o[:k], mode="clip")  # "clip": into out, unbuffered
            o[:k][pad] = 0
            o[k:] = 0
        return
    spans = list(zip(starts.tolist(), rows.tolist()))
    for x, o in leaves:
        for j, (a, c) in enumerate(spans):
            o[j, :c] = x[a : a + c]
            o[j, c:] = 0
        o[k:] = 0
