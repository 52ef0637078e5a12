"""The generic machinery of the federated JAX primitives.

Each fed op's primitive and its JAX rules (abstract evaluation, impl, lowering,
batching, derivatives) sit in the op's own module, ``fcir/fed/<op>.py``; this module
holds what they share: the placed/member type helpers, the factories that make a
reduction or a DP aggregate primitive (``define_reduction``, ``define_dp``), and the
dtype conventions the backends agree on (``mean_result_dtype``, ``sum_result_dtype``;
the DP ops' clipping and noise are ``fcir.mechanisms``'). An op's primitive is named by its
module (``from fcir.fed.<op> import <op>_p``), never here.

Conventions: a value placed at a placement of cardinality ``n`` is an array whose
leading axis has size ``n`` (the member axis). Reductions remove that axis.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from fcir.errors import PlacementError
from fcir.jaxcompat import batching, core, mlir

__all__ = [
    "define_primitive",
    "define_reduction",
    "is_key",
    "mean_result_dtype",
    "member_aval",
    "moveaxis_to",
    "placed_aval",
    "sum_result_dtype",
]


def placed_aval(aval: core.ShapedArray, n: int, member_axis=None, mesh=None):
    """``aval`` with a leading member axis of size ``n``, sharded on ``member_axis`` (an
    axis of ``mesh`` if given, else of ``aval``'s mesh).

    The rest of the sharding (and weak type, memory space, vma) is kept, so values typed
    on a mesh with ``Explicit`` axes keep their layout (DrJAX's rule).
    """
    sharding = aval.sharding
    if member_axis is not None and mesh is not None and sharding.mesh.empty:
        sharding = sharding.update(mesh=mesh)
    sharding = sharding.update(spec=PartitionSpec(member_axis, *sharding.spec))
    return aval.update(shape=(n, *aval.shape), sharding=sharding)


def member_aval(aval: core.ShapedArray, placement: str, n: int, what: str):
    """One member's type of placed ``aval``; a PlacementError when its leading axis is
    not the placement's member axis (``what`` names the operand)."""
    if aval.ndim == 0 or aval.shape[0] != n:
        raise PlacementError(
            f"{what}: operand of shape {tuple(aval.shape)} is not placed at '{placement}': "
            f"its leading (member) axis must have size {n}, the cardinality of '{placement}'"
        )
    spec = PartitionSpec(*aval.sharding.spec[1:])
    return aval.update(shape=aval.shape[1:], sharding=aval.sharding.update(spec=spec))


def moveaxis_to(x, src, dst):
    return x if src == dst else jnp.moveaxis(x, src, dst)


def define_primitive(
    name: str,
    impl,
    abstract_eval,
    batch,
    *,
    multiple_results=False,
    effectful=False,
    fancy_batch=False,
):
    """A fed primitive whose eager impl is also its lowering (``mlir.lower_fun``):
    the one way the op modules make theirs."""
    prim = core.Primitive(name)
    prim.multiple_results = multiple_results
    prim.def_impl(impl)
    if effectful:
        prim.def_effectful_abstract_eval(abstract_eval)
    else:
        prim.def_abstract_eval(abstract_eval)
    mlir.register_lowering(prim, mlir.lower_fun(impl, multiple_results=multiple_results))
    if fancy_batch:
        batching.fancy_primitive_batchers[prim] = batch
    else:
        batching.primitive_batchers[prim] = batch
    return prim


# --- dtype conventions (shared by the backends) ---------------------------------------------


def mean_result_dtype(dtype) -> np.dtype:
    """``reduce_mean`` of ints and bools is float32 (its declared type and its value)."""
    dtype = np.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.inexact):
        return dtype
    return np.dtype(np.float32)


def accumulation_dtype(dtype) -> np.dtype:
    """The dtype a member sum accumulates in: f32 for f16 and bf16 (as ``jnp.sum`` and
    ``jnp.mean`` do; in f16 a partial sum overflows and bf16 drops small terms), else the
    dtype itself."""
    dtype = np.dtype(dtype)
    return np.dtype(np.float32) if dtype in (np.float16, jnp.bfloat16) else dtype


def sum_result_dtype(dtype) -> np.dtype:
    """``reduce_sum`` of bools counts them in int32, as ``jnp.sum`` does."""
    dtype = np.dtype(dtype)
    return np.dtype(np.int32) if dtype == np.bool_ else dtype


# --- reductions (kind "reduction", one operand) ---------------------------------------------


def define_reduction(name: str, impl, check=None, *, result_dtype=None, weak_type=False):
    """A one-operand reduction primitive for a fed op module.

    ``impl(x, n=..., **params)`` reduces the member axis (axis 0) of ``x`` with jnp ops
    (it is the primitive's eager impl and its lowering); ``check(member_aval, n=...,
    **params)`` raises the op's constraint errors while tracing. The result has the
    member's shape and dtype (``result_dtype(dtype)`` when given); it is weakly typed
    only with ``weak_type`` and a weakly typed operand of an unchanged dtype. Batching
    moves the batch axis behind the member axis.
    """
    what = f"fed.{name.removeprefix('fed_')}"

    def abstract_eval(x, *, placement, n, **params):
        member = member_aval(x, placement, n, what)
        if check is not None:
            check(member, n=n, **params)
        dt = member.dtype if result_dtype is None else result_dtype(member.dtype)
        return member.update(
            dtype=dt, weak_type=weak_type and member.weak_type and dt == member.dtype
        )

    def batch(args, dims, *, placement, n, **params):
        (x,), (d,) = args, dims
        return prim.bind(moveaxis_to(x, d, 1), placement=placement, n=n, **params), 0

    def lower_impl(x, *, placement, n, **params):
        del placement
        return impl(x, n=n, **params)

    prim = define_primitive(name, lower_impl, abstract_eval, batch)
    return prim


def is_key(aval) -> bool:
    """A PRNG key aval: ``key<...>[]`` or a raw (legacy) threefry ``uint32[2]``."""
    if jax.dtypes.issubdtype(aval.dtype, jax.dtypes.prng_key):
        return aval.shape == ()
    return aval.dtype == np.uint32 and aval.shape == (2,)
