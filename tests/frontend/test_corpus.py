"""Every corpus program captures, checks, matches its golden, round-trips through text
and protobuf to identical text, and runs on the reference interpreter to what
``jax.jit`` computes (within 1e-5 relative; integers bitwise)."""

from __future__ import annotations

import functools

import jax
import pytest
from corpus import CASES, assert_trees_match, case
from fcir.interpreters import reference

import fcir

NAMES = [c.name for c in CASES]


@functools.cache
def captured(name: str) -> fcir.Module:
    c = case(name)
    return fcir.capture(c.fn, *c.make_args(), name=name)


@pytest.mark.parametrize("name", NAMES)
def test_captures_checks_and_matches_golden(name, golden):
    module = captured(name)
    fcir.check(module)
    golden(name, module.to_text())


@pytest.mark.parametrize("name", NAMES)
def test_round_trips_to_identical_text(name):
    module = captured(name)
    text = module.to_text()
    assert fcir.parse(text).to_text() == text
    data = module.serialize()
    again = fcir.Module.deserialize(data)
    assert again.to_text() == text
    assert again.serialize() == data
    full = module.to_text(full_constants=True)
    assert fcir.parse(full).to_text(full_constants=True) == full


@pytest.mark.parametrize("name", NAMES)
def test_reference_matches_jit(name):
    c = case(name)
    args = c.make_args()
    expected = jax.jit(c.fn)(*args)
    assert_trees_match(reference.run(captured(name), *args), expected)


@pytest.mark.parametrize("name", ["fedavg_mlp", "secure_histogram"])
def test_parsed_text_with_full_constants_runs_to_same_values(name):
    c = case(name)
    args = c.make_args()
    module = fcir.parse(captured(name).to_text(full_constants=True))
    expected = reference.run(captured(name), *args)
    assert_trees_match(reference.run(module, *args), expected, rtol=0, atol=0)


# The backward pass stays federated: the gradient of a round captures to fed.map regions
# plus fed.broadcast/fed.sum-style ops, checks, and is pinned by a golden.
GRADIENT_GOLDENS = ["fedavg_mlp", "fedavg_transformer", "diloco", "scan_rounds"]


def _grad_of(c):
    return jax.grad(lambda *a: c.loss(c.fn(*a)), c.grad_argnums)


@pytest.mark.parametrize("name", GRADIENT_GOLDENS)
def test_gradient_ir_is_federated_and_matches_golden(name, golden):
    c = case(name)
    module = fcir.capture(_grad_of(c), *c.make_args(), name=f"{name}_grad")
    fcir.check(module)
    ops = {op.name for _, op in fcir.ir.walk(module.main.body)}
    assert {"fed.map", "fed.broadcast"} <= ops and ops & {"fed.sum", "fed.mean"}
    assert fcir.parse(module.to_text()).to_text() == module.to_text()
    golden(f"{name}_grad", module.to_text())


def test_meta_learning_gradient_ir_matches_golden(golden):
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[2] / "examples" / "meta_learning.py"
    spec = importlib.util.spec_from_file_location("meta_learning_example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    args = example.EXAMPLE_ARGS["post_round_loss"]()
    grad = jax.grad(example.post_round_loss)  # w.r.t. the initial model and server lr
    module = fcir.capture(grad, *args, name="meta_learning_grad")
    fcir.check(module)
    golden("meta_learning_grad", module.to_text())
