"""Populations and cohorts (fcir/population.py) and ``xla.simulate``
(fcir/interpreters/xla/simulation.py): the sampling is what it declares and
reproducible, a ragged population holds its examples and no padding while its cohorts
are the padded ones bit for bit, bucketed cohorts take a shape per round and a compile
per length, a simulated run is the round run by hand on the same cohorts, padding is
masked by the counts, the next cohort is put while the round runs, and the accountant
takes the sampling rate."""

from __future__ import annotations

import gc
import math
import re
import threading
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fcir.interpreters import xla
from fcir.interpreters.xla import simulation as xsim
from fcir.interpreters.xla.cost import predicted_peak

import fcir
from fcir.population import Cohorts, Population

N = 30  # clients
K = 5  # uniform cohort size
Q = 0.2  # Poisson rate


def ragged_clients(n=N, seed=0):
    """``n`` clients with 1..6 examples of (x f32[., 2], y i32[.])."""
    rng = np.random.default_rng(seed)
    return [
        {
            "x": rng.normal(size=(m, 2)).astype(np.float32),
            "y": rng.integers(0, 9, m).astype(np.int32),
        }
        for m in rng.integers(1, 7, n)
    ]


def padded(clients):
    """The clients padded to the longest with zeros, clients on axis 0, and their
    counts: what ``Population(data, counts)`` takes (the dense layout)."""
    rows = [len(c["y"]) for c in clients]
    longest = max(rows)

    def pad(x):
        return np.concatenate([x, np.zeros((longest - len(x), *x.shape[1:]), x.dtype)])

    return jax.tree.map(lambda *xs: np.stack([pad(x) for x in xs]), *clients), np.array(rows)


def skewed_clients(seed=0):
    """30 clients, most with 1 or 2 examples and a few with many (up to 30): cohorts of
    3 have their longest member in several buckets."""
    rng = np.random.default_rng(seed)
    sizes = [1] * 14 + [2] * 8 + [3, 3, 5, 6, 9, 12, 20, 30]
    return [
        {
            "x": rng.normal(size=(m, 2)).astype(np.float32),
            "y": rng.integers(0, 9, m).astype(np.int32),
        }
        for m in sizes
    ]


@pytest.fixture(scope="module")
def skewed():
    return Population.from_clients(skewed_clients())


@pytest.fixture(scope="module")
def population():
    return Population.from_clients(ragged_clients())


def client_mean(w, data, n):
    """One client's masked mean of its x rows, minus the model."""
    mask = (jnp.arange(data["x"].shape[0]) < n)[:, None]
    return jnp.sum(data["x"] * mask, 0) / jnp.maximum(n, 1.0) - w


def make_round(size, metrics=False):
    @fcir.program(placements={"clients": size})
    def step(w, data, counts):
        deltas = fcir.map_fn(client_mean, (fcir.broadcast(w), data, counts))
        new = w + 0.5 * fcir.reduce_weighted_mean(deltas, counts)
        if not metrics:
            return new
        # Unmasked: the padding's data count here unless they are zeros.
        everything = fcir.reduce_sum(fcir.map_fn(lambda d: jnp.sum(d["x"]), data))
        return new, (fcir.reduce_sum(counts), everything)

    return step


@pytest.fixture(scope="module")
def uniform_exe(population):
    cohorts = population.uniform(K, seed=3)
    module = fcir.capture(make_round(K), jnp.zeros(2), *cohorts.gather(0))
    return xla.compile(module)


# -- sampling ---------------------------------------------------------------------------


def test_uniform_cohorts_are_k_distinct_clients_equally_often_and_reproducible(population):
    cohorts = population.uniform(K, seed=1)
    assert (cohorts.size, cohorts.sampling_rate) == (K, K / N)
    idx, valid = cohorts.plan(0, 3000)
    assert valid.all() and all(len(set(row)) == K for row in idx)
    assert idx.min() >= 0 and idx.max() < N
    # Each client is in a cohort with probability k/N: 500 draws each on average.
    hits = np.bincount(idx.ravel(), minlength=N)
    assert np.abs(hits - 3000 * K / N).max() < 5 * np.sqrt(3000 * K / N)
    np.testing.assert_array_equal(
        cohorts.indices(7)[0], population.uniform(K, seed=1).indices(7)[0]
    )
    assert not np.array_equal(cohorts.plan(0, 5)[0], population.uniform(K, seed=2).plan(0, 5)[0])


