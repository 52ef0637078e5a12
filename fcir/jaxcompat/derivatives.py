"""Version-neutral derivatives: what a gradient captures to on every supported JAX.

JAX 0.10.2 differentiates ``tanh`` to ``(g + g*ans) * (1 - ans)``, JAX 0.12 to
``g * one_minus_square(ans)`` (a primitive 0.10 lacks). The two compute different bits,
and ir.md's guarantee 1 wants the IR of a gradient to run bit for bit (and with the same
XLA flops) as the *running* JAX's ``jax.jit``. So while fcir captures (and only then),
``tanh``'s JVP emits fcir's derivative ops instead of JAX's expression:

- ``r = tanh_residual(ans)``: what JAX's rule computes from ``ans = tanh(x)`` alone
  (0.10.2: ``1 - ans``; 0.12: ``one_minus_square(ans)``); it lands where JAX's partial
  evaluation puts it, in the forward pass (a residual);
- ``tanh_tangent(g, ans, r)``: the rest of the rule, linear in ``g``; its transpose is
- ``tanh_cotangent(ct, ans, r)``: ``jax.linear_transpose`` of it, linear in ``ct``.

They print the same under every JAX. What they compute is the running JAX's own rule,
split as JAX's partial evaluation splits it (:func:`_split`): their implementation, XLA
lowering and batching run those very equations, so a compiled module runs the ops
``jax.jit`` of the same function runs, where it runs them, on the same values. (Under
0.12 ``ans`` is one more residual than ``jax.jit`` keeps: no flops, no other bits.)

A derivative of such an op (a gradient of a gradient) would expand it into JAX's
expression at another place than ``jax.jit`` differentiates it, and sum the outer
cotangents in another order; so when that happens capture traces the program again
with the running JAX's own rules (:func:`make_jaxpr`), whose text is then JAX's.

A ``custom_jvp_call`` with unknown inputs is inlined while capturing, as JAX 0.10.2's
partial evaluation does (see :func:`_inline_custom_jvp_call`).

Capture mode is a JAX config state included in JAX's trace context
(:data:`CAPTURE_MODE`): JAX keys its tracing, JVP and linearization caches on that
context, so a trace made while capturing never reuses one JAX made outside (with its
own rules) and vice versa: capture's text does not depend on what JAX traced before
(tests/test_golden_capture_mode.py).
"""

from __future__ import annotations

import contextlib
import functools
import threading

import jax
from jax._src import config, core
from jax._src.interpreters import ad, batching, mlir
from jax._src.lax import lax as _lax

__all__ = [
    "CAPTURE_MODE",
    "OPS",
    "capturing",
    "tanh_cotangent_p",
    "tanh_residual_p",
    "tanh_tangent_p",
]

#: True while fcir captures a program (part of JAX's trace context: see the module doc).
CAPTURE_MODE = config.bool_state(
    name="fcir_capture_mode",
    default=False,
    help="Internal to fcir: set while fcir.capture traces a program, so that derivative "
    "rules emit fcir's version-neutral ops and JAX's trace caches keep those traces apart.",
    include_in_trace_context=True,
)


_STATE = threading.local()


def _expanded() -> None:
    probe = getattr(_STATE, "probe", None)
    if probe is not None and CAPTURE_MODE.value:
        probe.expanded = True


class Probe:
    """What a :func:`capturing` block saw: ``expanded`` is True when a derivative op was
    itself differentiated (or batched over differing axes) and so expanded into the
    running JAX's expression."""

    expanded = False


@contextlib.contextmanager
def capturing():
    """The block traces in capture mode; yields a :class:`Probe` (per thread)."""
    probe, saved = Probe(), getattr(_STATE, "probe", None)
    _STATE.probe = probe
    try:
        with CAPTURE_MODE(True):
            yield probe
    finally:
        _STATE.probe = saved
        if saved is not None and probe.expanded:
            saved.expanded = True


def _jax_tanh_rule():
    """The running JAX's ``tanh`` JVP rule ``rule(g, ans, x, accuracy)`` (registered with
    ``ad.defjvp2``), or None when the table holds something else."""
    entry = ad.primitive_jvps.get(_lax.tanh_p)
    rules = getattr(entry, "args", None)
    if getattr(entry, "func", None) is not ad.standard_jvp2 or not rules or len(rules[0]) != 1:
        return None
    return rules[0][0]


