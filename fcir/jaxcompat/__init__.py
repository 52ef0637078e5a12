"""The one JAX boundary: the only fcir code that imports ``jax._src``, ``jax.interpreters``
or ``jax.extend``.

Everything that differs between the supported JAX versions (0.10.2 to 0.12.x) lives here
and nowhere else; tests/jaxcompat/test_jax_boundary.py fails when another module imports JAX's
internals. The rest of fcir imports the names below (``from fcir.jaxcompat import core,
pe``) and the helper functions that paper over signature changes.

What changed between the versions, and how it is handled:

- ``core.ClosedJaxpr`` is gone in 0.12: a ``core.Jaxpr`` carries its constants. Use
  :data:`ClosedJaxpr` for ``isinstance`` checks and annotations, :func:`closed_jaxpr`
  to attach constants and :func:`open_jaxpr` for the bare jaxpr.
- DCE rules take ``(used_outputs, live_inputs, eqn)`` from 0.12 on:
  :func:`register_dce_rule` takes fcir's two-argument rule.
- ``ad.linearize_jaxpr`` returns a FlatTree of forward outputs instead of the number of
  residuals: :func:`linearize_jaxpr` always returns the count.
- ``remat.remat_jaxpr`` and remat rules changed signatures: :func:`remat_jaxpr`,
  :func:`register_remat_rule`.
- Local-op parameters: fcir's IR keeps its own attribute set (docs/ops.md) whatever the
  JAX; :mod:`fcir.jaxcompat.schema` translates both ways.
- Derivative rules: ``tanh``'s JVP changed (0.12's ``one_minus_square``) and 0.12's
  partial evaluation keeps ``custom_jvp_call``; while capturing,
  :mod:`fcir.jaxcompat.derivatives` makes a gradient print the same on every JAX
  without changing what the running JAX computes.
"""

from __future__ import annotations

import functools
import os

import jax
from jax._src import ad_util, api_util, config, core, dtypes, named_sharding, source_info_util
from jax._src import linear_util as lu
from jax._src.interpreters import ad, batching, mlir, remat
from jax._src.interpreters import partial_eval as pe
from jax._src.lax.lax import AccuracyMode, DotAlgorithm, DotAlgorithmPreset, Precision, Tolerance
from jax._src.random import prng
from jax._src.util import merge_lists, partition_list, split_list, weakref_lru_cache

__all__ = [
    "JAX_VERSION",
    "AccuracyMode",
    "ClosedJaxpr",
    "DotAlgorithm",
    "DotAlgorithmPreset",
    "Precision",
    "Tolerance",
    "ad",
    "ad_util",
    "api_util",
    "batching",
    "closed_jaxpr",
    "config",
    "core",
    "debug_info",
    "distributed_client",
    "dtypes",
    "export_serialization_problem",
    "consts_of",
    "is_closed",
    "linearize_jaxpr",
    "lu",
    "merge_lists",
    "mlir",
    "named_sharding",
    "open_jaxpr",
    "partition_list",
    "pe",
    "physical_mesh",
    "prng",
    "register_dce_rule",
    "register_linearization",
    "register_remat_rule",
    "remat",
    "remat_jaxpr",
    "source_info_util",
    "split_list",
    "trace_closed",
    "weakref_lru_cache",
    "with_leading_consts",
]

JAX_VERSION: tuple[int, ...] = tuple(int(p) for p in jax.__version__.split(".")[:3])

# An op's source location (``fcir show --locations``) and an error's "at file.py:12" are
# JAX's innermost user frame of the traceback it records when a primitive is bound.
# A fed op binds its primitive inside fcir (``fcir/fed/mean.py``), so every frame of
# the fcir package is excluded, as JAX excludes its own: the frame found is then the
# user's line that called the op, as it already is for local ops. The separator keeps
# a sibling folder whose name starts with ``fcir`` a user's.
source_info_util.register_exclusion(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
)

# 0.12 merged ClosedJaxpr into Jaxpr (a Jaxpr carries its constants).
_MERGED = not hasattr(core, "ClosedJaxpr")

#: The type of a jaxpr with its constants (``isinstance`` checks, annotations).
ClosedJaxpr = core.Jaxpr if _MERGED else core.ClosedJaxpr


def is_closed(x) -> bool:
    """Whether ``x`` is a jaxpr with its constants (every jaxpr, from JAX 0.12 on)."""
    return isinstance(x, ClosedJaxpr)


def closed_jaxpr(jaxpr, consts):
    """``jaxpr`` (whose leading binders are its constvars) with ``consts`` attached."""
    if _MERGED:
        return core.Jaxpr(jaxpr, list(consts))
    return core.ClosedJaxpr(jaxpr, list(consts))


def open_jaxpr(x):
    """The jaxpr of a closed jaxpr (``x`` itself when it is already open)."""
    return x.jaxpr if isinstance(x, ClosedJaxpr) else x


