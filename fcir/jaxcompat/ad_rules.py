"""Derivative rules fcir pins while capturing, so that a gradient's IR is the same under
every supported JAX.

Two kinds of rule changed after JAX 0.10.2 in ways that change a gradient's equations.

JAX 0.12 (``one_minus_square_p`` tells) rewrote the JVP rules of ``tanh``, ``asin``, ``acos`` and ``atanh`` around a new
primitive, ``one_minus_square`` (``1 - x**2``): JAX 0.10.2 differentiates ``tanh`` to
``(g + g*ans) * (1 - ans)``, JAX 0.12 to ``g * one_minus_square(ans)``. Both are the same
derivative, but a program's gradient then captures to other equations (and other scan
residuals) on each JAX, and IR holding ``one_minus_square`` does not run under 0.10,
which lacks the primitive.

JAX 0.10.2 partially evaluates a ``custom_jvp_call`` whose inputs are unknown by inlining
its primal function (its custom rule is not needed in the linear part of a derivative);
JAX 0.12 keeps the ``custom_jvp_call``. A gradient through a loop that itself computes
a gradient (local SGD inside a round) then keeps ``custom_jvp_call`` in its forward pass
under 0.12 only. fcir's IR omits derivative rules anyway (``#Omitted.derivative_rule``).

While :func:`pinned` is active (capture traces inside it), both follow JAX 0.10.2 on every
JAX, so a gradient traces to JAX 0.10.2's equations.

JAX caches the JVP and the linearization of each jaxpr it differentiates (a ``jit``
inside the program, ``jnp.tanh`` itself): entering and leaving :func:`pinned` clears
those caches, so that a derivative traced earlier with JAX's rules does not leak into a
capture (nor one traced with the pinned rules into later derivatives of other
functions). ``jax.jit(f)`` of the very function ``f`` capture traced reuses JAX's trace
of it, so it computes the pinned derivative too: the same math, bit for bit the IR. Another thread that
differentiates while a capture runs gets the pinned rules: the same derivative.
"""

from __future__ import annotations

import contextlib
import threading

from jax._src import core
from jax._src.interpreters import ad
from jax._src.interpreters import partial_eval as pe
from jax._src.lax import lax as _lax

from fcir.jaxcompat import JAX_VERSION

_LOCK = threading.Lock()
_DEPTH = 0
_SAVED: dict = {}


def _rules_of_jax_0_10() -> dict:
    """primitive -> JAX 0.10.2's ``ad.primitive_jvps`` entry, for the primitives whose
    rule the running JAX changed; empty under JAX 0.10."""
    if not hasattr(_lax, "one_minus_square_p"):
        return {}
    L = _lax
    one, const = L._one, L._const

    def tanh(g, ans, x, accuracy):
        if accuracy is L.AccuracyMode.HIGHEST:  # unchanged in 0.12
            two = L.logistic(L.mul(const(x, 2), x), accuracy=accuracy)
            minus_two = L.logistic(L.mul(const(x, -2), x), accuracy=accuracy)
            return L.mul(g, L.mul(const(x, 4), L.mul(two, minus_two)))
        return L.mul(L.add(g, L.mul(g, ans)), L.sub(one(x), ans))

    def asin(g, x):
        return L.mul(g, L.rsqrt(L.sub(const(x, 1), L.square(x))))

    def acos(g, x):
        return L.mul(g, L.neg(L.rsqrt(L.sub(const(x, 1), L.square(x)))))

    def atanh(g, x):
        return L.mul(L.reciprocal(L.add(one(x), x)), L.div(g, L.sub(one(x), x)))

    rules = {}
    saved = dict(ad.primitive_jvps)
    try:  # ad.defjvp/defjvp2 build the entries; the table is restored right after
        ad.defjvp2(L.tanh_p, tanh)
        ad.defjvp(L.asin_p, asin)
        ad.defjvp(L.acos_p, acos)
        ad.defjvp(L.atanh_p, atanh)
        for p in (L.tanh_p, L.asin_p, L.acos_p, L.atanh_p):
            rules[p] = ad.primitive_jvps[p]
    finally:
        ad.primitive_jvps.clear()
        ad.primitive_jvps.update(saved)
    return rules


_PINNED = _rules_of_jax_0_10()


def _partial_eval_custom_jvp_call_of_jax_0_10(self, prim, fun, jvp, tracers, /, *, symbolic_zeros):
    """``pe.JaxprTrace.process_custom_jvp_call`` of JAX 0.10.2."""
    tracers = [self.to_jaxpr_tracer(t) for t in tracers]
    if all(t.is_known() for t in tracers):
        with core.set_current_trace(self.parent_trace):
            vals = [t.pval[1] for t in tracers]
            return prim.bind(*vals, subfuns=(fun, jvp), symbolic_zeros=symbolic_zeros)
    with core.set_current_trace(self):
        return fun.call_wrapped(*tracers)


# (class, method name, JAX 0.10.2's method) pinned on a newer JAX.
_METHODS = (
    []
    if JAX_VERSION[:2] == (0, 10)
    else [(pe.JaxprTrace, "process_custom_jvp_call", _partial_eval_custom_jvp_call_of_jax_0_10)]
)
_SAVED_METHODS: list = []


def _clear_derivative_caches() -> None:
    for name in ("_jvp_jaxpr", "_linearize_jaxpr"):
        cached = getattr(ad, name, None)
        if cached is not None and hasattr(cached, "cache_clear"):
            cached.cache_clear()


@contextlib.contextmanager
def pinned():
    """Differentiate ``tanh``, ``asin``, ``acos`` and ``atanh`` and partially evaluate
    ``custom_jvp_call`` with JAX 0.10.2's rules inside the block (a no-op under JAX
    0.10). Reentrant."""
    global _DEPTH
    if not _PINNED and not _METHODS:
        yield
        return
    with _LOCK:
        if _DEPTH == 0:
            _SAVED.update({p: ad.primitive_jvps[p] for p in _PINNED})
            ad.primitive_jvps.update(_PINNED)
            for cls, name, method in _METHODS:
                _SAVED_METHODS.append((cls, name, cls.__dict__[name]))
                setattr(cls, name, method)
            _clear_derivative_caches()
        _DEPTH += 1
    try:
        yield
    finally:
        with _LOCK:
            _DEPTH -= 1
            if _DEPTH == 0:
                ad.primitive_jvps.update(_SAVED)
                _SAVED.clear()
                for cls, name, method in _SAVED_METHODS:
                    setattr(cls, name, method)
                _SAVED_METHODS.clear()
                _clear_derivative_caches()


def pins_rules() -> bool:
    """Whether the running JAX's rules differ from the pinned ones (JAX 0.11 on)."""
    return bool(_PINNED or _METHODS)
