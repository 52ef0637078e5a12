"""``members="loop"``: each ``fed.map``'s members one after another, in a compiled loop.

``xla.compile(module, members="loop")`` lowers every ``fed.map`` as ``lax.map`` over
its members (a ``while`` loop whose body is one member's region) instead of the
default ``jax.vmap`` of the region over all of them (``members="vmap"``, what
``jax.jit`` of the program does). It is for XLA:CPU and convolutional clients:

- ``jax.vmap`` turns each member's convolution into one grouped convolution with a
  kernel per member; a loop keeps each member's convolution as written.
- XLA:CPU hands a convolution to its fast kernels (Eigen, YNNPACK) only in the
  canonical layout (input NHWC, kernel HWIO, output NHWC), and its
  ``ConvCanonicalization`` pass, which rewrites other convolutions into that layout
  between transposes, visits the entry computation only. A convolution inside a
  ``while`` body (``lax.scan``, ``fori_loop``, ``lax.map``) in any other layout, such as
  the kernel gradient of every convolution (batch and features swapped), is left to
  XLA's generic loop nest: 30-70x slower (``optimized_hlo`` shows it as a
  ``kind=kLoop`` fusion named ``wrapped_convolution``). So this lowering writes every
  convolution of the program in the canonical layout itself (:func:`canonical_conv`:
  the same transposes and convolution that pass would make), wherever it sits.

What it computes: the program with each ``fed.map`` written as ``lax.map`` over the
members and each convolution as :func:`canonical_conv`; ``jax.jit`` of that form gives
the same bits (tests/interpreters/xla/test_xla_members.py), and on the tested programs
so does ``jax.jit`` of the members as a Python loop (unrolled, where XLA's own pass
canonicalizes). It is not ``jax.jit`` of the vmapped program bit for bit (ir.md
guarantee 1 covers the default, ``members="vmap"``): a grouped convolution adds in
another order; the two agree to float rounding.

With ``clients_per_step=k`` the members already stream in a loop, ``k`` at a time
(``streaming``); ``members="loop"`` then adds the canonical convolutions to that loop.
"""

from __future__ import annotations

import functools

import jax
from jax import lax

from fcir import fed as F
from fcir.base_interpreter import impl, jax_primitive
from fcir.errors import InterpreterError
from fcir.fed import FedOp
from fcir.ir import Op, walk
from fcir.jaxcompat import core

from .interpreter import XlaInterpreter
from .streaming import StreamingInterpreter

__all__ = [
    "MEMBERS",
    "LoopInterpreter",
    "canonical_conv",
    "check_members",
    "convolutional_members",
    "interpreter",
]

MEMBERS = ("vmap", "loop", "auto")
CONV = "jax.conv_general_dilated"


def canonical_conv(lhs, rhs, params: dict):
    """``conv_general_dilated_p`` with ``params``, computed in the canonical layout
    (input ``(batch, *spatial, feature)``, kernel ``(*spatial, in, out)``, output
    ``(batch, *spatial, feature)``) between transposes: what XLA:CPU's
    ``ConvCanonicalization`` does to a convolution of the entry computation, done to
    one anywhere. A convolution already canonical is bound as it is."""
    conv = jax_primitive("conv_general_dilated")
    dn = params["dimension_numbers"]
    lhs_spec, rhs_spec, out_spec = dn.lhs_spec, dn.rhs_spec, dn.out_spec
    n = len(lhs_spec)
    identity = tuple(range(n))
    to_nhwc = (0, *range(2, n), 1)  # (batch, feature, *spatial) order -> NHWC
    lhs_perm = tuple(lhs_spec[i] for i in to_nhwc)
    rhs_perm = (*rhs_spec[2:], rhs_spec[1], rhs_spec[0])
    out_perm = tuple(out_spec[i] for i in to_nhwc)
    if lhs_perm == rhs_perm == out_perm == identity:
        return conv.bind(lhs, rhs, **params)
    spatial = tuple(range(1, n - 1))
    canonical = lax.ConvDimensionNumbers(
        lhs_spec=(0, n - 1, *spatial),
        rhs_spec=(n - 1, n - 2, *range(n - 2)),
        out_spec=(0, n - 1, *spatial),
    )
    out = conv.bind(
        lax.transpose(lhs, lhs_perm),
        lax.transpose(rhs, rhs_perm),
        **{**params, "dimension_numbers": canonical},
    )
    # out's axis i is the original output's axis out_perm[i]: invert that permutation.
    inverse = [0] * n
    for i, axis in enumerate(out_perm):
        inverse[axis] = i
    return lax.transpose(out, tuple(inverse))


class CanonicalConvs:
    """Interpreter mixin: every ``jax.conv_general_dilated`` as :func:`canonical_conv`."""

    @impl("jax.conv_general_dilated")
    def conv_general_dilated(self, op: Op, lhs, rhs):
        return canonical_conv(lhs, rhs, self.params(op))


class LoopInterpreter(CanonicalConvs, XlaInterpreter):
    """An :class:`XlaInterpreter` that runs each ``fed.map`` as ``lax.map`` over its
    members, convolutions canonical (module docstring). One device, no mesh."""

    @impl(F.Map)
    def map(self, op: Op, *args):
        body = self.member_jaxpr(op.regions[0], [jax.numpy.asarray(a) for a in args])
        member = core.jaxpr_as_fun(body)
        return list(lax.map(lambda xs: tuple(member(*xs)), tuple(args)))


class _StreamingLoop(CanonicalConvs, StreamingInterpreter):
    """Streamed members (``clients_per_step``) with canonical convolutions."""


def convolutional_members(module) -> bool:
    """Whether a convolution runs inside a ``fed.map`` of ``module`` (at any depth)."""
    for _, op in walk(module.main.body):
        if FedOp.registry.get(op.name) is F.Map:
            if any(inner.name == CONV for r in op.regions for _, inner in walk(r)):
                return True
    return False


def check_members(members, mesh, module=None, where: str = "xla.compile") -> str:
    """``members`` checked and resolved to ``"vmap"`` or ``"loop"``; ``"loop"`` runs on
    one device. ``"auto"``: ``"loop"`` on a CPU backend, without a mesh, when a
    convolution runs inside a ``fed.map`` (measured 1.5-3.9x faster than ``"vmap"`` for
    bench/simulate.py's CNN at cohort 10, bench/README.md); ``"vmap"`` otherwise."""
    if members not in MEMBERS:
        raise InterpreterError(f"{where}: members must be one of {MEMBERS}, got {members!r}")
    if members == "auto":
        cpu = jax.default_backend() == "cpu"
        conv = module is not None and convolutional_members(module)
        return "loop" if cpu and mesh is None and conv else "vmap"
    if members == "loop" and mesh is not None:
        raise InterpreterError(
            f"{where}: members='loop' runs the members one after another on one device; "
            "a mesh shards them over devices instead: pass members='vmap' with a mesh"
        )
    return members


@functools.cache
def interpreter(clients_per_step: int | None = None):
    """The interpreter factory of ``members="loop"`` (one per budget, so executables of
    a module with the same options share a trace)."""
    if clients_per_step is None:
        return LoopInterpreter
    return functools.partial(_StreamingLoop, clients_per_step=clients_per_step)
