"""Gradients of every corpus program (``tests/corpus``, cases with ``grad_argnums``)
against the gradient of the case's plain-JAX oracle (explicit loops over members).

For each case: ``jax.grad`` (reverse mode) w.r.t. ``grad_argnums`` of
``case.loss(case.fn(*args))`` against the oracle's, and ``jax.jvp`` (forward mode)
along a fixed direction against the oracle's directional derivative; the tolerance is
1e-5 relative (max|a-b|/max|b| per leaf), or bfloat16's precision for the program
that trains in bfloat16. Arguments not differentiated are closed over as constants,
so oracles may read them concretely. And the gradient jaxpr stays federated (the
rule of ``test_autodiff.federated_violations``): it adds no violation of a kind its
forward program does not already have. Two DrJAX-expressible cases are also compared
with the real ``drjax`` package's gradient.
"""

from __future__ import annotations

import re

import cheap_compile
import jax
import jax.numpy as jnp
import numpy as np
import pytest

corpus = pytest.importorskip("corpus")
from test_autodiff import federated_violations, rel_err  # noqa: E402

GRAD_CASES = [c for c in corpus.CASES if c.grad_argnums is not None]
TOL = 1e-5
LOW_PRECISION_TOL = 2e-2  # bfloat16 keeps 8 bits of mantissa
# DiLoCo runs several inner SGD steps per member and an outer Nesterov step, so f32
# rounding compounds: the plain-JAX oracle's own gradient moves by 2.4e-5 (relative)
# between jax 0.10.2 and 0.12.0.1, while fcir's moves by 2.2e-6 (measured on CPU).
CASE_TOL = {"diloco": 5e-5}


def _is_float(x) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def _direction(tree):
    def leaf(a):
        if not _is_float(a):
            return np.zeros(np.shape(a), jax.dtypes.float0)
        a = jnp.asarray(a)
        return jnp.cos(1.0 + jnp.arange(a.size, dtype=jnp.float32)).reshape(a.shape).astype(a.dtype)

    return jax.tree.map(leaf, tree)


# Cheaper XLA compilation (no effect on what is computed beyond float rounding; these
# tests compare at 1e-5): the corpus gradients are big programs (a transformer).
_FAST_COMPILE = cheap_compile.options()


def _run_jitted(fn):
    """``fn()`` jit-compiled (cheaply on CPU), or op by op for an oracle that needs
    concrete values of computed arrays (e.g. a random mask used to gather examples)."""
    try:
        lowered = jax.jit(fn).lower()
    except jax.errors.JAXTypeError:
        return fn()
    options = _FAST_COMPILE if jax.default_backend() == "cpu" else None
    return lowered.compile(compiler_options=options)()


def _gradient(case, program, args, *, with_jvp: bool):
    """``grad`` (and ``jvp`` along ``_direction``) of ``case.loss(program(...))``
    w.r.t. ``case.grad_argnums``."""
    argnums = case.grad_argnums
    diff = tuple(args[i] for i in argnums)

    def of_diff(*diff):
        full = list(args)
        for i, d in zip(argnums, diff, strict=True):
            full[i] = d
        return case.loss(program(*full))

    def run():
        grads = jax.grad(of_diff, tuple(range(len(diff))), allow_int=True)(*diff)
        if not with_jvp:
            return grads, None
        _, tangent = jax.jvp(of_diff, diff, _direction(diff))
        return grads, tangent

    return _run_jitted(run)


def _dot(grads, direction):
    """``<grads, direction>`` over float leaves, and the scale it is compared at (the
    sum of the absolute terms: float32 sums of many terms cancel)."""
    terms = [
        jnp.asarray(g, jnp.float32) * jnp.asarray(d, jnp.float32)
        for g, d in zip(jax.tree.leaves(grads), jax.tree.leaves(direction))
        if _is_float(g)
    ]
    return float(sum(jnp.sum(t) for t in terms)), float(sum(jnp.sum(jnp.abs(t)) for t in terms))


def _float_leaves(tree):
    return [x for x in jax.tree.leaves(tree) if _is_float(x)]


def _uses_low_precision(jaxpr) -> bool:
    return bool(re.search(r"\b(bf16|f16)\[", str(jaxpr)))


def _kinds(errors):
    """A violation's kind: the message without eqn positions."""
    return {re.sub(r"top(/\d+:\w+)*", "", e).split(":", 1)[-1].strip()[:80] for e in errors}


@pytest.mark.parametrize("case", GRAD_CASES, ids=lambda c: c.name)
def test_corpus_gradient_matches_oracle(case):
    """Reverse mode: fcir's grad vs the oracle's grad. Forward mode: fcir's jvp along
    ``v`` vs the oracle's directional derivative ``<grad_oracle, v>`` (one oracle
    compilation instead of two)."""
    args = case.make_args()
    grads, tangent = _gradient(case, case.fn, args, with_jvp=True)
    grads_o, _ = _gradient(case, case.oracle, args, with_jvp=False)
    forward = jax.make_jaxpr(case.fn)(*args)
    tol = LOW_PRECISION_TOL if _uses_low_precision(forward) else CASE_TOL.get(case.name, TOL)
    err_rev = rel_err(_float_leaves(grads), _float_leaves(grads_o))
    assert err_rev <= tol, f"reverse mode: relative error {err_rev:.3e}"
    direction = _direction(tuple(args[i] for i in case.grad_argnums))
    dot_o, scale = _dot(grads_o, direction)
    err_fwd = abs(float(tangent) - dot_o) / scale
    assert err_fwd <= tol, f"forward mode: error {err_fwd:.3e} (relative to sum |g_i v_i|)"
    loss_grad = jax.grad(lambda *a: case.loss(case.fn(*a)), case.grad_argnums, allow_int=True)
    grad_jaxpr = jax.make_jaxpr(loss_grad)(*args)
    new = _kinds(federated_violations(grad_jaxpr)) - _kinds(federated_violations(forward))
    assert not new, f"the gradient adds non-federated ops: {sorted(new)}"


@pytest.mark.parametrize("name", ["fedsgd_linreg", "fedavg_weighted"])
def test_corpus_gradient_matches_drjax(name):
    if name not in corpus.DRJAX_NAMES:
        pytest.skip(f"{name} is not DrJAX-expressible")
    case = corpus.case(name)
    args = case.make_args()
    grads, _ = _gradient(case, case.fn, args, with_jvp=False)
    grads_d, _ = _gradient(case, corpus.drjax_program(name), args, with_jvp=False)
    assert rel_err(_float_leaves(grads), _float_leaves(grads_d)) <= TOL
