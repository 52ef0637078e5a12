"""Rounds the production tests run, captured and exported once per test session.

Corpus cases marked ``exportable`` and the rounds of ``rounds.py`` must export; the
corpus cases that are not (and ``rounds.REJECTED``) must not.
"""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile

import jax
import pytest
from corpus import CASES, case
from corpus.compare import assert_leaf_matches
from fcir.interpreters import production, reference

import fcir

from . import rounds

# Corpus cases marked exportable that the export rejects anyway, with the reason.
# client_rng takes one PRNG key per client as an argument: keys have no
# federated_language dtype (the "unsupported dtypes").
KNOWN_REJECTED = {"client_rng": "unsupported dtype", "scan_rounds": "federated op under control flow"}
CORPUS_EXPORTABLE = tuple(c.name for c in CASES if c.exportable and c.name not in KNOWN_REJECTED)
CORPUS_REJECTED = tuple(c.name for c in CASES if not c.exportable or c.name in KNOWN_REJECTED)
OWN = tuple(rounds.ROUNDS)
ALL = tuple(f"corpus:{n}" for n in CORPUS_EXPORTABLE) + tuple(f"own:{n}" for n in OWN)
# Compiling its client work takes ~20 s on a CPU; the bundle tests still run it.
SLOW = frozenset({"corpus:fedavg_transformer"})


def fn_and_args(name: str):
    kind, _, short = name.partition(":")
    if kind == "corpus":
        c = case(short)
        return c.fn, c.make_args()
    return rounds.ROUNDS[short], rounds.EXAMPLE_ARGS[short]()


@functools.cache
def captured(name: str) -> fcir.Module:
    fn, args = fn_and_args(name)
    try:
        return fcir.capture(fn, *args)
    except fcir.FcirError as e:  # the corpus tests report capture failures themselves
        pytest.skip(f"{name} does not capture, so it cannot be exported: {e}")


@functools.cache
def plan(name: str, aggregate_with: str = "intrinsics") -> production.Plan:
    return production.export(captured(name), aggregate_with=aggregate_with)


_TMP = tempfile.mkdtemp(prefix="fcir-production-tests-")
atexit.register(shutil.rmtree, _TMP, ignore_errors=True)


@functools.cache
def bundle(name: str) -> str:
    """The bundle of ``name``, written once."""
    out = f"{_TMP}/{name.replace(':', '_')}"
    plan(name).write(out)
    return out


@functools.cache
def expected(name: str):
    """``reference.run`` of the round on its example arguments."""
    _, args = fn_and_args(name)
    return reference.run(captured(name), *args)


def low_precision(module: fcir.Module) -> bool:
    """Whether the round computes in bf16/f16 anywhere: there the reference interpreter
    rounds after every op while compiled code may keep f32 inside a fusion."""
    from fcir.ir import walk

    return any(
        "bf16" in str(v.type) or "f16" in str(v.type)
        for _, op in walk(module.main.body)
        for v in op.results
    )


def assert_close(actual, expected, *, name: str = "", rtol=1e-5, atol=1e-6) -> None:
    """Same structure, dtypes and shapes; floats within tolerance, others bitwise."""
    flat_a = jax.tree_util.tree_leaves(actual)
    flat_e = jax.tree_util.tree_leaves(expected)
    assert str(jax.tree.structure(actual)) == str(jax.tree.structure(expected)), name
    assert len(flat_a) == len(flat_e)
    for i, (a, e) in enumerate(zip(flat_a, flat_e)):
        assert_leaf_matches(a, e, f"{name} leaf {i}", rtol=rtol, atol=atol)
