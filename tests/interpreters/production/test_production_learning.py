"""fcir.learning's rounds exported to production: every round of one exchange exports
(a DP round's key as raw key data), and the bundles of a server optimizer's round, of
q-FedAvg's sums and of a median run as ``reference.run``; SCAFFOLD's round, which
returns the clients' controls at the clients, is refused, saying so (its training loop
exports to Flower instead, with the controls kept on the nodes)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from corpus.compare import assert_trees_match
from fcir.interpreters import production, reference
from learning_cases import ALGORITHMS, COUNTS, N, init, make_data, round_args

import fcir


def _captured(name):
    algo = ALGORITHMS[name]()
    args = round_args(algo, init(algo), make_data(), COUNTS)
    return args, fcir.capture(algo.round(clients=N), *args)


def test_every_round_of_one_exchange_exports():
    for name in sorted(set(ALGORITHMS) - {"scaffold"}):
        _, module = _captured(name)
        plan = production.export(module)
        assert plan.to_computation_bytes(), name


@pytest.mark.parametrize("name", ["fedadam", "qfedavg", "median"])
def test_bundles_run_as_the_reference(name, tmp_path):
    args, module = _captured(name)
    production.export(module).write(tmp_path / "bundle")
    got = production.run_bundle(tmp_path / "bundle", *args)
    want = reference.run(module, *args)
    assert_trees_match(jax.tree.leaves(got), [np.asarray(x) for x in jax.tree.leaves(want)],
                       rtol=1e-5, atol=1e-6)  # fmt: skip


def test_scaffold_s_round_is_refused_naming_the_controls_it_returns_at_the_clients():
    _, module = _captured("scaffold")
    with pytest.raises(fcir.ExportError) as info:
        production.export(module)
    message = str(info.value)
    assert "@scaffold_round is not exportable" in message
    assert "round result placed at the clients" in message
    assert "a round returns server values only" in message
