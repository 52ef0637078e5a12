"""Populations and cohorts (fcir/population.py) and ``xla.simulate``
(fcir/interpreters/xla/simulation.py): the sampling is what it declares and
reproducible, a simulated run is the round run by hand on the same cohorts, padding is
masked by the counts, the next cohort is put while the round runs, and the accountant
takes the sampling rate."""

from __future__ import annotations

import math
import re
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fcir.interpreters import xla
from fcir.interpreters.xla import simulation as xsim

import fcir
from fcir.population import Cohorts, Population

N = 30  # clients
K = 5  # uniform cohort size
Q = 0.2  # Poisson rate


def ragged_clients(n=N, seed=0):
    """``n`` clients with 1..6 examples of (x f32[., 2], y i32[.])."""
    rng = np.random.default_rng(seed)
    return [
        {"x": rng.normal(size=(m, 2)).astype(np.float32), "y": rng.integers(0, 9, m).astype(np.int32)}
        for m in rng.integers(1, 7, n)
    ]


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
    np.testing.assert_array_equal(cohorts.indices(7)[0], population.uniform(K, seed=1).indices(7)[0])
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


def test_from_clients_pads_with_zeros_and_gather_masks_padding_members():
    clients = ragged_clients(4)
    pop = Population.from_clients(clients)
    longest = max(len(c["y"]) for c in clients)
    assert pop.data["x"].shape == (4, longest, 2)
    np.testing.assert_array_equal(pop.counts, [len(c["y"]) for c in clients])
    for i, c in enumerate(clients):
        m = len(c["y"])
        np.testing.assert_array_equal(pop.data["x"][i, :m], c["x"])
        assert not pop.data["x"][i, m:].any() and not pop.data["y"][i, m:].any()
    cohorts = pop.poisson(0.5, seed=4, max_size=4)
    idx, valid = cohorts.indices(0)
    data, counts = cohorts.gather(0)
    np.testing.assert_array_equal(data["x"][valid], pop.data["x"][idx[valid]])
    assert not data["x"][~valid].any() and not counts[~valid].any()


def test_bad_populations_are_population_errors():
    with pytest.raises(fcir.PopulationError, match="leading axis"):
        Population({"a": np.zeros((3, 2)), "b": np.zeros((4, 2))})
    with pytest.raises(fcir.PopulationError, match="counts"):
        Population(np.zeros((3, 2)), counts=[1, 2])
    with pytest.raises(fcir.PopulationError, match="k must be"):
        Population(np.zeros((3, 2))).uniform(4)
    with pytest.raises(fcir.PopulationError, match="q must be"):
        Population(np.zeros((3, 2))).poisson(0.0)


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
    (run,) = xsim._SCANS[uniform_exe].values()  # one compiled loop, reused
    idx, _ = cohorts.plan(0, 3)
    slabs = [xsim._slab(x) for x in jax.tree.leaves(population.data)]
    text = str(jax.make_jaxpr(run)(jnp.zeros(2), slabs, population.counts, idx,
                                   np.arange(3, dtype=np.int32), None))  # fmt: skip
    assert text.count(" scan[") == 1 and "length=3" in text


def test_counts_weight_unequal_clients_and_padding_members_count_nothing(population):
    """One round from w=0 with step 0.5 moves w by half the cohort's count-weighted mean
    of client means, i.e. half the mean over all of the cohort's real examples."""
    cohorts = population.poisson(Q, seed=5)
    step = make_round(cohorts.size, metrics=True)
    idx, valid = cohorts.plan(0, 3)
    assert (~valid).any(), "the test needs padding members"
    real = idx[0][valid[0]]
    rows = np.concatenate([population.data["x"][i, : int(population.counts[i])] for i in real])
    for loop in ("host", "device"):
        _, (totals, sums) = xla.simulate(step, jnp.zeros(2), cohorts, 3, loop=loop)
        want = [population.counts[i[v]].sum() for i, v in zip(idx, valid)]
        np.testing.assert_allclose(np.asarray(totals), want)
        want = [population.data["x"][i[v]].sum() for i, v in zip(idx, valid)]
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


def test_cohorts_are_put_ahead_by_a_thread_and_rounds_queue_behind_the_device(
    population, uniform_exe, monkeypatch
):
    """The next cohorts are gathered and put by the feed thread while rounds run; a
    round is dispatched before the one ahead of it has finished, and is waited for
    (then its callback runs) one dispatch later; never more than DEPTH cohorts exist,
    whose host arrays are reused in turn."""
    events, lock = [], threading.Lock()
    take, call, block = Cohorts.take, type(uniform_exe).__call__, jax.block_until_ready
    live = {"now": 0, "most": 0}
    host_arrays = set()

    def log(*e):
        with lock:
            events.append((threading.current_thread() is threading.main_thread(), *e))

    def take_logged(self, idx, valid, out=None):
        if out is None:  # by_hand's gather, below
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
    monkeypatch.setattr(type(uniform_exe), "__call__", lambda self, *a: log("dispatch") or call(self, *a))
    monkeypatch.setattr(xsim.jax, "block_until_ready", lambda x: log("wait") or block(x))
    cohorts = population.uniform(K, seed=3)
    w, _ = xla.simulate(uniform_exe, jnp.zeros(2), cohorts, 6, loop="host",
                        callback=lambda r, w, m: log("done", r))  # fmt: skip
    main = [e[1:] for e in events if e[0]]
    assert main == [("dispatch",), ("dispatch",), ("wait",), ("done", 0),
                    ("dispatch",), ("wait",), ("done", 1), ("dispatch",), ("wait",), ("done", 2),
                    ("dispatch",), ("wait",), ("done", 3), ("dispatch",), ("wait",), ("done", 4),
                    ("wait",), ("done", 5)]  # fmt: skip
    assert all(e[1:] == ("gather",) for e in events if not e[0])
    assert sum(1 for e in events if not e[0]) == 6
    assert live["most"] <= xsim.DEPTH and len(host_arrays) <= xsim.DEPTH < 6
    np.testing.assert_array_equal(np.asarray(w), np.asarray(by_hand(uniform_exe, jnp.zeros(2), cohorts, 0, 6)))


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


def test_auto_keeps_a_population_over_the_device_budget_on_the_host(
    population, uniform_exe, monkeypatch
):
    cohorts = population.uniform(K, seed=3)
    loops = []
    monkeypatch.setattr(xsim, "_device_loop", lambda *a: loops.append("device") or (None, None))
    monkeypatch.setattr(xsim, "_host_loop", lambda *a: loops.append("host") or (None, None))
    xla.simulate(uniform_exe, jnp.zeros(2), cohorts, 1)
    monkeypatch.setattr(xsim, "device_budget", lambda: population.nbytes - 1)
    xla.simulate(uniform_exe, jnp.zeros(2), cohorts, 1)
    assert loops == ["device", "host"]


def test_a_round_for_another_cohort_size_or_a_callback_on_the_device_is_refused(population):
    cohorts = population.uniform(K, seed=0)
    with pytest.raises(fcir.PopulationError, match="cohort is one placement of 5"):
        module = fcir.capture(make_round(K + 1), jnp.zeros(2), *population.uniform(K + 1).gather(0))
        xla.simulate(module, jnp.zeros(2), cohorts, 1)
    with pytest.raises(fcir.PopulationError, match="callback"):
        xla.simulate(make_round(K), jnp.zeros(2), cohorts, 1, loop="device", callback=print)


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
