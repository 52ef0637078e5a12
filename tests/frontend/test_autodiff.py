"""Federated automatic differentiation.

What is tested on what (``L = sum(f(...)**2)`` of each program below; "oracle" is the
same computation written as a Python loop over members in plain JAX, no fcir; every
program is checked in reverse mode (jax.grad) and forward mode (jax.jvp along a fixed
direction, and <grad, v> == jvp(v)) under jit, and its gradient jaxpr is checked to be
federated):

===============  ===========================================================================
program          further transformations checked against the oracle
===============  ===========================================================================
fedavg           value_and_grad, vjp, linearize, jacfwd, jacrev, hessian, vmap(grad) over
                 models and over data (one jit); jax.checkpoint around the program
                 (nothing_saveable, dots_saveable, everything_saveable: the
                 partial_eval_jaxpr_custom rule); grad on a mesh with a 'clients' axis
                 (Auto and Explicit axis types)
weighted         scalar and full-shape learnable weights; direct linearize off (JVP +
                 JaxprTrace partial eval); check_grads order 2 fwd+rev (a lighter variant)
minmax           2- and 3-way ties (jnp.min/jnp.max's tie-splitting subgradient); direct
                 linearize off; check_grads order 2 fwd+rev away from ties
nested           silos -> clients: jax_enable_checks (both AD paths); check_grads
ints             int values through map, secure_sum, int mean (float32 result), int
                 weights: eager jvp with float0 tangents, jit(linearize)
remat_body       jax.checkpoint inside the map body: eager grad, remat3, check_grads
(primitives)     per rule: transposes of broadcast/sum/mean, min/max ties (exact, both
                 modes), weighted mean w.r.t. values and weights (scalar / full / prefix /
                 int weights, int values), symbolic zeros, DCE, JaxprTrace partial eval,
                 map transpose, body constants in linear regions
drjax_round      same source on fcir and on the real drjax 0.2.1: equal gradients
meta_learning    examples/meta_learning.py at reduced size (grad through a lax.scan of SGD
                 steps inside the body, w.r.t. the server lr and the initial model)
corpus           tests/frontend/test_autodiff_corpus.py: every case with grad_argnums, grad and jvp
                 vs the oracle, federated-ness; two cases also vs drjax's gradient
===============  ===========================================================================

Largest relative error (max|a-b| / max|b| per leaf) seen against the plain-JAX oracle:
2.0e-6 on this file's float32 programs (remat_body forward mode; weighted reverse mode
1.6e-6), 8.0e-7 on the corpus's float32 programs (diloco, reverse mode), 1.6e-4 for the
corpus's bfloat16 program (forward mode; compared at bfloat16 precision). The tolerance
asserted is 1e-5. Finite differences run in float32 at check_grads' float32 tolerance.

Speed: this file compiles a few dozen small XLA programs; jits here use cheap XLA
compile options (``fast_jit``) and finite differences run eagerly (op cache shared).

Federated-ness rule enforced by ``federated_violations`` on every gradient jaxpr (and
recursively on every fed_map region, where the region's own member values are the
"server" of the nested placement):

* A value is *placed* if it is a fed_broadcast or fed_map result, a jaxpr input used as
  a fed_map/reduction operand, or the result of an allowed member-wise op on placed
  values.
* Every top-level eqn with a placed operand is a fed primitive, a call-like eqn (pjit,
  closed_call, remat, custom_jvp/vjp: checked recursively), or one of the member-wise
  ops JAX's AD machinery itself inserts for any primitive (``add_any``, accumulating the
  cotangents of a placed value used twice; ``reduce_precision``, the identity
  jax.checkpoint puts on saved residuals) or the frontend's layout-only identities on a
  mesh (``sharding_constraint``, ``reshard``), whose operands are all placed values of
  the result's shape: member-wise, no cross-member data flow.
* fed_broadcast operands are server values; fed_map, reduction and fed_member_index
  operands are placed values (a member index is a placed value). (A program may hand server-computed per-member data to map_fn, e.g. keys
  from ``jax.random.split``; the corpus test only requires that a gradient adds no
  violation of a kind its forward program does not already have.)
So a plain reduction over the member axis, a map body inlined at top level, or a hidden
``broadcast_in_dim`` of a server value to the members are all violations.
"""

from __future__ import annotations

import functools
import importlib.util
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fcir
from fcir import jaxcompat as jc
from fcir.fed.broadcast import broadcast_p
from fcir.fed.map import map_p
from fcir.fed.max import max_p
from fcir.fed.mean import mean_p
from fcir.fed.min import min_p
from fcir.fed.secure_sum import secure_sum_p
from fcir.fed.sum import sum_p
from fcir.fed.weighted_mean import weighted_mean_p
from fcir.jaxcompat import config as jax_config
from fcir.jaxcompat import core, pe
from fcir.jaxcompat.schema import scan_counts

ROOT = pathlib.Path(__file__).resolve().parents[2]
TOL = 1e-5

# --- the federated-ness checker -------------------------------------------------------------

_REDUCTIONS = frozenset(
    prim for prim, op in fcir.fed.by_primitive().items() if op.kind in ("reduction", "dp")
)
# Each member's position (fed.member_index): a placed value from a placed operand.
_INDEX = frozenset(prim for prim, op in fcir.fed.by_primitive().items() if op.kind == "index")
# Member-wise ops allowed on placed values at top level: the ones JAX's own AD machinery
# inserts (add_any accumulates the cotangents of a value used twice; reduce_precision is
# the identity jax.checkpoint applies to saved residuals) and the layout-only identities
# the frontend puts on placed values on a mesh (sharding_constraint, reshard; their
# transposes are themselves).
MEMBERWISE = frozenset({"add_any", "reduce_precision", "sharding_constraint", "reshard"})
_CALL_PARAMS = {
    "pjit": "jaxpr",
    "jit": "jaxpr",
    "closed_call": "call_jaxpr",
    "core_call": "call_jaxpr",
    "remat2": "jaxpr",
    "checkpoint": "jaxpr",
    "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr",
}