_RULE = _jax_tanh_rule()
_JAX_TANH_JVP = ad.primitive_jvps.get(_lax.tanh_p)


@functools.lru_cache(maxsize=256)
def _split(shape, dtype, weak_type):
    """JAX's rule on arrays of this type split as JAX's partial evaluation splits it
    with ``ans`` known and ``g`` unknown: ``(jaxpr, g, ans, known, unknown, r)``, where
    ``known`` are the equations computing the one residual ``r`` from ``ans`` (they run
    in the forward pass), ``unknown`` those computing the tangent from ``g``, ``ans`` and
    ``r``; None when the rule does not split that way (then capture keeps JAX's rule)."""
    aval = core.ShapedArray(shape, dtype, weak_type=weak_type)
    closed = jax.make_jaxpr(lambda g, ans: _RULE(g, ans, ans, None))(aval, aval)
    jaxpr = closed.jaxpr
    g, ans = jaxpr.invars
    if closed.consts or jaxpr.constvars or len(jaxpr.outvars) != 1:
        return None
    tainted, known, unknown = {g}, [], []
    for eqn in jaxpr.eqns:
        if any(isinstance(v, core.Var) and v in tainted for v in eqn.invars):
            tainted.update(eqn.outvars)
            unknown.append(eqn)
        else:
            known.append(eqn)
    produced = {v for e in known for v in e.outvars}
    residuals = {v for e in unknown for v in e.invars if isinstance(v, core.Var) and v in produced}
    out = jaxpr.outvars[0]
    if len(residuals) != 1 or not isinstance(out, core.Var) or out not in tainted:
        return None
    return g, ans, tuple(known), tuple(unknown), residuals.pop(), out


def _run(eqns, env):
    def read(v):
        return v.val if isinstance(v, core.Literal) else env[v]

    for eqn in eqns:
        outs = eqn.primitive.bind(*map(read, eqn.invars), **eqn.params)
        env.update(zip(eqn.outvars, outs if eqn.primitive.multiple_results else [outs]))
    return env


def _parts(x):
    return _split(tuple(x.shape), x.dtype, bool(getattr(core.typeof(x), "weak_type", False)))


def _residual(ans):
    """What JAX's rule computes from ``ans`` alone (0.10.2: ``1 - ans``; 0.12:
    ``one_minus_square(ans)``)."""
    _, a, known, _, r, _ = _parts(ans)
    return _run(known, {a: ans})[r]


def _tangent(g, ans, r):
    """JAX's tangent of ``tanh`` (default accuracy) from ``g``, ``ans`` and the residual;
    ``ans`` stands for ``x`` in the rule, which only takes constants of its dtype from it."""
    gv, a, _, unknown, rv, out = _parts(ans)
    return _run(unknown, {gv: g, a: ans, rv: r})[out]


def _cotangent(ct, ans, r):
    aval = jax.ShapeDtypeStruct(ans.shape, ans.dtype)
    (out,) = jax.linear_transpose(lambda g: _tangent(g, ans, r), aval)(ct)
    return out


def _elementwise_aval(*avals):
    first = avals[0]
    if any(a.shape != first.shape or a.dtype != first.dtype for a in avals):
        raise TypeError(
            "tanh_residual/tanh_tangent/tanh_cotangent take arrays of one type, got "
            + ", ".join(a.str_short() for a in avals)
        )
    return core.ShapedArray(first.shape, first.dtype, weak_type=all(a.weak_type for a in avals))


def _define(name: str, expression):
    prim = core.Primitive(name)
    prim.def_impl(expression)
    prim.def_abstract_eval(_elementwise_aval)
    mlir.register_lowering(prim, mlir.lower_fun(expression, multiple_results=False))

    def batch(args, dims):
        if dims[0] is not None and all(d == dims[0] for d in dims):
            return prim.bind(*args), dims[0]  # elementwise: the same op on the batch
        # Otherwise JAX's expression, batched as JAX batches it (so no broadcast of an
        # unbatched operand, and the flops of ``jax.vmap`` of JAX's derivative).
        _expanded()
        return jax.vmap(expression, in_axes=tuple(dims))(*args), 0  # unmapped: None

    batching.primitive_batchers[prim] = batch

    def jvp(primals, tangents):
        _expanded()
        tangents = [ad.instantiate_zeros(t) for t in tangents]
        return jax.jvp(expression, tuple(primals), tuple(tangents))

    ad.primitive_jvps[prim] = jvp
    return prim


