"""The shared machinery of the federated primitives' automatic differentiation rules.

Importing ``fcir`` registers the rules (each fed op module registers its own). With
them ``jax.jvp``, ``jax.linearize``, ``jax.vjp``/``jax.grad``,
``jax.jacfwd``/``jax.jacrev``/``jax.hessian``, ``jax.checkpoint`` and ``jax.vmap`` of
any of them work on federated programs, under ``jax.jit`` and without it, and the
derivative stays federated.

Design (the "federated-ness" rule every fed op's rule obeys)
------------------------------------------------------------
A rule only ever emits

* fed primitives (``fed.broadcast``, ``fed.map``, ``fed.sum``, ``fed.mean`` ...), and
* local ops that either act on *server* values (the operands of the reductions'
  results, e.g. ``ct / n`` before a broadcast) or act per member *inside a*
  ``fed_map`` *region*.

So a rule never reduces over the member axis with a plain ``jnp`` op and never does
per-member arithmetic at top level. Per-member arithmetic that a rule needs (the
arg-min indicator of ``fed.min``, the weighted-mean tangent) is written as a small
function over one member's values, traced once per member type (cached) and bound as a
``fed_map`` region. The only top-level ops on placed values that can still appear in a
derivative are those JAX's own AD machinery inserts for any primitive: ``add_any``
accumulating the cotangents of a placed value used twice, which is elementwise on
same-shape placed values (member-wise, no cross-member flow).

Where the rules are
-------------------
Each fed op's rules sit in its own module, ``fcir/fed/<op>.py``, next to its
primitive (``fcir.fed.sum``: linear, transposed to ``fed.broadcast``; ``fcir.fed.min``:
the subgradient of ``jnp.min``, shared with ``fed.max``; ``fcir.fed.dp_sum``: the DP
aggregates' rule, shared by the kinds ``dp`` and ``ddp``; ``fcir.fed.map``: the
higher-order JVP, linearization, partial evaluation, DCE, transpose and remat rules).
They register through the functions below (``def_jvp``, ``def_transpose``,
``def_jvp_zero``); this module keeps the machinery every rule shares: symbolic-zero
helpers, ``linear_jvp`` and ``member_map``, the way a rule runs per-member work.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from fcir import jaxcompat as jc
from fcir.jaxcompat import ad, ad_util, core, dtypes

__all__ = [
    "def_jvp",
    "def_jvp_zero",
    "def_transpose",
    "inexact",
    "is_symbolic_zero",
    "is_undefined_primal",
    "is_zero",
    "linear_jvp",
    "trace_region",
    "typed_like",
    "typeof",
    "zero_cotangent",
    "zero_tangent",
]

Zero = ad_util.Zero
typeof = core.typeof


# --- registering a fed op's rules -----------------------------------------------------------


def def_jvp(prim, rule) -> None:
    """Registers ``rule(primals, tangents, **params) -> (out, tangent_out)`` as the JVP
    of ``prim`` (a fed op module registers its primitive's rules next to it)."""
    ad.primitive_jvps[prim] = rule


def def_transpose(prim, rule) -> None:
    """Registers ``rule(ct, *args, **params) -> cotangents`` as the transpose of the
    linear primitive ``prim``."""
    ad.primitive_transposes[prim] = rule


def def_jvp_zero(prim) -> None:
    """``prim`` is not differentiable: its tangent is always a symbolic zero."""
    ad.defjvp_zero(prim)


# --- helpers --------------------------------------------------------------------------------


def is_zero(t) -> bool:
    """True for a symbolic zero or a ``float0`` tangent (the tangent of an int/bool)."""
    if type(t) is Zero:
        return True
    return getattr(core.typeof(t), "dtype", None) == dtypes.float0


def is_symbolic_zero(t) -> bool:
    """True for a symbolic zero (``ad.Zero``) cotangent."""
    return type(t) is Zero


def is_undefined_primal(x) -> bool:
    """True for the linear operand of a transpose rule."""
    return ad.is_undefined_primal(x)


def zero_cotangent(x):
    """The symbolic zero cotangent of the undefined primal ``x``."""
    return Zero(x.aval.to_ct_aval())


def zero_tangent(primal):
    """The symbolic zero tangent of ``primal``."""
    return ad_util.p2tz(primal)


def typed_like(v, aval):
    """``v`` resharded to ``aval``'s sharding where JAX would refuse it in ``aval``'s
    place: on a mesh with ``Explicit`` axes a value's type carries its layout, and a
    cotangent (or an operand mapped with a placed value) must have its primal's (JAX's
    ``typematch``, the check behind "Expected cotangent type f32[8@clients,3] but got
    f32[8,3]"). A rule's broadcast is typed from the server value alone, so its member
    axis need not be laid out like the placed value the rule derives from. Anything
    else, and every value traced without such a mesh, is returned as it is."""
    have = core.typeof(v)
    if core.typematch(have, aval, no_dtype_check=True):
        return v
    want = aval.sharding
    if have.sharding.mesh.empty or want.mesh.empty:
        return v
    concrete = None if isinstance(v, core.Tracer) else getattr(v, "sharding", None)
    if isinstance(concrete, NamedSharding) and isinstance(concrete.mesh, Mesh):
        # Eager (a jax.Array on a concrete mesh): reshard there, with or without a
        # jax.set_mesh around the call.
        want = NamedSharding(concrete.mesh, want.spec)
    return jax.sharding.reshard(v, want)


def inexact(dtype) -> bool:
    return dtypes.issubdtype(dtype, np.inexact)


def linear_jvp(prim):
    """JVP of a primitive linear in its operand: the same primitive on the tangent.
    Integer and bool operands (e.g. the f32 mean of ints) have no tangent."""

    def jvp(primals, tangents, *, placement, n):
        (x,), (t,) = primals, tangents
        y = prim.bind(x, placement=placement, n=n)
        if is_zero(t) or not inexact(core.typeof(x).dtype):
            return y, ad_util.p2tz(y)
        return y, prim.bind(t, placement=placement, n=n)

    return jvp


def trace_region(fn, avals, name: str) -> jc.ClosedJaxpr:
    """Traces ``fn`` over one member's values (``avals``) to a closed region."""
    return jc.trace_closed(fn, avals, f"fcir.{name}")