def _open(jaxpr):
    return jc.open_jaxpr(jaxpr)


def _inferred_placed_invars(jaxpr) -> list[bool]:
    """Inputs used as fed_map/reduction operands (possibly through member-wise ops such
    as the frontend's sharding constraints) are placed."""
    used = set()
    for eqn in reversed(jaxpr.eqns):
        if eqn.primitive is map_p or eqn.primitive.name in _REDUCTIONS:
            used.update(v for v in eqn.invars if isinstance(v, core.Var))
        elif eqn.primitive.name in MEMBERWISE and any(v in used for v in eqn.outvars):
            used.update(v for v in eqn.invars if isinstance(v, core.Var))
    return [v in used for v in jaxpr.invars]


def _walk(jaxpr, placed_invars, where: str, errors: list[str]) -> list[bool]:
    """Checks one level; returns which outvars are placed."""
    jaxpr = _open(jaxpr)
    if placed_invars is None:
        placed_invars = _inferred_placed_invars(jaxpr)
    placed = {v for v, p in zip(jaxpr.invars, placed_invars) if p}

    def is_placed(a) -> bool:
        return isinstance(a, core.Var) and a in placed

    def producer(a) -> str:
        for e in jaxpr.eqns:
            if a in e.outvars:
                return e.primitive.name
        return "input"

    for i, eqn in enumerate(jaxpr.eqns):
        name, loc = eqn.primitive.name, f"{where}/{i}:{eqn.primitive.name}"
        ins = [is_placed(a) for a in eqn.invars]
        if eqn.primitive is broadcast_p:
            if ins[0]:
                errors.append(f"{loc}: broadcast of a placed value")
            placed.update(eqn.outvars)
        elif name in _INDEX:
            if not ins[0]:
                errors.append(
                    f"{name}: operand produced by {producer(eqn.invars[0])} is not placed"
                )
            placed.update(eqn.outvars)
        elif eqn.primitive is map_p or name in _REDUCTIONS:
            for a, p in zip(eqn.invars, ins):
                if not p:
                    errors.append(f"{name}: operand produced by {producer(a)} is not placed")
            if eqn.primitive is map_p:
                _walk(eqn.params["body"], None, loc, errors)
                placed.update(eqn.outvars)
        elif name == "scan":
            # Server control flow passes placed values to its body (docs/control_flow.md):
            # a carry is placed if it enters placed or any iteration makes it placed.
            nc, nk = scan_counts(eqn.params)
            sub_ins = list(ins)
            for _ in range(nk + 1):
                outs = _walk(eqn.params["jaxpr"], sub_ins, loc, [])
                carry = [a or b for a, b in zip(sub_ins[nc : nc + nk], outs[:nk])]
                if carry == sub_ins[nc : nc + nk]:
                    break
                sub_ins[nc : nc + nk] = carry
            outs = _walk(eqn.params["jaxpr"], sub_ins, loc, errors)
            placed.update(v for v, p in zip(eqn.outvars, carry + outs[nk:]) if p)
        elif name in _CALL_PARAMS and _CALL_PARAMS[name] in eqn.params:
            sub = _open(eqn.params[_CALL_PARAMS[name]])
            sub_ins = ins[len(ins) - len(sub.invars) :]
            outs = _walk(sub, sub_ins, loc, errors)
            placed.update(v for v, p in zip(eqn.outvars, outs) if p)
        elif any(ins):
            shapes = {tuple(v.aval.shape) for v in eqn.outvars}
            memberwise = (
                name in MEMBERWISE
                and len(shapes) == 1
                and all(is_placed(a) and tuple(a.aval.shape) in shapes for a in eqn.invars)
            )
            if not memberwise:
                errors.append(f"{loc}: non-federated op on placed values: {eqn}")
            placed.update(eqn.outvars)
    return [is_placed(v) for v in jaxpr.outvars]


def federated_violations(jaxpr, placed_invars=None) -> list[str]:
    """The rule violations of ``jaxpr`` (see the module docstring); empty if federated."""
    errors: list[str] = []
    _walk(jaxpr, placed_invars, "top", errors)
    return errors


def count_eqns(jaxpr, name: str) -> int:
    """Top-level eqns of primitive ``name``."""
    return sum(e.primitive.name == name for e in _open(jaxpr).eqns)


def rel_err(actual, expected) -> float:
    """Largest over leaves of max|a - e| / max|e| (float64)."""
    errs = []
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
        assert a.shape == e.shape
        if a.size:
            errs.append(float(np.max(np.abs(a - e)) / max(np.max(np.abs(e)), 1e-30)))
    return max(errs, default=0.0)


# Cheaper XLA compilation for the test jits (they compare at 1e-5, rounding aside the
# computation is the same): most of this file's time is XLA compiling gradients.
_FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def fast_jit(fn):
    """``jax.jit(fn)``, compiled with cheap XLA options on CPU."""
    jitted = jax.jit(fn)

    def call(*args):
        options = _FAST_COMPILE if jax.default_backend() == "cpu" else None
        return jitted.lower(*args).compile(compiler_options=options)(*args)

    return call


def assert_close(actual, expected, tol=TOL, what=""):
    err = rel_err(actual, expected)
    assert err <= tol, f"{what}: relative error {err:.3e} > {tol:.1e}"


# --- programs and their plain-JAX oracles ---------------------------------------------------

N = 3
CLIENTS = {"clients": N}


def _mse(p, x, y):
    return jnp.mean(jnp.square(jnp.tanh(x @ p["w"] + p["b"]) - y))