def consts_of(x) -> list:
    """The constants a (closed) jaxpr carries; none for an open one."""
    return list(x.consts) if isinstance(x, ClosedJaxpr) else []


def with_leading_consts(closed, consts):
    """``closed`` (no constants, taking ``[*consts, *rest]``) with its first
    ``len(consts)`` inputs bound to ``consts``."""
    if _MERGED:
        return closed.with_consts(list(consts))
    new = pe.convert_invars_to_constvars(closed.jaxpr, len(consts))
    return core.ClosedJaxpr(new, list(consts))


def debug_info(name: str, fn, args, kwargs=None):
    return api_util.debug_info(name, fn, tuple(args), kwargs or {})


def trace_closed(fn, avals, name: str):
    """Traces ``fn`` over ``avals`` to a closed jaxpr."""
    dbg = api_util.debug_info(name, fn, tuple(avals), {})
    jaxpr, _, consts = pe.trace_to_jaxpr_dynamic(lu.wrap_init(fn, debug_info=dbg), avals)
    return closed_jaxpr(jaxpr, consts)


def register_dce_rule(prim, rule) -> None:
    """``rule(used_outputs, eqn) -> (used_inputs, new_eqn | None)`` for ``prim``."""
    if _MERGED:
        pe.dce_rules[prim] = lambda used_outputs, live_inputs, eqn: rule(used_outputs, eqn)
    else:
        pe.dce_rules[prim] = rule


def register_linearization(prim, rule) -> None:
    """``rule(is_vjp, nonzeros, *primals, **params) -> (primals_out, nonzeros_out,
    residuals, linearized)`` with ``linearized(residuals, *tangents)``."""
    if not _MERGED:
        ad.primitive_linearizations[prim] = rule
        return

    def new(is_vjp, nonzeros, *primals, **params):
        out, nzs_out, res, linearized = rule(is_vjp, nonzeros, *primals, **params)
        return out, nzs_out, res, None, lambda res, _structured, *t: linearized(res, *t)

    ad.primitive_linearizations[prim] = new


def linearize_jaxpr(jaxpr, nonzeros, *, instantiate=False, allow_fwds=True, is_vjp: bool):
    """``ad.linearize_jaxpr``: ``(primal_jaxpr, num_res, nzs_out, fwds, tangent_jaxpr)``.

    The primal jaxpr returns the primal outputs then ``num_res`` residuals; ``fwds`` maps
    each tangent-jaxpr residual to None (one of those) or a forwarded input index."""
    primal, res, nzs_out, fwds, tangent = ad.linearize_jaxpr(
        jaxpr, nonzeros, instantiate=instantiate, allow_fwds=allow_fwds, is_vjp=is_vjp
    )
    if not isinstance(res, int):
        res = len(primal.out_avals) - len(jaxpr.out_avals)
    return primal, res, nzs_out, fwds, tangent


def remat_jaxpr(ctx, jaxpr):
    """``(fwd, rem, num_res)``: ``fwd`` returns the primal outputs then ``num_res``
    residuals, ``rem`` takes ``[*residuals, *inputs]``. ``ctx`` is what a remat rule
    registered with :func:`register_remat_rule` receives."""
    if _MERGED:
        fwd, rem, fwds = remat.remat_jaxpr(
            jaxpr, ctx.policy, ctx.custom_vjp_rules, allow_fwds=False
        )
        return fwd, rem, len(fwds)
    return remat.remat_jaxpr(jaxpr, ctx)


def register_remat_rule(prim, rule) -> None:
    """``rule(ctx, *args, **params) -> (outs, residuals, rem)``, ``rem(residuals, *args)``
    recomputing ``outs`` (the JAX 0.12 convention, adapted for older JAX)."""
    if _MERGED:
        remat.rules[prim] = rule
        return

    def old(policy, *args, **params):
        outs, res, rem = rule(policy, *args, **params)
        return outs, functools.partial(rem, res)

    remat.rules[prim] = old


def physical_mesh():
    """The mesh of an enclosing ``with mesh:`` block, or None."""
    try:  # not the deprecated ``jax.interpreters.pxla.thread_resources`` alias
        from jax._src.mesh import thread_resources
    except ImportError:  # pragma: no cover - other JAX layouts
        return None
    physical = thread_resources.env.physical_mesh
    return None if physical.empty else physical


def distributed_client():
    """The client of ``jax.distributed.initialize`` (None before it)."""
    from jax._src import distributed  # the documented way is private

    return distributed.global_state.client


def export_serialization_problem() -> str | None:
    """Why ``jax.export`` serialization does not import (it needs flatbuffers), or None."""
    try:
        from jax._src.export import serialization  # noqa: F401
    except ImportError as e:
        return str(e)
    return None


# Installs capture's version-neutral derivative rules (inert outside fcir.capture) and
# defines fcir's derivative primitives, which the backends find by name.
from fcir.jaxcompat import derivatives as derivatives  # noqa: E402
from fcir.jaxcompat import scan_outputs as scan_outputs  # noqa: E402