def test_poisson_cohorts_take_each_client_at_rate_q_padded_to_a_fixed_size(population):
    cohorts = population.poisson(Q, seed=1)
    assert cohorts.sampling_rate == Q and cohorts.size < N
    idx, valid = cohorts.plan(0, 3000)
    assert idx.shape == (3000, cohorts.size)
    # Real members first, distinct; padding points past the last client.
    assert all(np.all(v[:-1] >= v[1:]) for v in valid)
    assert np.all(idx[~valid] == N) and np.all(idx[valid] < N)
    sizes = valid.sum(1)
    assert abs(sizes.mean() - Q * N) < 0.2 and abs(sizes.var() - N * Q * (1 - Q)) < 0.6
    hits = np.bincount(idx[valid], minlength=N)
    assert np.abs(hits - 3000 * Q).max() < 5 * np.sqrt(3000 * Q)

    # The default size: the smallest that a round passes with probability below 1e-9.
    def over(m):
        return sum(math.comb(N, j) * Q**j * (1 - Q) ** (N - j) for j in range(m + 1, N + 1))

    assert over(cohorts.size) < 1e-9 <= over(cohorts.size - 1)
    again = population.poisson(Q, seed=1)
    np.testing.assert_array_equal(again.plan(10, 4)[0], cohorts.plan(10, 4)[0])


def test_a_poisson_round_over_the_fixed_size_is_an_error_not_a_dropped_client(population):
    cohorts = population.poisson(0.5, seed=0, max_size=2)
    with pytest.raises(fcir.PopulationError, match="larger max_size"):
        cohorts.plan(0, 5)


def test_from_clients_keeps_the_examples_ragged_in_as_many_bytes_as_the_examples():
    clients = ragged_clients(40)
    pop = Population.from_clients(clients)
    rows = np.array([len(c["y"]) for c in clients])
    total = rows.sum()
    assert pop.data["x"].shape == (total, 2) and pop.data["y"].shape == (total,)
    np.testing.assert_array_equal(pop.offsets, np.concatenate([[0], np.cumsum(rows)]))
    np.testing.assert_array_equal(pop.counts, rows)
    assert pop.longest == rows.max()
    for i, c in enumerate(clients):
        got = pop.client(i)
        np.testing.assert_array_equal(got["x"], c["x"])
        np.testing.assert_array_equal(got["y"], c["y"])
    example = 2 * 4 + 4  # bytes of an example: x f32[2], y i32
    per_client = pop.counts.nbytes + pop.offsets.nbytes
    assert pop.nbytes == total * example + per_client
    dense = Population(*padded(clients))
    assert dense.nbytes == 40 * rows.max() * example + dense.counts.nbytes
    assert dense.offsets is None and dense.longest is None


def test_gather_of_a_ragged_population_is_the_padded_gather_bit_for_bit():
    """Members padded with zeros to the population's longest, as a population of
    clients padded beforehand gives them; Poisson padding members all zeros."""
    # Members mostly examples (1..6 of 6: one gather of all the windows' rows) and
    # mostly padding (1..30 of 30, most 1 or 2: a copy and a fill per member).
    pairs = []
    for clients in (ragged_clients(40), skewed_clients()):
        ragged, dense = Population.from_clients(clients), Population(*padded(clients))
        pairs += [(ragged.poisson(0.2, seed=4), dense.poisson(0.2, seed=4)),
                  (ragged.uniform(7, seed=1), dense.uniform(7, seed=1))]  # fmt: skip
    for a, b in pairs:
        assert a.specs() == b.specs() and a.lengths == (a.population.longest,)
        assert b.lengths is None
        out = a.empty()
        for r in range(4):
            want = b.gather(r)
            for got in (a.gather(r), a.take(*a.indices(r), out=out)):
                for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
                    assert x.dtype == y.dtype
                    np.testing.assert_array_equal(x, y)
        idx, valid = a.indices(0)
        data, counts = a.gather(0)
        if (~valid).any():
            assert not data["x"][~valid].any() and not counts[~valid].any()