def _sgd(p, x, y):
    g = jax.grad(_mse)(p, x, y)
    return jax.tree.map(lambda a, b: a - 0.5 * b, p, g)


@fcir.program(placements=CLIENTS)
def fedavg(p, x, y):
    new = fcir.map_fn(_sgd, (fcir.broadcast(p), x, y))
    p2 = fcir.reduce_mean(new)
    return fcir.reduce_mean(fcir.map_fn(_mse, (fcir.broadcast(p2), x, y)))


def fedavg_oracle(p, x, y):
    new = [_sgd(p, x[i], y[i]) for i in range(N)]
    p2 = jax.tree.map(lambda *m: sum(m) / N, *new)
    return sum(_mse(p2, x[i], y[i]) for i in range(N)) / N


def fedavg_args():
    k = jax.random.split(jax.random.key(1), 4)
    p = {"w": jax.random.normal(k[0], (3,)), "b": jnp.float32(0.1)}
    return p, jax.random.normal(k[1], (N, 4, 3)), jax.random.normal(k[2], (N, 4))


def _weight(c, x):
    return jax.nn.softplus(c) + jnp.mean(x * x)


@fcir.program(placements=CLIENTS)
def weighted(p, x, y, c):
    upd = fcir.map_fn(_sgd, (fcir.broadcast(p), x, y))
    ws = fcir.map_fn(_weight, (c, x))  # one learnable weight per member
    full = jax.tree.map(lambda u: fcir.map_fn(lambda v: jnp.cos(v) + 1.5, u), upd)
    a = fcir.reduce_weighted_mean(upd, ws)
    b = fcir.reduce_weighted_mean(upd, full)  # one weight per element
    return jax.tree.map(lambda s, t: s + t, a, b)


def weighted_oracle(p, x, y, c):
    upd = [_sgd(p, x[i], y[i]) for i in range(N)]
    ws = [_weight(c[i], x[i]) for i in range(N)]
    full = [jax.tree.map(lambda v: jnp.cos(v) + 1.5, u) for u in upd]

    def wmean(vals, wts):
        num = jax.tree.map(
            lambda *v: sum(v), *[jax.tree.map(lambda a, b: a * b, v, w) for v, w in zip(vals, wts)]
        )
        den = jax.tree.map(lambda *w: sum(w), *wts)
        return jax.tree.map(lambda a, b: a / b, num, den)

    a = wmean(upd, [jax.tree.map(lambda _, w=w: w, upd[0]) for w in ws])
    b = wmean(upd, full)
    return jax.tree.map(lambda s, t: s + t, a, b)


def weighted_args():
    p, x, y = fedavg_args()
    return p, x, y, jnp.array([0.3, -0.2, 0.5], jnp.float32)


@fcir.program(placements=CLIENTS)
def minmax(w, x):
    v = fcir.map_fn(
        lambda w, x: jnp.round(jnp.sin(x @ w), 1) + 0.1 * jnp.sin(x @ w), (fcir.broadcast(w), x)
    )
    return fcir.reduce_min(v) * 2.0 + fcir.reduce_max(v) ** 2


def minmax_oracle(w, x):
    v = jnp.stack([jnp.round(jnp.sin(x[i] @ w), 1) + 0.1 * jnp.sin(x[i] @ w) for i in range(N)])
    return jnp.min(v, axis=0) * 2.0 + jnp.max(v, axis=0) ** 2


def minmax_args(ties=True):
    k = jax.random.split(jax.random.key(2), 3)
    x = jax.random.normal(k[1], (N, 5, 3))
    if ties:  # rows 0-1: members 0 and 1 tie; rows 2-3: all three members tie
        x = x.at[1, :2].set(x[0, :2]).at[:, 2:4].set(x[0, 2:4])
    return jax.random.normal(k[0], (3,)), x


NESTED = {"silos": 2, "clients": 3}


def _silo(w, xs):
    r = fcir.map_fn(lambda w, x: jnp.tanh(x @ w), (fcir.broadcast(w), xs))
    return fcir.reduce_mean(r) + fcir.reduce_max(r), fcir.reduce_sum(r)


@fcir.program(placements=NESTED)
def nested(w, x):
    a, b = fcir.map_fn(_silo, (fcir.broadcast(w), x))
    return fcir.reduce_sum(a) * fcir.reduce_min(b)


def nested_oracle(w, x):
    a, b = [], []
    for s in range(2):
        r = jnp.stack([jnp.tanh(x[s, c] @ w) for c in range(3)])
        a.append(jnp.mean(r, 0) + jnp.max(r, 0))
        b.append(jnp.sum(r, 0))
    return sum(a) * jnp.min(jnp.stack(b), 0)


def nested_args():
    k = jax.random.split(jax.random.key(3), 2)
    return jax.random.normal(k[0], (3,)), jax.random.normal(k[1], (2, 3, 4, 3))


def _int_member(w, x, c):
    loss = jnp.sum(jnp.tanh(x @ w)) * c
    return loss, loss * loss, (c > 1).astype(jnp.int32)


@fcir.program(placements=CLIENTS)
def ints(w, x, counts):
    losses, squares, ok = fcir.map_fn(_int_member, (fcir.broadcast(w), x, counts))
    total = fcir.secure_sum(ok, bitwidth=8)
    return (
        fcir.reduce_sum(losses)
        + fcir.reduce_mean(counts) * total
        + fcir.reduce_weighted_mean(losses, counts)
        + fcir.reduce_weighted_mean(counts, squares)
    )


