"""The generic machinery of the federated JAX primitives.

Each fed op's primitive and its JAX rules (abstract evaluation, impl, lowering,
batching, derivatives) sit in the op's own module, ``fcir/fed/<op>.py``; this module
holds what they share: the placed/member type helpers, the factories that make a
reduction or a DP aggregate primitive (``define_reduction``, ``define_dp``), and the
dtype and DP numerics conventions the backends agree on (``mean_result_dtype``,
``sum_result_dtype``, ``clip_member``, ``dp_noise``). An op's primitive is named by its
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
from fcir.mechanisms.gaussian import standard_normal

__all__ = [
    "clip_member",
    "define_primitive",
    "define_reduction",
    "dp_noise",
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


# --- DP aggregates (kinds "dp" and "ddp": the placed leaves of a pytree, then keys) ------


def _norm_dtype(dtypes) -> np.dtype:
    """Accumulation dtype of the squared norm: at least f32 (bf16/f16 leaves would
    overflow or lose the small leaves' contribution), f64 if a leaf is f64."""
    return np.dtype(jnp.result_type(*dtypes, jnp.float32))


def clip_member(leaves, clip_norm: float) -> list:
    """One member's leaves scaled by ``min(1, c / norm)``, ``norm`` their global L2
    norm; an all-zero member stays zero (scale 1). A member whose squared norm is not
    finite (a NaN or infinite entry, or a norm that overflows) contributes zero: scaling
    would leave NaN exactly where its bad entries are, a noise-free release of them.

    ``c`` is ``clip_norm`` less the float error of computing the norm and scaling
    (:func:`clip_margin`), so that the clipped member's exact norm is at most
    ``clip_norm``: the sensitivity the accountant uses. The squared norm is summed in
    :func:`pairwise_sum`'s fixed order, whose error that margin bounds (``jnp.sum``'s
    order is XLA's choice).

    The ``where`` on the squared norm keeps the gradient finite at zero: sqrt's
    derivative at 0 is infinite, and the untaken branch must not see it.
    """
    acc = _norm_dtype([leaf.dtype for leaf in leaves])
    terms = [pairwise_sum(jnp.square(leaf.astype(acc)).reshape(-1)) for leaf in leaves]
    sq = pairwise_sum(jnp.stack(terms))
    levels = _levels(max(int(np.prod(leaf.shape)) for leaf in leaves)) + _levels(len(leaves))
    finite, scale = clip_scale(sq, clip_norm * (1 - clip_margin(levels, acc)))
    out = []
    for leaf in leaves:
        # Scale in the accumulation dtype, round once to the leaf's; for a leaf narrower
        # than it (bf16, f16) shrink a clipping scale by that rounding's unit roundoff u,
        # so that rounding to nearest cannot lift the norm above clip_norm (bf16 went up
        # to 0.34% above it: a sensitivity above the one accounted).
        u = _unit_roundoff(leaf.dtype, acc)
        s = scale if u == 0 else jnp.where(scale < 1, scale * (1 - u), scale)
        clipped = (leaf.astype(acc) * s).astype(leaf.dtype)
        out.append(jnp.where(finite, clipped, jnp.zeros_like(leaf)))
    return out


def _levels(n: int) -> int:
    """The adds on any one path of :func:`pairwise_sum` over ``n`` terms."""
    return max(int(n) - 1, 0).bit_length()


def clip_margin(levels: int, acc) -> float:
    """The relative amount :func:`clip_member` takes off ``clip_norm``: a bound on the
    float error, in ``acc``, of a squared norm summed with ``levels`` roundings on each
    path (each term's square one more), its square root, the division of the clip by
    it and the scaling of each entry. First order, in units of ``acc``'s unit roundoff:
    ``(levels + 1) / 2`` for the norm, ``1`` each for the sqrt, for rounding the reduced
    clip to ``acc``, for the division and for the product; ``1`` more covers the
    higher-order terms for any ``levels`` below ``2**20``."""
    u = float(jnp.finfo(acc).eps) / 2
    return ((levels + 1) / 2 + 5) * u


def pairwise_sum(x):
    """``sum(x)`` along the last axis in explicit halving passes (an odd last term is
    carried to the next pass): a fixed order of float adds, ``ceil(log2 n)`` on each
    path, whatever the batch or the program around it, where ``jnp.sum`` leaves the
    order to XLA (which picks it by shape and fusion: on jax 0.12 a batch of 3 rows and
    one of 8 sum differently)."""
    if x.shape[-1] == 0:
        return jnp.zeros(x.shape[:-1], x.dtype)
    while x.shape[-1] > 1:
        n = x.shape[-1]
        half = n // 2
        y = x[..., :half] + x[..., half : 2 * half]
        x = y if n % 2 == 0 else jnp.concatenate([y, x[..., 2 * half :]], axis=-1)
    return x[..., 0]


def clip_scale(sq, clip_norm: float):
    """``(finite, scale)`` for squared norms ``sq``: ``scale = min(1, clip_norm / norm)``,
    1 for a zero norm, and ``finite`` False where ``sq`` is NaN or infinite (such a
    member contributes zero). The rule of :func:`clip_member`, shared with
    ``fcir.mechanisms.ddgauss``'s clip, which sums its squares in a fixed order."""
    finite = jnp.isfinite(sq)
    positive = (sq > 0) & finite
    norm = jnp.sqrt(jnp.where(positive, sq, jnp.ones_like(sq)))
    scale = jnp.where(positive, jnp.minimum(jnp.ones_like(sq), clip_norm / norm), jnp.ones_like(sq))
    return finite, scale


def _unit_roundoff(dtype, acc) -> float:
    """Unit roundoff of rounding from ``acc`` to ``dtype``; 0 when ``dtype`` is ``acc``."""
    if np.dtype(dtype) == np.dtype(acc):
        return 0.0
    return float(jnp.finfo(dtype).eps) / 2


def dp_noise(key, i: int, shape, dtype, clip_norm: float, noise_multiplier: float):
    """The noise added to leaf ``i``: ``noise_multiplier * clip_norm * N(0, 1)`` drawn
    with ``fold_in(key, i)``, so every leaf gets independent noise from one key, by
    ``fcir.mechanisms.gaussian.standard_normal`` (tails to 12.95 standard deviations, where
    ``jax.random.normal`` in float32 stops at 5.4).

    A leaf narrower than float32 (bf16, f16) draws in float32 and rounds once: drawn in
    bf16, a normal has 128 values, none beyond 2.9 standard deviations (f16: 3.5), a
    truncated Gaussian whose edge gives away a shift of ``clip_norm`` (at noise
    multiplier 1, with probability 3% per release, against the accountant's δ)."""
    draw = jnp.float32 if jnp.finfo(dtype).bits < 32 else dtype
    normal = standard_normal(jax.random.fold_in(key, i), tuple(shape), np.dtype(draw))
    return (noise_multiplier * clip_norm * normal).astype(dtype)


def is_key(aval) -> bool:
    """A PRNG key aval: ``key<...>[]`` or a raw (legacy) threefry ``uint32[2]``."""
    if jax.dtypes.issubdtype(aval.dtype, jax.dtypes.prng_key):
        return aval.shape == ()
    return aval.dtype == np.uint32 and aval.shape == (2,)