def test_bucketed_cohorts_pad_each_round_to_the_bucket_of_its_longest_member(skewed):
    cohorts = skewed.uniform(3, seed=0, padding="bucket")
    assert cohorts.bucketed and cohorts.lengths == (1, 2, 4, 8, 16, 30)
    assert skewed.uniform(3, padding=[3, 10, 50]).lengths == (3, 10, 30)
    assert skewed.uniform(3, padding="population").lengths == (30,)
    whole = skewed.uniform(3, seed=0)  # the same members, padded to the longest client
    seen = set()
    for r in range(8):
        idx, valid = cohorts.indices(r)
        longest = skewed.counts[idx].max()
        length = cohorts.length(r)
        assert length == min(b for b in cohorts.lengths if b >= longest)
        seen.add(length)
        data, counts = cohorts.gather(r)
        assert data["x"].shape == (3, length, 2) and data["y"].shape == (3, length)
        assert jax.tree.map(lambda s: s.shape, cohorts.specs(r)) == jax.tree.map(
            np.shape, (data, counts)
        )
        want, want_counts = whole.gather(r)
        np.testing.assert_array_equal(counts, want_counts)
        for x, y in zip(jax.tree.leaves(data), jax.tree.leaves(want)):
            np.testing.assert_array_equal(x, y[:, :length])
            assert not y[:, length:].any()
        assert cohorts.empty(r)[0]["x"].shape == (3, length, 2)
    assert len(seen) >= 3, seen  # the test's population must give several buckets
    with pytest.raises(fcir.PopulationError, match=r"pass it, specs\(r\)"):
        cohorts.specs()
    with pytest.raises(fcir.PopulationError, match="cohorts.empty"):
        r = next(r for r in range(8) if cohorts.length(r) != 30)
        cohorts.take(*cohorts.indices(r), out=whole.empty())


def test_bad_paddings_are_population_errors(skewed):
    with pytest.raises(fcir.PopulationError, match="Population.from_clients"):
        Population(*padded(skewed_clients())).uniform(3, padding="bucket")
    for bad in ("cohort", [0, 4], [], 4, [2.5]):
        with pytest.raises(fcir.PopulationError, match="padding must be"):
            skewed.poisson(0.1, padding=bad)


def test_bad_populations_are_population_errors():
    with pytest.raises(fcir.PopulationError, match="leading axis"):
        Population({"a": np.zeros((3, 2)), "b": np.zeros((4, 2))})
    with pytest.raises(fcir.PopulationError, match="counts"):
        Population(np.zeros((3, 2)), counts=[1, 2])
    with pytest.raises(fcir.PopulationError, match="k must be"):
        Population(np.zeros((3, 2))).uniform(4)
    with pytest.raises(fcir.PopulationError, match="q must be"):
        Population(np.zeros((3, 2))).poisson(0.0)


def test_a_population_is_read_only_and_what_its_data_were_when_it_was_made(tmp_path):
    """Nothing writes to a population's arrays (the device loop keeps it on the device
    between calls): it copies an array its caller can still write to, and shares one
    that is read-only down to its memory."""
    x = np.arange(12, dtype=np.float32).reshape(4, 3)
    pop = Population({"x": x}, counts=[1, 2, 3, 0])
    x[0] = -1.0  # the caller's own array, not the population's
    np.testing.assert_array_equal(pop.data["x"][0], [0.0, 1.0, 2.0])
    assert not np.shares_memory(pop.data["x"], x)
    frozen = np.arange(12, dtype=np.float32).reshape(4, 3).copy()  # owns its memory
    frozen.flags.writeable = False
    shared = Population((frozen, frozen[:, :2]))
    assert shared.data[0] is frozen and np.shares_memory(shared.data[1], frozen)
    view = x[:, :2]  # read-only, but its base is not: copied
    view.flags.writeable = False
    assert not np.shares_memory(Population(view).data, x)
    np.save(tmp_path / "x.npy", x)
    mapped = np.load(tmp_path / "x.npy", mmap_mode="r")  # a read-only map: shared
    assert np.shares_memory(Population(mapped).data, mapped)
    writable = np.load(tmp_path / "x.npy", mmap_mode="r+")
    assert not np.shares_memory(Population(writable).data, writable)
    ragged = Population.from_clients(ragged_clients(4))
    dense = Population(*padded(ragged_clients(4)))
    for p in (pop, shared, ragged, dense):
        for a in (*jax.tree.leaves(p.data), p.counts, p.offsets, p._rows):
            if a is not None:
                with pytest.raises(ValueError, match="read-only"):
                    a[0] = 0


# -- simulate ---------------------------------------------------------------------------


def by_hand(exe, w, cohorts, first, rounds):
    for r in range(first, first + rounds):
        w = exe(w, *cohorts.gather(r))
    return w