def ints_oracle(w, x, counts):
    losses, _, oks = zip(*[_int_member(w, x[i], counts[i]) for i in range(N)])
    total = sum(oks)
    cf = counts.astype(jnp.float32)
    return (
        sum(losses)
        + jnp.mean(cf) * total
        + sum(lo * c for lo, c in zip(losses, cf)) / jnp.sum(cf)
        + sum(c * lo * lo for lo, c in zip(losses, cf)) / sum(lo * lo for lo in losses)
    )


def ints_args():
    k = jax.random.split(jax.random.key(4), 2)
    return (
        jax.random.normal(k[0], (3,)),
        jax.random.normal(k[1], (N, 4, 3)),
        jnp.array([1, 2, 3], jnp.int32),
    )


_ckpt_member = jax.checkpoint(lambda w, x: jnp.sum(jnp.sin(jnp.tanh(x @ w) ** 2)))


@fcir.program(placements=CLIENTS)
def remat_body(w, x):
    return fcir.reduce_mean(fcir.map_fn(_ckpt_member, (fcir.broadcast(w), x)))


def remat_body_oracle(w, x):
    return sum(_ckpt_member(w, x[i]) for i in range(N)) / N


def remat_body_args():
    k = jax.random.split(jax.random.key(5), 2)
    return jax.random.normal(k[0], (3,)), jax.random.normal(k[1], (N, 4, 3))


# name: (program, oracle, make_args, argnums)
PROGRAMS = {
    "fedavg": (fedavg, fedavg_oracle, fedavg_args, (0, 1, 2)),
    "weighted": (weighted, weighted_oracle, weighted_args, (0, 1, 3)),
    "minmax": (minmax, minmax_oracle, minmax_args, (0, 1)),
    "nested": (nested, nested_oracle, nested_args, (0, 1)),
    "ints": (ints, ints_oracle, ints_args, (0, 1)),
    "remat_body": (remat_body, remat_body_oracle, remat_body_args, (0, 1)),
}


def _loss(fn):
    def loss(*args):
        return sum(jnp.sum(jnp.square(v)) for v in jax.tree.leaves(fn(*args)))

    return loss


def _with_diff(args, argnums, diff):
    full = list(args)
    for i, d in zip(argnums, diff, strict=True):
        full[i] = d
    return tuple(full)


def _direction(tree):
    """A fixed, non-degenerate tangent direction for forward mode."""
    return jax.tree.map(
        lambda a: jnp.cos(1.0 + jnp.arange(a.size, dtype=a.dtype)).reshape(a.shape), tree
    )


@functools.cache
def reference(name: str, which: str):
    """``(grad, jvp)`` of ``L`` for program ``name`` (``which``: "fcir" or "oracle"),
    jit-compiled once per session: reverse mode w.r.t. the program's argnums and forward
    mode along ``_direction``."""
    fn, oracle, make_args, argnums = PROGRAMS[name]
    loss = _loss(fn if which == "fcir" else oracle)

    def both(*args):
        def of_diff(*diff):
            return loss(*_with_diff(args, argnums, diff))

        diff = tuple(args[i] for i in argnums)
        grads = jax.grad(of_diff, tuple(range(len(diff))))(*diff)
        _, tangent = jax.jvp(of_diff, diff, _direction(diff))
        return grads, tangent

    return fast_jit(both)(*make_args())


# --- oracle and federated-ness, per program -------------------------------------------------


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_gradient_matches_loop_oracle_in_both_modes(name):
    grads, tangent = reference(name, "fcir")
    grads_o, tangent_o = reference(name, "oracle")
    assert_close(grads, grads_o, what="reverse mode")
    assert_close(tangent, tangent_o, what="forward mode")
    _, _, make_args, argnums = PROGRAMS[name]
    direction = _direction(tuple(make_args()[i] for i in argnums))
    terms = [g * d for g, d in zip(jax.tree.leaves(grads), jax.tree.leaves(direction))]
    dot = sum(jnp.sum(t) for t in terms)
    scale = sum(jnp.sum(jnp.abs(t)) for t in terms)  # float32 sums cancel: compare to this
    assert abs(float(dot) - float(tangent)) <= TOL * float(scale), "<grad, v> != jvp(v)"


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_gradient_stays_federated(name):
    fn, _, make_args, argnums = PROGRAMS[name]
    args = make_args()
    forward = jax.make_jaxpr(fn)(*args)
    grad = jax.make_jaxpr(jax.grad(_loss(fn), argnums))(*args)
    assert federated_violations(forward) == []
    assert federated_violations(grad) == []
    # The backward pass is made of fed_map regions (never inlined at top level) and the
    # transposes of broadcasts are fed_sums.
    assert count_eqns(grad, "fed_map") > count_eqns(forward, "fed_map")
    assert count_eqns(grad, "fed_sum") > count_eqns(forward, "fed_sum")


def test_checker_catches_non_federated_gradients():
    """The checker itself: a plain reduction over members, an inlined body op on placed
    values and a hidden broadcast are reported."""

    @fcir.program(placements=CLIENTS)
    def bad(w, x):
        v = fcir.map_fn(lambda w, x: x @ w, (fcir.broadcast(w), x))
        hidden = jnp.broadcast_to(w[None, None, :], x.shape)  # not a fed_broadcast
        u = fcir.map_fn(lambda a, b: jnp.sum(a * b), (x, hidden))
        return jnp.sum(v, axis=0) + jnp.tanh(u).sum()

    w, x = remat_body_args()
    errors = federated_violations(jax.make_jaxpr(bad)(w, x))
    text = "\n".join(errors)
    assert "reduce_sum" in text and "tanh" in text and "broadcast_in_dim" in text


# --- every JAX transformation ---------------------------------------------------------------