tanh_residual_p = _define("tanh_residual", _residual)
tanh_tangent_p = _define("tanh_tangent", _tangent)
tanh_cotangent_p = _define("tanh_cotangent", _cotangent)


def _transpose(into):
    def rule(ct, a, ans, r):
        if ad.is_undefined_primal(ans) or ad.is_undefined_primal(r):
            raise ValueError(f"{into.name}: transposed in an operand it is not linear in")
        if type(ct) is ad.Zero:
            return [None, None, None]
        return [into.bind(ct, ans, r), None, None]

    return rule


ad.primitive_transposes[tanh_tangent_p] = _transpose(tanh_cotangent_p)
ad.primitive_transposes[tanh_cotangent_p] = _transpose(tanh_tangent_p)


def _tanh_jvp(primals, tangents, **params):
    (x,), (g,) = primals, tangents
    if (
        not CAPTURE_MODE.value
        or type(g) is ad.Zero
        or params.get("accuracy") is not None
        or not jax.numpy.issubdtype(x.dtype, jax.numpy.floating)
        or _parts(x) is None
    ):
        return _JAX_TANH_JVP(primals, tangents, **params)
    ans = _lax.tanh_p.bind(x, **params)
    return ans, tanh_tangent_p.bind(g, ans, tanh_residual_p.bind(ans))


if _RULE is not None:
    ad.primitive_jvps[_lax.tanh_p] = _tanh_jvp

#: fcir's derivative ops: name -> (operands, meaning), for docs/ops.md.
OPS = {
    "tanh_residual": (
        "ans",
        "what the running JAX's tanh JVP rule computes from ans = tanh(x) alone, in the "
        "forward pass (JAX 0.10.2: 1 - ans; 0.12: one_minus_square(ans))",
    ),
    "tanh_tangent": (
        "g, ans, r",
        "tanh's tangent g * tanh'(x), given ans = tanh(x) and r = tanh_residual(ans): "
        "the rest of the running JAX's rule (capture's version-neutral form of it)",
    ),
    "tanh_cotangent": (
        "ct, ans, r",
        "the transpose of tanh_tangent in g: jax.linear_transpose of the running JAX's rule",
    ),
}


def make_jaxpr(fn, *args, **kwargs):
    """``jax.make_jaxpr(fn, return_shape=True)(*args, **kwargs)`` as capture traces it: in
    capture mode, so that first derivatives of ``tanh`` are fcir's derivative ops. When
    one of those was itself differentiated (a gradient of a gradient), the expansion
    would accumulate the outer cotangents in another order than ``jax.jit`` of ``fn``
    (other bits), so ``fn`` is traced again with the running JAX's own rules."""
    with capturing() as probe:
        out = jax.make_jaxpr(fn, return_shape=True)(*args, **kwargs)
    if not probe.expanded:
        return out
    return jax.make_jaxpr(fn, return_shape=True)(*args, **kwargs)


# JAX 0.10.2 partially evaluates a custom_jvp_call with unknown inputs by inlining its
# primal function (the custom rule has been applied already: the call is in the linear
# part of a derivative); JAX 0.11 on keeps the call. Its XLA lowering inlines the called
# function either way (the same HLO), and fcir's IR omits the rule
# (#Omitted.derivative_rule), so while capturing fcir follows 0.10.2 on every JAX.
def _inline_custom_jvp_call(jax_method):
    def process_custom_jvp_call(self, prim, fun, jvp, tracers, /, *, symbolic_zeros):
        if not CAPTURE_MODE.value:
            return jax_method(self, prim, fun, jvp, tracers, symbolic_zeros=symbolic_zeros)
        tracers = [self.to_jaxpr_tracer(t) for t in tracers]
        if all(t.is_known() for t in tracers):
            with core.set_current_trace(self.parent_trace):
                vals = [t.pval[1] for t in tracers]
                return prim.bind(*vals, subfuns=(fun, jvp), symbolic_zeros=symbolic_zeros)
        with core.set_current_trace(self):
            return fun.call_wrapped(*tracers)

    return process_custom_jvp_call


if tuple(int(p) for p in jax.__version__.split(".")[:2]) >= (0, 11):
    from jax._src.interpreters import partial_eval as _pe

    _pe.JaxprTrace.process_custom_jvp_call = _inline_custom_jvp_call(
        _pe.JaxprTrace.process_custom_jvp_call
    )