def test_the_host_loop_is_the_round_by_hand_bitwise_and_the_device_loop_agrees(
    population, uniform_exe
):
    cohorts = population.uniform(K, seed=3)
    w0 = jnp.array([0.5, -1.0], jnp.float32)
    want = np.asarray(by_hand(uniform_exe, w0, cohorts, 0, 4))
    host, metrics = xla.simulate(uniform_exe, w0, cohorts, 4, loop="host")
    assert metrics is None
    np.testing.assert_array_equal(np.asarray(host), want)
    device, _ = xla.simulate(uniform_exe, w0, cohorts, 4, loop="device")
    np.testing.assert_allclose(np.asarray(device), want, rtol=1e-6, atol=1e-7)
    # The device loop keeps a ragged population ragged (each member's window of
    # examples, zeroed past its count); over the same clients padded beforehand (dense:
    # whole client slices) it runs the same rounds.
    dense = Population(*padded(ragged_clients())).uniform(K, seed=3)
    for loop in ("host", "device"):
        got, _ = xla.simulate(uniform_exe, w0, dense, 4, loop=loop)
        np.testing.assert_array_equal(
            np.asarray(got), np.asarray(host if loop == "host" else device)
        )
    # A run resumes at any round: the cohorts are a function of (seed, round).
    half, _ = xla.simulate(uniform_exe, w0, cohorts, 2, loop="host")
    rest, _ = xla.simulate(uniform_exe, half, cohorts, 2, first_round=2, loop="host")
    np.testing.assert_array_equal(np.asarray(rest), want)


def test_the_device_loop_runs_every_round_in_one_program_without_the_host(
    population, uniform_exe, monkeypatch
):
    cohorts = population.uniform(K, seed=3)
    want, _ = xla.simulate(uniform_exe, jnp.zeros(2), cohorts, 3, loop="device")

    def host_side(*args):
        raise AssertionError("the device loop gathered or dispatched a round on the host")

    monkeypatch.setattr(Cohorts, "gather", host_side)
    monkeypatch.setattr(type(uniform_exe), "__call__", host_side)
    got, _ = xla.simulate(uniform_exe, jnp.zeros(2), cohorts, 3, loop="device")
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    # One compiled loop over the ragged population, reused (a dense one may be there too).
    (run,) = [v for k, v in xsim._SCANS[uniform_exe].items() if k[2][0] == "ragged"]
    idx, _ = cohorts.plan(0, 3)
    arrays, _, _ = xsim._ragged_layout(population, population.longest)
    text = str(jax.make_jaxpr(run)(jnp.zeros(2), arrays, idx, np.arange(3, dtype=np.int32), None))
    assert text.count(" scan[") == 1 and "length=3" in text


def test_the_device_loop_keeps_one_population_on_the_device_from_call_to_call(
    population, uniform_exe, monkeypatch
):
    """The second call of the device loop on a population puts nothing: its arrays are
    still on the device (and the run is the one a fresh put gives). The host loop
    counts them beside its rounds, or frees them where the rounds do not fit beside
    them; the device loop on another population frees them, as does their population's
    end."""
    w0 = jnp.array([0.5, -1.0], jnp.float32)
    xla.simulate(uniform_exe, w0, population.uniform(K, seed=3), 2, loop="device")
    kept = xsim._RESIDENT[population]

    def layout(*args):
        raise AssertionError("the population was laid out and put on the device again")

    with monkeypatch.context() as m:
        m.setattr(xsim, "_ragged_layout", layout)
        again, _ = xla.simulate(uniform_exe, w0, population.uniform(K, seed=4), 3, loop="device")
    assert xsim._RESIDENT[population] is kept and len(xsim._RESIDENT) == 1
    cohorts = population.uniform(K, seed=4)
    peak = predicted_peak(uniform_exe.compiled(w0, *cohorts.specs()))
    per = xsim._cohort_bytes(uniform_exe, cohorts.specs(), 1)
    here = xsim._resident_bytes()
    assert here == sum(x.nbytes for x in jax.tree.leaves(kept[1][0])) > 0
    xla.simulate(uniform_exe, w0, cohorts, 1, loop="host")  # the rounds fit beside it
    assert xsim._RESIDENT[population] is kept
    exes = {cohorts.lengths[0]: uniform_exe}
    beside = (here - 1) // per  # cohorts ahead once it is freed
    for limit, depth, stays in ((peak + here + per, 2, True),
                                (peak + here - 1, 1 + min(2, beside), False)):  # fmt: skip
        with monkeypatch.context() as m:
            m.setattr(xsim, "_device_limit", lambda exes, limit=limit: limit)
            assert xsim._depth(exes, w0, cohorts, None, 0) == depth
        assert (population in xsim._RESIDENT) == stays
    fresh, _ = xla.simulate(uniform_exe, w0, population.uniform(K, seed=4), 3, loop="device")
    assert xsim._RESIDENT[population] is not kept  # put again, the same run
    np.testing.assert_array_equal(np.asarray(again), np.asarray(fresh))
    other = Population(*padded(ragged_clients()))
    xla.simulate(uniform_exe, w0, other.uniform(K, seed=3), 1, loop="device")
    assert population not in xsim._RESIDENT and other in xsim._RESIDENT
    gone = weakref.ref(xsim._RESIDENT[other][1][0][1])  # its counts, on the device
    del other
    gc.collect()
    assert len(xsim._RESIDENT) == 0 and gone() is None