def test_transformations_under_jit():
    """value_and_grad, vjp, linearize, jacfwd, jacrev, hessian, vmap(grad) (over models
    and over data) in one jitted function each side, against the oracle."""
    p, x, y = fedavg_args()

    def everything(fn):
        loss = _loss(fn)
        val, g = jax.value_and_grad(loss)(p, x, y)
        _, vjp = jax.vjp(loss, p, x, y)
        _, lin = jax.linearize(loss, p, x, y)
        tangent = (jax.tree.map(jnp.ones_like, p), x * 0.5, y * -0.25)
        models = jax.tree.map(lambda a: jnp.stack([a, 1.5 * a]), p)
        return {
            "value_and_grad": (val, g),
            "vjp": vjp(jnp.float32(2.0)),
            "linearize": lin(*tangent),
            "jacfwd": jax.jacfwd(loss)(p, x, y),
            "jacrev": jax.jacrev(loss, (0, 1))(p, x, y),
            "hessian": jax.hessian(loss)(p, x, y),
            "vmap_models": jax.vmap(jax.grad(loss), (0, None, None))(models, x, y),
            "vmap_data": jax.vmap(jax.grad(loss, 1), (None, 0, None))(p, jnp.stack([x, -x]), y),
        }

    got = fast_jit(lambda: everything(fedavg))()
    want = fast_jit(lambda: everything(fedavg_oracle))()
    for key in want:
        assert_close(got[key], want[key], what=key)


def test_eager_grad_and_jvp():
    """Without jit: grad (checkpoint inside the body), and jvp with symbolic-zero and
    float0 tangents (integer inputs, secure_sum, int mean)."""
    grads_o, _ = reference("remat_body", "oracle")
    assert_close(jax.grad(_loss(remat_body), (0, 1))(*remat_body_args()), grads_o)
    w, x, counts = ints_args()
    _, tangent_o = reference("ints", "oracle")
    float0 = np.zeros(counts.shape, jax.dtypes.float0)
    _, t = jax.jvp(_loss(ints), (w, x, counts), (*_direction((w, x)), float0))
    assert_close(t, tangent_o)


def test_jit_of_linearize_and_jvp_of_ints_with_float0_tangent():
    w, x, counts = ints_args()
    f = _loss(ints)
    y, f_jvp = fast_jit(lambda *a: jax.linearize(lambda w, x: f(w, x, counts), *a))(w, x)
    direction = _direction((w, x))
    grads_o, tangent_o = reference("ints", "oracle")
    assert_close(f_jvp(*direction), tangent_o)
    float0 = np.zeros(counts.shape, jax.dtypes.float0)
    out, t = jax.jvp(f, (w, x, counts), (jnp.zeros_like(w), jnp.zeros_like(x), float0))
    assert float(t) == 0.0
    assert_close(out, y)


@pytest.mark.parametrize("policy", ["nothing_saveable", "dots_saveable", "everything_saveable"])
def test_checkpoint_around_program_partial_eval_custom(policy):
    """jax.checkpoint of the whole program uses pe.partial_eval_jaxpr_custom_rules on
    fed_map: residuals come out of a known map placed at the members."""
    args = fedavg_args()
    loss = jax.checkpoint(_loss(fedavg), policy=getattr(jax.checkpoint_policies, policy))
    g = fast_jit(jax.grad(loss, (0, 1, 2)))(*args)
    assert_close(g, reference("fedavg", "oracle")[0])
    assert federated_violations(jax.make_jaxpr(jax.grad(loss, (0, 1, 2)))(*args)) == []


def test_remat3_rule():
    from jax._src import ad_checkpoint

    remat3 = getattr(ad_checkpoint, "remat3", None)
    if remat3 is None:  # experimental API of this jax version
        pytest.skip("jax has no remat3")
    args = remat_body_args()
    assert_close(
        jax.grad(remat3(_loss(remat_body)), (0, 1))(*args), reference("remat_body", "oracle")[0]
    )


@pytest.mark.parametrize("name", ["weighted", "minmax"])
def test_jvp_then_partial_eval_path(name):
    """jax_use_direct_linearize off: grad goes through the JVP rules and the
    JaxprTrace partial-eval rule of fed_map."""
    fn, _, make_args, argnums = PROGRAMS[name]
    args = make_args()
    with jax_config.use_direct_linearize(False):
        g = fast_jit(jax.grad(_loss(fn), argnums))(*args)
        jaxpr = jax.make_jaxpr(jax.grad(_loss(fn), argnums))(*args)
    assert_close(g, reference(name, "oracle")[0])
    assert federated_violations(jaxpr) == []


def test_enable_checks_typechecks_every_jaxpr():
    """jax_enable_checks typechecks every jaxpr built by the rules (both AD paths)."""
    args = nested_args()
    with jax.enable_checks(True):
        g = fast_jit(jax.grad(_loss(nested), (0, 1)))(*args)
        with jax_config.use_direct_linearize(False):
            g2 = fast_jit(jax.grad(_loss(nested), (0, 1)))(*args)
    assert_close(g, reference("nested", "oracle")[0])
    assert_close(g2, reference("nested", "oracle")[0])


@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
def test_grad_on_a_mesh_with_a_clients_axis(axis_type):
    """With a mesh axis named after the placement the frontend adds sharding
    constraints (Auto) or reshards (Explicit); the rules keep working through them."""
    mesh = jax.make_mesh(
        (1,), ("clients",), axis_types=(getattr(jax.sharding.AxisType, axis_type),)
    )
    args = fedavg_args()
    with jax.set_mesh(mesh):
        g = fast_jit(jax.grad(_loss(fedavg), (0, 1, 2)))(*args)
        jaxpr = jax.make_jaxpr(jax.grad(_loss(fedavg), (0, 1, 2)))(*args)
    assert_close(g, reference("fedavg", "oracle")[0])
    assert federated_violations(jaxpr) == []


# --- the rules of each primitive ------------------------------------------------------------


