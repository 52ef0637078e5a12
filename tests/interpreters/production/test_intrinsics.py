"""The TFF intrinsics are one table (interpreters/production/intrinsics.py): every other
module names them through it, everything production's split lowers to is in it, each
aggregate's federated_aggregate lowering computes what its server function computes,
and Flower's app aggregates are read from it and from production's rules."""

from __future__ import annotations

import ast
import pathlib

import numpy as np
import pytest
from fcir.interpreters.flower import phases
from fcir.interpreters.production import intrinsics as I
from fcir.interpreters.production import splitting

from fcir import fed as F

ROOT = pathlib.Path(__file__).resolve().parents[3]


def spelled_names(source: str) -> set[str]:
    """The intrinsic names ``source`` writes as a string of its own (a value it passes,
    compares or keys by, not words in a docstring, comment or message)."""
    tree = ast.parse(source)
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
    }
    return {
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and node.value in I.INTRINSICS
        and id(node) not in docstrings
    }


def test_the_reader_finds_names_used_as_values_only():
    source = (
        '"""federated_sum, in a docstring."""\n'
        'X = "federated_mean"  # federated_max in a comment\n'
        'if uri == "federated_min": raise ValueError("not federated_sum here")\n'
    )
    assert spelled_names(source) == {"federated_mean", "federated_min"}


def test_only_the_table_spells_an_intrinsic_name():
    spelling = {
        str(path.relative_to(ROOT))
        for folder in ("fcir", "interpreters", "checkpoint")
        for path in (ROOT / folder).rglob("*.py")
        if spelled_names(path.read_text())
    }
    assert spelling == {"interpreters/production/intrinsics.py"}, spelling


def test_every_intrinsic_the_split_lowers_to_is_in_the_table_with_its_meaning():
    used = {r.intrinsic for r in splitting.OP_RULES.values() if isinstance(r, splitting.Rule)}
    assert used <= set(I.INTRINSICS), used - set(I.INTRINSICS)
    assert all(i.meaning for i in I.INTRINSICS.values())
    assert I.AGGREGATE in used  # the ops with no intrinsic of their own


@pytest.mark.parametrize("name", [n for n, i in I.INTRINSICS.items() if i.lowering])
def test_a_lowering_computes_what_the_server_computes(name):
    """zero, then accumulate over two groups of clients, merge, report: the aggregate of
    every client, as ``server`` computes it over the values stacked."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(5, 3)).astype(np.float32)
    w = rng.uniform(0.5, 2.0, size=(5,)).astype(np.float32)
    low = I.INTRINSICS[name].lowering((3,), np.dtype(np.float32))
    inputs = [(x[i], w[i]) if len(low.inputs) == 2 else (x[i],) for i in range(5)]
    halves = []
    for group in (inputs[:2], inputs[2:]):
        u = low.zero()
        for t in group:
            u = low.accumulate(*u, *t)
        halves.append(u)
    (got,) = low.report(*low.merge(*halves[0], *halves[1]))
    want = I.INTRINSICS[name].server(x, w, bitwidth=None, attrs=())
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6)
    assert [tuple(np.shape(v)) for v in low.zero()] == [tuple(s) for s, _ in low.state_types]


def test_flower_computes_every_aggregate_production_lowers_to_an_intrinsic_with_a_server():
    for cls, rule in splitting.OP_RULES.items():
        if isinstance(rule, splitting.Aggregate) and rule.intrinsic in I.aggregates():
            assert isinstance(phases.RULES[cls], phases.AppAggregate), cls.name
    assert isinstance(phases.RULES[F.Median], phases.GatheredAggregate)