def test_counts_weight_unequal_clients_and_padding_members_count_nothing(population):
    """One round from w=0 with step 0.5 moves w by half the cohort's count-weighted mean
    of client means, i.e. half the mean over all of the cohort's real examples."""
    cohorts = population.poisson(Q, seed=5)
    step = make_round(cohorts.size, metrics=True)
    idx, valid = cohorts.plan(0, 3)
    assert (~valid).any(), "the test needs padding members"
    real = idx[0][valid[0]]
    rows = np.concatenate([population.client(i)["x"] for i in real])
    for loop in ("host", "device"):
        _, (totals, sums) = xla.simulate(step, jnp.zeros(2), cohorts, 3, loop=loop)
        want = [population.counts[i[v]].sum() for i, v in zip(idx, valid)]
        np.testing.assert_allclose(np.asarray(totals), want)
        want = [sum(population.client(j)["x"].sum() for j in i[v]) for i, v in zip(idx, valid)]
        np.testing.assert_allclose(np.asarray(sums), want, rtol=1e-5, atol=1e-5)
        first, _ = xla.simulate(step, jnp.zeros(2), cohorts, 1, loop=loop)
        np.testing.assert_allclose(np.asarray(first), 0.5 * rows.mean(0), rtol=1e-5)


def test_keyed_rounds_get_the_round_number_folded_into_the_key(population):
    cohorts = population.poisson(Q, seed=2)

    @fcir.program(placements={"clients": cohorts.size}, private=True)
    def dp_round(w, data, counts, key):
        deltas = fcir.map_fn(client_mean, (fcir.broadcast(w), data, counts))
        return w + fcir.dp_sum(deltas, 1.0, 0.5, key) / (Q * N)

    key = jax.random.key(9)
    module = fcir.capture(dp_round, jnp.zeros(2), *cohorts.gather(0), key)
    exe = xla.compile(module)
    w = jnp.zeros(2)
    for r in range(3, 6):
        w = exe(w, *cohorts.gather(r), jax.random.fold_in(key, r))
    for loop in ("host", "device"):
        got, _ = xla.simulate(exe, jnp.zeros(2), cohorts, 3, key=key, first_round=3, loop=loop)
        np.testing.assert_allclose(np.asarray(got), np.asarray(w), rtol=1e-6, atol=1e-7)


def test_metrics_are_stacked_per_round_and_streaming_runs_the_same_cohorts(population):
    cohorts = population.uniform(K, seed=0)
    step = make_round(K, metrics=True)
    w, (totals, _) = xla.simulate(step, jnp.zeros(2), cohorts, 3, loop="host")
    assert totals.shape == (3,)
    streamed, (totals2, _) = xla.simulate(step, jnp.zeros(2), cohorts, 3, clients_per_step=2)
    np.testing.assert_array_equal(np.asarray(totals2), np.asarray(totals))
    np.testing.assert_allclose(np.asarray(streamed), np.asarray(w), rtol=1e-6)