def _bind(prim, x, **params):
    return prim.bind(x, placement="clients", n=N, **params)


def test_broadcast_sum_mean_transposes_are_federated():
    s = jnp.arange(2.0)
    placed = jnp.arange(6.0).reshape(N, 2)
    bt = jax.make_jaxpr(jax.linear_transpose(lambda v: _bind(broadcast_p, v), s))(placed)
    st = jax.make_jaxpr(jax.linear_transpose(lambda v: _bind(sum_p, v), placed))(s)
    mt = jax.linear_transpose(lambda v: _bind(mean_p, v), placed)
    assert [e.primitive for e in bt.eqns] == [sum_p]
    assert [e.primitive for e in st.eqns] == [broadcast_p]
    mjaxpr = jax.make_jaxpr(mt)(s)
    assert mjaxpr.eqns[-1].primitive is broadcast_p
    assert federated_violations(mjaxpr) == []
    np.testing.assert_allclose(mt(s)[0], np.broadcast_to(s / N, (N, 2)))
    # JVPs are the primitive applied to the tangent.
    _, t = jax.jvp(lambda v: _bind(mean_p, v), (placed,), (placed,))
    np.testing.assert_allclose(t, placed.mean(0))


def test_integer_mean_and_secure_sum_have_zero_tangents():
    ints_ = jnp.array([[1, 2], [3, 4], [5, 7]], jnp.int32)
    f0 = np.zeros(ints_.shape, jax.dtypes.float0)
    y, t = jax.jvp(lambda v: _bind(mean_p, v), (ints_,), (f0,))
    assert y.dtype == jnp.float32 and t.dtype == jnp.float32 and not np.any(t)
    y, t = jax.jvp(lambda v: _bind(secure_sum_p, v, bitwidth=4), (ints_,), (f0,))
    assert t.dtype == jax.dtypes.float0
    np.testing.assert_array_equal(y, [(1 + 3 + 5) % 16, (2 + 4 + 7) % 16])
    # An integer mean of a value computed from a float parameter passes no gradient.
    w, x, counts = ints_args()

    def through_int(w):
        return _bind(mean_p, (counts[:, None] * (w > 0)).astype(jnp.int32)).sum() + w.sum()

    np.testing.assert_array_equal(jax.grad(through_int)(w), np.ones(3))


@pytest.mark.parametrize("prim,ref", [(min_p, jnp.min), (max_p, jnp.max)])
def test_min_max_ties_split_like_jnp(prim, ref):
    """Ties: the subgradient jnp.min/jnp.max use (lax._reduce_chooser_jvp_rule): the
    tangents of the tied members are averaged; so each of k tied members gets 1/k of
    the cotangent. Checked for 1-, 2- and 3-way ties, in both modes, exactly."""
    x = jnp.array([[1.0, 2.0, 5.0, 0.5], [1.0, 2.0, 3.0, 0.5], [4.0, 2.0, 5.0, 0.5]])
    if prim is max_p:
        x = -x
    x = x.at[2, 3].set(x[0, 3])  # all tie in column 3 as well
    ct = jnp.array([1.0, 2.0, 3.0, 4.0])

    def f(v):
        return jnp.vdot(_bind(prim, v), ct)

    def f_ref(v):
        return jnp.vdot(ref(v, axis=0), ct)

    np.testing.assert_array_equal(jax.grad(f)(x), jax.grad(f_ref)(x))
    np.testing.assert_array_equal(jax.jacfwd(f)(x), jax.jacfwd(f_ref)(x))
    g = np.asarray(jax.grad(f)(x))
    np.testing.assert_allclose(g[:, 1], [2 / 3] * 3, rtol=1e-6)  # 3-way tie
    # The JVP stays federated: indicator and masking are fed_map regions.
    assert federated_violations(jax.make_jaxpr(jax.grad(f))(x), [True]) == []
    ints_ = jnp.array([[1], [2], [3]], jnp.int32)
    _, t = jax.jvp(lambda v: _bind(prim, v), (ints_,), (np.zeros((3, 1), jax.dtypes.float0),))
    assert t.dtype == jax.dtypes.float0


def test_weighted_mean_values_and_weights():
    """Derivatives w.r.t. values and weights -- per-member scalar, full-shape and
    prefix-shape weights; integer weights; integer values -- in both modes, against the
    same weighted mean written with jnp (one jitted function per side)."""
    x = jax.random.normal(jax.random.key(7), (N, 2, 3))
    xi = (x * 4).astype(jnp.int32)
    w_abs = jnp.abs(jax.random.normal(jax.random.key(8), (N, 2, 3))) + 0.5
    weights = {"scalar": w_abs[:, 0, 0], "full": w_abs, "prefix": w_abs[:, :, 0]}
    w_int = (3 * w_abs[:, :, 0]).astype(jnp.int32)

    def fed(x, w):
        return jnp.sum(jnp.sin(weighted_mean_p.bind(x, w, placement="clients", n=N)))

    def ref(x, w):
        wf = w.astype(jnp.float32).reshape(w.shape + (1,) * (x.ndim - w.ndim))
        return jnp.sum(jnp.sin(sum(x[i] * wf[i] for i in range(N)) / sum(wf[i] for i in range(N))))

    def derivatives(f):
        out = {}
        for kind, w in weights.items():
            out[kind] = (
                jax.grad(f, (0, 1))(x, w),
                jax.jvp(f, (x, w), (jnp.cos(x), jnp.sin(w))),  # both tangents nonzero
                jax.jvp(lambda w: f(x, w), (w,), (jnp.sin(w),)),  # weights only
                jax.grad(f, 1)(xi, w),  # integer values: only the weights get one
            )
        out["int_weights"] = (  # integer weights: only the values get one
            jax.grad(f)(x, w_int),
            jax.jvp(lambda x: f(x, w_int), (x,), (jnp.cos(x),)),
        )
        return out

    got, want = fast_jit(lambda: derivatives(fed))(), fast_jit(lambda: derivatives(ref))()
    for key in want:
        assert_close(got[key], want[key], what=key)
    for w in (weights["prefix"], w_int):
        jaxpr = jax.make_jaxpr(jax.grad(fed, (0, 1) if w is not w_int else 0))(x, w)
        assert federated_violations(jaxpr, [True, True]) == []


