"""fcir.learning's rounds on the XLA backend: every algorithm's round compiled with its
members streamed (``clients_per_step=3``) equals
``reference.run``; ``xla.simulate`` runs the rounds over a Population's cohorts (counts
as the rounds' weights and masks, a DP key per round, SCAFFOLD's controls kept by
member); and the rounds run on an 8-device mesh as without one (a child process)."""

from __future__ import annotations

import pathlib

import jax
import numpy as np
import pytest
from corpus.compare import assert_trees_match
from eight_devices import Child
from fcir.interpreters import reference, xla
from learning_cases import ALGORITHMS, COUNTS, N, init, make_data, round_args

import fcir

HERE = pathlib.Path(__file__).resolve()
EIGHT_DEVICES = Child(HERE, "FCIR_XLA_LEARNING_TESTS", "-k", "8_device_mesh")
on_8_devices = EIGHT_DEVICES.on_8_devices
test_on_8_simulated_devices = EIGHT_DEVICES.waiting_test()

# The DP rounds run on XLA in test_simulate_trains_a_private_round_over_poisson_cohorts
# (dp, dp_adaptive) and test_ddp_round_runs_streamed (ddp): their releases' numbers on
# every backend are tests/privacy/'s.
PLAIN = sorted(set(ALGORITHMS) - {"dp", "dp_adaptive", "ddp"})


@pytest.mark.parametrize("name", PLAIN)
def test_every_algorithm_compiled_and_streamed_equals_the_reference(name):
    algo = ALGORITHMS[name]()
    args = round_args(algo, init(algo), make_data(), COUNTS)
    module = fcir.capture(algo.round(clients=N), *args)
    step = xla.compile(module, clients_per_step=3)
    state, want = args[0], args[0]
    for _ in range(2):
        state, metrics = step(state, *args[1:])
        want, want_metrics = reference.run(module, want, *args[1:])
    assert_trees_match(
        jax.tree.leaves((state, metrics)), jax.tree.leaves((want, want_metrics)),
        rtol=1e-5, atol=1e-6,
    )  # fmt: skip


def test_ddp_round_runs_streamed_and_is_private():
    algo = ALGORITHMS["ddp"]()
    args = round_args(algo, init(algo), make_data(), COUNTS)
    module = fcir.capture(algo.round(clients=N), *args)
    state, metrics = xla.compile(module, clients_per_step=3)(*args)
    assert module.private and metrics == {}
    moved = [np.max(np.abs(a - b)) for a, b in zip(jax.tree.leaves(state["params"]),
                                                   jax.tree.leaves(args[0]["params"]))]  # fmt: skip
    assert all(np.isfinite(m) and m > 0 for m in moved)


def population(n_clients: int = 12, seed: int = 0) -> fcir.Population:
    """Clients of 1 to 3 local steps (padded to 3, counts the real ones)."""
    rng = np.random.default_rng(seed)
    data = make_data(n_clients, steps=3, seed=seed)
    clients = [jax.tree.map(lambda x, i=i, s=s: x[i, :s], data)
               for i, s in enumerate(rng.integers(1, 4, n_clients))]  # fmt: skip
    return fcir.Population.from_clients(clients)


def test_simulate_runs_fedadam_as_its_rounds_by_hand_on_the_same_cohorts():
    pop = population()
    cohorts = pop.uniform(4, seed=1)
    algo = ALGORITHMS["fedadam"]()
    state = init(algo)
    module = fcir.capture(algo.round(clients=4), state, *cohorts.specs())
    exe = xla.compile(module)
    got, metrics = xla.simulate(exe, state, cohorts, rounds=3, loop="host")
    want = state
    for r in range(3):
        want, _ = exe(want, *cohorts.gather(r))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(a, b)
    assert metrics["loss"].shape == (3,) and int(got["round"]) == 3


def test_simulate_trains_a_private_round_over_poisson_cohorts_with_a_key_per_round():
    """dp_adaptive over Poisson cohorts (padding members count 0), a key folded per
    round by simulate and again by the round; ε at the cohorts' rate."""
    pop = population(40)
    cohorts = pop.poisson(0.2, seed=0)
    algo = ALGORITHMS["dp_adaptive"]()
    state = init(algo)
    key = jax.random.key_data(jax.random.key(3))
    module = fcir.capture(algo.round(clients=cohorts.size), state, *cohorts.specs(), key)
    got, metrics = xla.simulate(module, state, cohorts, rounds=3, key=key, loop="host")
    assert int(got["round"]) == 3 and metrics["clip"].shape == (3,)
    assert np.all(np.isfinite(jax.tree.leaves(got["params"])[0]))
    assert cohorts.epsilon(module, 3, 1e-5) < fcir.privacy.epsilon(module, 3, 1e-5)


def test_simulate_keeps_scaffold_s_controls_by_member_when_the_cohort_is_everyone():
    """population.uniform(N): every round the same clients in the same order, so
    member i's control in the state is client i's, and the run is the rounds by hand."""
    pop = population(5)
    cohorts = pop.uniform(5, seed=0)
    algo = ALGORITHMS["scaffold"]()
    state = init(algo, n=5)
    got, _ = xla.simulate(algo.round(clients=5), state, cohorts, rounds=2, loop="device")
    step = jax.jit(algo.round(clients=5))
    want = state
    for r in range(2):
        data, counts = cohorts.gather(r)
        want, _ = step(want, data, counts)
    assert_trees_match(jax.tree.leaves(got), jax.tree.leaves(want), rtol=1e-6, atol=1e-7)
    assert np.max(np.abs(got["client_controls"]["w"])) > 0


# --- an 8-device mesh (child process) -----------------------------------------------------

MESHED = ["fedadam", "scaffold", "median"]  # a server optimizer, client state, an order statistic


@on_8_devices
@pytest.mark.parametrize("name", MESHED)
def test_rounds_on_an_8_device_mesh_equal_the_unmeshed_round(name):
    """8 members over 8 devices (jax.make_mesh's default axis types), streamed 2 at a
    time per device: the round's state is the unmeshed round's."""
    algo = ALGORITHMS[name]()
    data = jax.tree.map(lambda x: np.concatenate([x, x[:1]]), make_data())
    counts = np.concatenate([COUNTS, COUNTS[:1]])
    args = round_args(algo, init(algo, n=8), data, counts, n=8)
    module = fcir.capture(algo.round(clients=8), *args)
    mesh = jax.make_mesh((8,), ("clients",))
    meshed = xla.compile(module, mesh=mesh, clients_per_step=2)(*args)
    plain = xla.compile(module)(*args)
    assert_trees_match(jax.tree.leaves(meshed), jax.tree.leaves(plain), rtol=1e-5, atol=1e-6)