def _logged_run(population, exe, monkeypatch):
    """Six rounds of the host loop with what each thread does logged: the main thread's
    events, the feed thread's, the most cohorts that existed at once, the host arrays
    used; and the result."""
    events, lock = [], threading.Lock()
    take, call, block = Cohorts.take, type(exe).__call__, jax.block_until_ready
    live = {"now": 0, "most": 0}
    host_arrays = set()

    def log(*e):
        with lock:
            events.append((threading.current_thread() is threading.main_thread(), *e))

    def take_logged(self, idx, valid, out=None):
        if out is None:  # by_hand's gather
            return take(self, idx, valid)
        live["now"] += 1
        live["most"] = max(live["most"], live["now"])
        host_arrays.add(id(jax.tree.leaves(out)[0]))
        log("gather")
        return take(self, idx, valid, out=out)

    def done(self, _release=xsim._Feed.done):
        live["now"] -= 1
        _release(self)

    monkeypatch.setattr(Cohorts, "take", take_logged)
    monkeypatch.setattr(xsim._Feed, "done", done)
    monkeypatch.setattr(type(exe), "__call__", lambda self, *a: log("dispatch") or call(self, *a))
    monkeypatch.setattr(xsim.jax, "block_until_ready", lambda x: log("wait") or block(x))
    cohorts = population.uniform(K, seed=3)
    w, _ = xla.simulate(exe, jnp.zeros(2), cohorts, 6, loop="host",
                        callback=lambda r, w, m: log("done", r))  # fmt: skip
    monkeypatch.undo()
    np.testing.assert_array_equal(
        np.asarray(w), np.asarray(by_hand(exe, jnp.zeros(2), cohorts, 0, 6))
    )
    main = [e[1:] for e in events if e[0]]
    fed = [e[1:] for e in events if not e[0]]
    return main, fed, live["most"], len(host_arrays)


QUEUED = [("dispatch",), ("dispatch",), ("wait",), ("done", 0),
          ("dispatch",), ("wait",), ("done", 1), ("dispatch",), ("wait",), ("done", 2),
          ("dispatch",), ("wait",), ("done", 3), ("dispatch",), ("wait",), ("done", 4),
          ("wait",), ("done", 5)]  # fmt: skip


def test_cohorts_are_put_ahead_by_a_thread_and_rounds_queue_behind_the_device(
    population, uniform_exe, monkeypatch
):
    """The next cohorts are gathered and put by the feed thread while rounds run; a
    round is dispatched before the one ahead of it has finished, and is waited for
    (then its callback runs) one dispatch later; never more than DEPTH cohorts exist,
    whose host arrays are reused in turn."""
    main, fed, most, arrays = _logged_run(population, uniform_exe, monkeypatch)
    assert main == QUEUED
    assert fed == [("gather",)] * 6
    assert most <= xsim.DEPTH and arrays <= xsim.DEPTH < 6