def test_symbolic_zeros_everywhere():
    """Unused map outputs, unused map operands, constant outputs, int outputs and
    arguments that do not reach the loss: gradients are (exact) zeros, no failure."""

    @fcir.program(placements=CLIENTS)
    def f(w, x, unused):
        a, b, c, d = fcir.map_fn(
            lambda w, x, u: (jnp.sum(x @ w), jnp.cos(w), jnp.ones(2), jnp.int32(3)),
            (fcir.broadcast(w), x, unused),
        )
        return fcir.reduce_sum(a) + 0.0 * fcir.reduce_sum(c).sum() + fcir.reduce_sum(d)

    w, x = remat_body_args()
    u = jnp.ones((N, 2))
    for jit in (False, True):
        grad = jax.grad(f, (0, 1, 2))
        g = (jax.jit(grad) if jit else grad)(w, x, u)
        np.testing.assert_allclose(g[0], x.sum((0, 1)), rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(g[2], np.zeros_like(u))
    _, t = jax.jvp(f, (w, x, u), (jnp.zeros_like(w), x, u))
    np.testing.assert_allclose(t, jnp.einsum("nij,j->", x, w), rtol=1e-5)


def test_dce_prunes_map_outputs_and_body():
    @fcir.program(placements=CLIENTS)
    def f(w, x):
        a, b = fcir.map_fn(lambda w, x: (jnp.sum(x @ w), jnp.sin(x).sum()), (fcir.broadcast(w), x))
        c = fcir.map_fn(lambda w: w * 2.0, fcir.broadcast(w))  # body ignores nothing
        return fcir.reduce_sum(a), fcir.reduce_sum(b), fcir.reduce_sum(c)

    w, x = remat_body_args()
    jaxpr = jax.make_jaxpr(f)(w, x).jaxpr
    new, used = pe.dce_jaxpr(jaxpr, [True, False, False])
    maps = [e for e in new.eqns if e.primitive is map_p]
    assert len(maps) == 1 and len(maps[0].outvars) == 1
    body = maps[0].params["body"].jaxpr
    assert "sin" not in str(body) and len(body.outvars) == 1
    assert used == [True, True]
    # Only x is needed by the surviving output: the map keeps one operand.
    new, used = pe.dce_jaxpr(jaxpr, [False, True, False])
    (m,) = [e for e in new.eqns if e.primitive is map_p]
    assert len(m.invars) == 1 and used == [False, True]


def test_partial_eval_jaxpr_nounits_keeps_residuals_placed():
    """The JaxprTrace rule: known map outputs residuals with the member axis; the
    unknown map consumes them; known-then-unknown reproduces the original."""
    p, x, y = fedavg_args()
    w = p["w"]

    @fcir.program(placements=CLIENTS)
    def f(w, x):
        return fcir.map_fn(
            lambda w, x: jnp.tanh(x @ w) * jnp.sum(jnp.cos(x)), (fcir.broadcast(w), x)
        )

    closed = jax.make_jaxpr(f)(w, x)
    known, unknown, out_uk, res_avals = pe.partial_eval_jaxpr_nounits(
        closed, [True, False], instantiate=False
    )
    assert out_uk == [True]
    (kmap,) = [e for e in known.jaxpr.eqns if e.primitive is map_p]
    (umap,) = [e for e in unknown.jaxpr.eqns if e.primitive is map_p]
    assert all(v.aval.shape[0] == N for v in kmap.outvars)  # residuals placed
    assert "cos" in str(kmap.params["body"]) and "cos" not in str(umap.params["body"])
    res = core.jaxpr_as_fun(known)(x)
    (out,) = core.jaxpr_as_fun(unknown)(*res, w)
    np.testing.assert_allclose(out, f(w, x), rtol=1e-6)


def test_transpose_of_map_keeps_cotangents_placed():
    p, x, y = fedavg_args()
    _, vjp = jax.vjp(
        lambda x: fcir.program(placements=CLIENTS)(
            lambda x: fcir.map_fn(lambda v: jnp.sin(v) * 3.0, x)
        )(x),
        x,
    )
    jaxpr = jax.make_jaxpr(vjp)(jnp.ones_like(x))
    (m,) = [e for e in jaxpr.eqns if e.primitive is map_p]
    assert m.outvars[0].aval.shape == x.shape
    np.testing.assert_allclose(vjp(jnp.ones_like(x))[0], 3 * jnp.cos(x), rtol=1e-6)


def test_body_constants_stay_constants_of_the_linear_region():
    """A body constant the tangent needs is forwarded as a constant of the linear /
    transposed region, never materialised per member or broadcast (both AD paths)."""
    c = np.linspace(0.5, 2.0, 4).astype(np.float32)

    @fcir.program(placements=CLIENTS)
    def f(x):
        return fcir.reduce_sum(fcir.map_fn(lambda v: jnp.sum(jnp.sin(v) * c), x))

    x = jnp.arange(12.0).reshape(N, 4)
    for direct in (True, False):
        with jax_config.use_direct_linearize(direct):
            jaxpr = jax.make_jaxpr(jax.grad(f))(x)
            g = jax.grad(f)(x)
        np.testing.assert_allclose(g, jnp.cos(x) * c, rtol=1e-5, atol=1e-6)
        *_, backward = [e for e in jaxpr.eqns if e.primitive is map_p]
        assert backward.params["body"].consts  # c is a constant of the region
        assert len(backward.invars) == 2  # cos(x) residual (placed) and the cotangent


def test_gradients_capture_and_check():
    """``fcir.capture`` + ``fcir.check`` accept every gradient of this file's programs."""
    for fn, _, make_args, argnums in PROGRAMS.values():
        fcir.check(fcir.capture(jax.grad(_loss(fn), argnums), *make_args()))


# --- finite differences ---------------------------------------------------------------------


@fcir.program(placements=CLIENTS)
def minmax_smooth(w, x):
    v = fcir.map_fn(lambda w, x: jnp.sin(x @ w), (fcir.broadcast(w), x))
    return fcir.reduce_min(v) * 2.0 + fcir.reduce_max(v) ** 2


@fcir.program(placements=CLIENTS)
def weighted_light(w, x, c):
    v = fcir.map_fn(lambda w, x: jnp.tanh(x @ w), (fcir.broadcast(w), x))
    return fcir.reduce_weighted_mean(v, fcir.map_fn(_weight, (c, x)))


@fcir.program(placements=NESTED)
def nested_light(w, x):
    def silo(w, xs):
        return fcir.reduce_mean(fcir.map_fn(lambda w, x: jnp.tanh(x @ w), (fcir.broadcast(w), xs)))

    return fcir.reduce_sum(fcir.map_fn(silo, (fcir.broadcast(w), x)))


FD_PROGRAMS = {
    "remat_body": (remat_body, remat_body_args),
    "minmax_no_ties": (minmax_smooth, lambda: minmax_args(ties=False)),
    "weighted": (weighted_light, lambda: (lambda p, x, y, c: (p["w"], x, c))(*weighted_args())),
    "nested": (nested_light, nested_args),
}


@pytest.mark.parametrize("name", list(FD_PROGRAMS))
def test_finite_differences_order_2(name):
    """check_grads, orders 1 and 2, forward and reverse, in float64 (min/max away from
    ties, where the second derivative is defined)."""
    from jax.test_util import check_grads

    fn, make_args = FD_PROGRAMS[name]
    # Eager (op by op, cached per op): cheaper than compiling every derivative. float32
    # shares the op cache with the other eager tests; central differences with eps=1e-3
    # in float32 are good to ~1e-3 relative, well inside check_grads' tolerance.
    check_grads(fn, make_args(), order=2, modes=("fwd", "rev"), eps=1e-3, atol=1e-2, rtol=1e-2)


# --- DrJAX ----------------------------------------------------------------------------------


def _drjax_local(p, x, y):
    r = jnp.tanh(x @ p["w"] + p["b"]) - y
    return {"w": p["w"] - 0.5 * x.T @ r, "b": p["b"] - 0.5 * jnp.mean(r)}


def _drjax_round(api):
    """One body for both APIs: broadcast, map_fn, reduce_mean/weighted_mean/sum."""

    @api.program(placements={"clients": N})
    def round_(p, x, y, c):
        new = api.map_fn(_drjax_local, (api.broadcast(p), x, y))
        mean = api.reduce_mean(new)
        ws = api.map_fn(_weight, (c, x))
        wmean = api.reduce_weighted_mean(new["w"], ws)
        total = api.reduce_sum(api.map_fn(jnp.dot, (api.broadcast(wmean), x[:, 0])))
        return mean, wmean, total

    return round_


def test_gradient_equals_drjax():
    import drjax

    args = weighted_args()
    g_fcir = jax.grad(_loss(_drjax_round(fcir)), (0, 1, 3))(*args)
    g_drjax = jax.grad(_loss(_drjax_round(drjax)), (0, 1, 3))(*args)
    assert_close(g_fcir, g_drjax)


# --- the meta-learning example --------------------------------------------------------------


def test_meta_learning_example_improves_post_round_loss():
    spec = importlib.util.spec_from_file_location(
        "meta_learning_example", ROOT / "examples" / "meta_learning.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    losses = module.run(num_clients=3, meta_steps=3, examples=6, verbose=False)
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    args = module.EXAMPLE_ARGS["post_round_loss"]()
    jaxpr = jax.make_jaxpr(jax.grad(module.post_round_loss))(*args)
    assert federated_violations(jaxpr) == []


# --- identities on placed values at the server ------------------------------------------------


def test_stop_gradient_of_a_broadcast_model_is_per_member_and_its_gradient_runs_like_jit():
    # FedProx's anchor: the proximal term pulls towards the broadcast model, held fixed.
    from fcir.interpreters import reference, xla

    @fcir.program(placements=CLIENTS)
    def prox_round(w, x):
        at = fcir.broadcast(w)
        anchor = jax.lax.stop_gradient(at)

        def client(w, anchor, x):
            return jnp.sum((x - w) ** 2) + 0.5 * jnp.sum((w - anchor) ** 2)

        return fcir.reduce_mean(fcir.map_fn(client, (at, anchor, x)))

    w = jnp.asarray([0.5, -1.0, 2.0], jnp.float32)
    x = jnp.asarray(np.random.default_rng(2).normal(size=(N, 3)), jnp.float32)
    for fn in (prox_round, jax.grad(prox_round, (0, 1))):
        module = fcir.capture(fcir.program(placements=CLIENTS)(fn), w, x)
        text = module.to_text()
        assert "jax.stop_gradient" not in text or "f32[3]@clients! = jax.stop_gradient" in text
        want = jax.jit(fn)(w, x)
        assert_close(reference.run(module, w, x), want)
        for got, exp in zip(jax.tree.leaves(xla.compile(module)(w, x)), jax.tree.leaves(want)):
            np.testing.assert_array_equal(got, exp)
