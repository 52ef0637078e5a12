"""run_bundle compiles each part once and calls the compiled function per client."""

from __future__ import annotations

import jax
import numpy as np
from fcir.interpreters import production
from productionlib import cases


def _count_traces(monkeypatch) -> list:
    """Counts calls of ``Exported.call`` in Python: once per trace under jax.jit, once
    per call when run eagerly."""
    calls = []
    original = jax.export.Exported.call

    def counting(self, *args, **kwargs):
        calls.append(self.fun_name)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(jax.export.Exported, "call", counting)
    return calls


def test_run_bundle_traces_each_part_once_not_once_per_client(monkeypatch):
    name = "own:fedavg_pytree"
    path = cases.bundle(name)
    calls = _count_traces(monkeypatch)
    bundle = production.Bundle(path)
    _, args = cases.fn_and_args(name)
    leaves = jax.tree_util.tree_leaves(args)
    first = bundle.run_flat(leaves)
    parts_run = sum(1 for p in production.PARTS if bundle.manifest["parts"][p]["results"])
    # client_work runs for 4 clients; eagerly that would be 4 calls of its Exported.
    assert cases.rounds.CLIENTS > 1
    assert len(calls) == parts_run
    again = bundle.run_flat(leaves)  # a second run of the same bundle reuses the compiles
    assert len(calls) == parts_run
    for a, b in zip(first, again):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_run_bundle_results_match_eager_exported_calls(monkeypatch):
    """The compiled parts give bit for bit what calling each Exported eagerly gave."""
    name = "own:weighted"
    path = cases.bundle(name)
    _, args = cases.fn_and_args(name)
    leaves = jax.tree_util.tree_leaves(args)
    jitted = production.Bundle(path).run_flat(leaves)
    eager = production.Bundle(path)
    monkeypatch.setattr(eager, "compiled", lambda part: eager.artifact(part).call)
    for a, b in zip(jitted, eager.run_flat(leaves)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
