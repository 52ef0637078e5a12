"""IR written by an earlier fcir under another JAX loads, checks, prints the same and runs
to the same numbers under the running JAX.

tests/fixtures/ir_v1_jax0.10.2/ holds every corpus program (and the gradients pinned by
goldens) as fcir main wrote it under jax 0.10.2 before fcir had its own op schema (see
tools/make_ir_fixtures.py): text with full constants, serialized protobuf, input leaves
and the reference interpreter's outputs.
"""

from __future__ import annotations

import json
import pathlib

import cheap_compile
import jax
import numpy as np
import pytest
from fcir.interpreters import reference, xla

import fcir
from fcir.errors import InterpreterError

FIXTURES = pathlib.Path(__file__).parents[1] / "fixtures"
SETS = sorted(p for p in FIXTURES.glob("ir_v*_jax*") if (p / "manifest.json").exists())
CASES = [
    (d, name)
    for d in SETS
    for name in sorted(json.loads((d / "manifest.json").read_text())["programs"])
]


# What an old file must keep is how fcir reads, checks and lowers it; the numbers compare
# at 1e-5, not bit for bit, so XLA compiles it with its backend optimizations off (LLVM
# at -O0, cheap_compile.py; on CPU, where the options are XLA:CPU's): the transformer's
# gradient took 15 CPU s at the defaults.
_XLA_OPTIONS = cheap_compile.options() if jax.default_backend() == "cpu" else None


def _reference(module, args):
    """``reference.run(module, *args)``: the reference interpreter's rules (per-member
    loops, member-order sums) traced into one computation and compiled as the XLA run
    is, since the numbers compare at 1e-5; op by op where a rule needs a computed value
    itself (a secure sum's exact integers, the check of a weighted mean's total weight).
    Op by op, the transformer gradient's hundreds of kernels and scans compiled one at a
    time: 15 CPU s of the test's 19."""
    try:
        lowered = jax.jit(lambda *a: reference.run(module, *a)).lower(*args)
    except (jax.errors.JAXTypeError, InterpreterError):
        # A rule read a traced value (the interpreter names the op around JAX's error);
        # any other error comes back from the run op by op.
        return reference.run(module, *args)
    return lowered.compile(_XLA_OPTIONS)(*args)


def _ids(case):
    d, name = case
    return f"{d.name}/{name}"


def _leaves(path: pathlib.Path, prefix: str, kinds: list[dict]) -> list:
    data = np.load(path)
    out = []
    for i, kind in enumerate(kinds):
        x = data[f"{prefix}{i}"]
        if "key" in kind:
            impl = {"fry": "threefry2x32", "rbg": "rbg", "unsafe_rbg": "unsafe_rbg"}.get(
                kind["key"], kind["key"]
            )
            out.append(jax.random.wrap_key_data(x, impl=impl))
        else:
            out.append(x)
    return out


def _assert_same_numbers(got, expected, name):
    got = jax.tree.leaves(got)
    assert len(got) == len(expected), name
    for i, (g, e) in enumerate(zip(got, expected)):
        g = np.asarray(
            jax.random.key_data(g) if jax.dtypes.issubdtype(g.dtype, jax.dtypes.prng_key) else g
        )
        assert g.shape == e.shape and g.dtype == e.dtype, (name, i, g.dtype, e.dtype)
        if np.issubdtype(e.dtype, np.inexact):
            np.testing.assert_allclose(
                g.astype(np.float64),
                e.astype(np.float64),
                rtol=1e-5,
                atol=1e-6,
                err_msg=f"{name} result leaf {i}",
            )
        else:
            np.testing.assert_array_equal(g, e, err_msg=f"{name} result leaf {i}")


def test_fixture_sets_are_present():
    assert [d.name for d in SETS][:1] == ["ir_v1_jax0.10.2"]
    assert len(CASES) >= 19


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_old_ir_loads_checks_prints_the_same_and_runs_to_the_same_numbers(case):
    d, name = case
    spec = json.loads((d / "manifest.json").read_text())["programs"][name]
    text = (d / f"{name}.fcir").read_text()
    from_text = fcir.parse(text)
    from_pb = fcir.Module.deserialize((d / f"{name}.pb").read_bytes())
    for m in (from_text, from_pb):
        fcir.check(m)
        # fcir's op schema does not depend on the JAX that reads it
        assert m.to_text(full_constants=True) == text
    args = _leaves(d / f"{name}.inputs.npz", "a", spec["inputs"])
    expected = _leaves(d / f"{name}.outputs.npz", "r", spec["outputs"])
    expected = [
        np.asarray(jax.random.key_data(e)) if "key" in k else e
        for e, k in zip(expected, spec["outputs"])
    ]
    _assert_same_numbers(_reference(from_pb, args), expected, f"{name} (reference)")
    compiled = xla.compile(from_text).lower(*args).compile(_XLA_OPTIONS)
    _assert_same_numbers(compiled(*args), expected, f"{name} (xla)")