@pytest.mark.parametrize("ahead", [1, 0])
def test_the_cohorts_ahead_are_as_many_as_the_device_memory_holds_beside_the_round(
    population, uniform_exe, monkeypatch, ahead
):
    """Where the device's memory holds the round's peak and ``ahead`` cohorts more, at
    most ``1 + ahead`` cohorts exist; with none ahead, each round is waited for before
    the next cohort is put (and the next round dispatched)."""
    cohorts = population.uniform(K, seed=3)
    specs = cohorts.specs()
    peak = predicted_peak(uniform_exe.compiled(jnp.zeros(2), *specs))
    per = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(specs))
    assert xsim._cohort_bytes(uniform_exe, specs, 1) == per
    monkeypatch.setattr(xsim, "_device_limit", lambda exes: peak + ahead * per + per // 2)
    main, fed, most, arrays = _logged_run(population, uniform_exe, monkeypatch)
    assert most <= 1 + ahead and arrays == 1 + ahead
    if ahead:
        assert main == QUEUED
    else:
        assert main == [e for r in range(6) for e in [("dispatch",), ("wait",), ("done", r)]]
    assert fed == [("gather",)] * 6


def test_an_error_in_the_feed_or_a_callback_ends_the_run_and_its_thread(population, uniform_exe):
    cohorts = population.uniform(K, seed=3)

    def stop(r, w, m):
        if r == 1:
            raise KeyboardInterrupt("stop")

    before = threading.active_count()
    with pytest.raises(KeyboardInterrupt):
        xla.simulate(uniform_exe, jnp.zeros(2), cohorts, 5, loop="host", callback=stop)
    poisson = population.poisson(0.9, seed=0, max_size=3)  # rounds over 3 members raise
    module = fcir.capture(make_round(3), jnp.zeros(2), *population.uniform(3).gather(0))
    with pytest.raises(fcir.PopulationError, match="more than the cohort's fixed size"):
        xla.simulate(module, jnp.zeros(2), poisson, 2, loop="host")
    assert threading.active_count() == before


def test_auto_keeps_a_population_over_the_budget_beside_the_round_or_on_a_cpu_on_the_host(
    population, uniform_exe, monkeypatch
):
    cohorts = population.uniform(K, seed=3)
    loops = []
    monkeypatch.setattr(xsim, "_device_loop", lambda *a: loops.append("device") or (None, None))
    monkeypatch.setattr(xsim, "_host_loop", lambda *a: loops.append("host") or (None, None))
    monkeypatch.setattr(xsim, "_on_accelerator", lambda: True)
    xla.simulate(uniform_exe, jnp.zeros(2), cohorts, 1)
    monkeypatch.setattr(xsim, "device_budget", lambda: population.nbytes - 1)
    xla.simulate(uniform_exe, jnp.zeros(2), cohorts, 1)
    # Within the budget, but not beside the round's peak: a round that fills the memory.
    monkeypatch.setattr(xsim, "device_budget", lambda: population.nbytes)
    peak = predicted_peak(uniform_exe.compiled(jnp.zeros(2), *cohorts.specs()))
    monkeypatch.setattr(xsim, "_device_limit", lambda exes: peak + population.nbytes)
    xla.simulate(uniform_exe, jnp.zeros(2), cohorts, 1)
    monkeypatch.setattr(xsim, "_device_limit", lambda exes: peak + population.nbytes - 1)
    xla.simulate(uniform_exe, jnp.zeros(2), cohorts, 1)
    monkeypatch.setattr(xsim, "_on_accelerator", lambda: False)
    xla.simulate(uniform_exe, jnp.zeros(2), cohorts, 1)
    assert loops == ["device", "host", "device", "host", "host"]


def test_a_round_for_another_cohort_size_or_a_callback_on_the_device_is_refused(population):
    cohorts = population.uniform(K, seed=0)
    with pytest.raises(fcir.PopulationError, match="cohort is one placement of 5"):
        module = fcir.capture(make_round(K + 1), jnp.zeros(2), *population.uniform(K + 1).gather(0))
        xla.simulate(module, jnp.zeros(2), cohorts, 1)
    with pytest.raises(fcir.PopulationError, match="callback"):
        xla.simulate(make_round(K), jnp.zeros(2), cohorts, 1, loop="device", callback=print)


def test_simulate_compiles_a_round_once_per_bucket_and_runs_the_rounds_by_hand(skewed, monkeypatch):
    """A round given as a function over bucketed cohorts: captured and compiled once per
    example length that occurs (kept for the next call, not keeping the function
    alive), each round run by the executable of its length, bitwise as by hand; to
    float rounding what padding to the population's longest gives."""
    cohorts = skewed.poisson(0.15, seed=0, padding="bucket")
    step = make_round(cohorts.size, metrics=True)
    captures = []
    capture = xsim.capture
    monkeypatch.setattr(xsim, "capture", lambda *a: captures.append(1) or capture(*a))
    w0 = jnp.array([0.5, -1.0], jnp.float32)
    w, (totals, _) = xla.simulate(step, w0, cohorts, 6)  # "auto": the host loop
    lengths = [cohorts.length(r) for r in range(6)]
    assert len(set(lengths)) >= 3 and len(captures) == len(set(lengths)), lengths
    by_length = {}
    want = w0
    for r in range(6):
        if lengths[r] not in by_length:
            module = fcir.capture(step, w0, *cohorts.specs(r))
            by_length[lengths[r]] = xla.compile(module)
        want, (total, _) = by_length[lengths[r]](want, *cohorts.gather(r))
        assert total == totals[r]
    np.testing.assert_array_equal(np.asarray(w), np.asarray(want))
    whole, _ = xla.simulate(step, w0, skewed.poisson(0.15, seed=0), 6, loop="host")
    np.testing.assert_allclose(np.asarray(w), np.asarray(whole), rtol=1e-6, atol=1e-7)
    # A second run compiles nothing new.
    again, _ = xla.simulate(step, w0, cohorts, 6, loop="host")
    np.testing.assert_array_equal(np.asarray(again), np.asarray(w))
    assert len(captures) == len(set(lengths)) + 1  # + the population-padded run's
    gone = weakref.ref(step)
    del step
    gc.collect()
    assert gone() is None


def test_the_feeds_host_arrays_are_one_buffer_per_leaf_viewed_at_each_length(skewed):
    cohorts = skewed.uniform(3, padding="bucket")
    arrays = xsim._HostArrays(cohorts)
    eight = arrays.arrays(8)
    assert eight[0]["x"].shape == (3, 8, 2) and eight[1].shape == (3,)
    assert arrays.arrays(8) is eight  # one length: the very same arrays
    four = arrays.arrays(4)
    assert four[0]["x"].shape == (3, 4, 2) and np.shares_memory(four[0]["x"], eight[0]["x"])
    assert four[0]["x"].flags.c_contiguous  # a view of the buffer's start, not a slice
    thirty = arrays.arrays(30)  # grown
    assert not np.shares_memory(thirty[0]["x"], eight[0]["x"])
    assert np.shares_memory(arrays.arrays(8)[0]["y"], thirty[0]["y"])


def test_bucketed_cohorts_refuse_one_shape_rounds_and_the_device_loop(skewed, monkeypatch):
    cohorts = skewed.uniform(3, seed=0, padding="bucket")
    step = make_round(3)
    module = fcir.capture(step, jnp.zeros(2), *cohorts.specs(0))
    for fixed in (module, xla.compile(module)):
        with pytest.raises(fcir.PopulationError, match="pass the @fcir.program function"):
            xla.simulate(fixed, jnp.zeros(2), cohorts, 2)
    with pytest.raises(fcir.PopulationError, match="loop='host'"):
        xla.simulate(step, jnp.zeros(2), cohorts, 2, loop="device")

    @fcir.program(placements={"clients": 3})
    def per_example(w, data, counts):  # metrics as long as the examples
        return w, fcir.reduce_sum(fcir.map_fn(lambda d: d["x"][:, 0], data))

    with pytest.raises(fcir.PopulationError, match="metrics differ between"):
        xla.simulate(per_example, jnp.zeros(2), cohorts, 4)
    loops = []
    monkeypatch.setattr(xsim, "_device_loop", lambda *a: loops.append("device") or (None, None))
    monkeypatch.setattr(xsim, "_host_loop", lambda *a: loops.append("host") or (None, None))
    monkeypatch.setattr(xsim, "_on_accelerator", lambda: True)  # where auto may pick the device
    xla.simulate(step, jnp.zeros(2), cohorts, 1)
    xla.simulate(step, jnp.zeros(2), skewed.uniform(3, seed=0), 1)
    assert loops == ["host", "device"]


# -- the accountant ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def private_module():
    @fcir.program(placements={"clients": 4}, private=True)
    def dp_round(w, x, key):
        return fcir.dp_mean(fcir.map_fn(lambda w, x: x - w, (fcir.broadcast(w), x)), 1.0, 2.0, key)

    return fcir.capture(dp_round, jnp.zeros(2), jnp.zeros((4, 2)), jax.random.key(0))


def test_the_accountant_takes_poisson_cohorts_at_q(population, private_module):
    cohorts = population.poisson(Q, seed=0)
    eps = cohorts.epsilon(private_module, 10, 1e-5)
    assert eps == fcir.privacy.epsilon(private_module, 10, 1e-5, sampling_rate=Q)
    assert eps < fcir.privacy.epsilon(private_module, 10, 1e-5) / 2  # amplified
    budget = cohorts.budget(private_module, 1e-5, 100.0)
    assert budget.sampling_rate == Q and budget.spend(10) == pytest.approx(eps)


def test_uniform_cohorts_are_accounted_only_as_an_acknowledged_approximation(
    population, private_module
):
    cohorts = population.uniform(K, seed=0)
    with pytest.raises(fcir.PrivacyError, match="approximate=True"):
        cohorts.epsilon(private_module, 10, 1e-5)
    eps = cohorts.epsilon(private_module, 10, 1e-5, approximate=True)
    assert eps == fcir.privacy.epsilon(private_module, 10, 1e-5, sampling_rate=K / N)


# -- the modules' own examples ----------------------------------------------------------


@pytest.mark.parametrize("module", [fcir.population, xsim], ids=["population", "simulate"])
def test_the_docstring_examples_run(module):
    (code,) = re.findall(r"^```python\n(.*?)^```", module.__doc__, re.S | re.M)
    exec(compile(code, f"{module.__name__} docstring", "exec"), {"__name__": "__doc__"})
