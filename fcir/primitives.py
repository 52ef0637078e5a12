"""The federated JAX primitives: broadcast, map and the reductions.

Each primitive carries its placement name and cardinality as params, so a jaxpr is
self-describing and two programs with different placements never share state. Rules
for a primitive sit next to it: abstract eval, impl, lowering, batching. Automatic
differentiation rules live in ``fcir.autodiff`` (registered on import of ``fcir``).

Conventions: a value placed at a placement of cardinality ``n`` is an array whose
leading axis has size ``n`` (the member axis). Reductions remove that axis.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, PartitionSpec

from fcir.errors import IRTypeError, PlacementError
from fcir.jaxcompat import batching, core, mlir

__all__ = [
    "broadcast_p",
    "map_p",
    "sum_p",
    "mean_p",
    "min_p",
    "max_p",
    "weighted_mean_p",
    "secure_sum_p",
    "dp_sum_p",
    "dp_mean_p",
    "clip_member",
    "dp_noise",
    "REDUCTIONS",
    "FEDERATED_PRIMITIVES",
    "mean_result_dtype",
]


def _placed_aval(aval: core.ShapedArray, n: int, member_axis=None, mesh=None):
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


def _member_aval(aval: core.ShapedArray, placement: str, n: int, what: str):
    if aval.ndim == 0 or aval.shape[0] != n:
        raise PlacementError(
            f"{what}: operand of shape {tuple(aval.shape)} is not placed at '{placement}': "
            f"its leading (member) axis must have size {n}, the cardinality of '{placement}'"
        )
    spec = PartitionSpec(*aval.sharding.spec[1:])
    return aval.update(shape=aval.shape[1:], sharding=aval.sharding.update(spec=spec))


def _explicit_member_axis(aval: core.ShapedArray, placement: str):
    """The mesh axis a broadcast's member axis is typed as sharded on: ``placement``
    if the operand's mesh has an ``Explicit`` axis of that name not already used by
    the operand, else None (replicated; the frontend's constraint does the rest)."""
    mesh = aval.sharding.mesh
    if placement not in mesh.axis_names:
        return None
    if mesh.axis_types[mesh.axis_names.index(placement)] != AxisType.Explicit:
        return None
    used = {a for e in aval.sharding.spec for a in (e if isinstance(e, tuple) else (e,))}
    return None if placement in used else placement


def _moveaxis_to(x, src, dst):
    return x if src == dst else jnp.moveaxis(x, src, dst)


# --- fed.broadcast --------------------------------------------------------------------------

broadcast_p = core.Primitive("fed_broadcast")


def _broadcast_impl(x, *, placement, n):
    del placement
    x = jnp.asarray(x)
    return jnp.broadcast_to(x[None], (n, *x.shape))


def _broadcast_abstract_eval(x, *, placement, n):
    return _placed_aval(x, n, _explicit_member_axis(x, placement))


def _broadcast_batch(args, dims, *, placement, n):
    (x,), (d,) = args, dims
    return broadcast_p.bind(x, placement=placement, n=n), d + 1


broadcast_p.def_impl(_broadcast_impl)
broadcast_p.def_abstract_eval(_broadcast_abstract_eval)
mlir.register_lowering(broadcast_p, mlir.lower_fun(_broadcast_impl, multiple_results=False))
batching.primitive_batchers[broadcast_p] = _broadcast_batch


# --- reductions -----------------------------------------------------------------------------


def mean_result_dtype(dtype) -> np.dtype:
    """``reduce_mean`` of ints and bools is float32 (its declared type and its value)."""
    dtype = np.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.inexact):
        return dtype
    return np.dtype(np.float32)


def _make_reduction(name: str, impl, result_dtype=None):
    prim = core.Primitive(name)

    def abstract_eval(x, *, placement, n):
        member = _member_aval(x, placement, n, f"fed.{name.removeprefix('fed_')}")
        if result_dtype is not None:
            dt = result_dtype(member.dtype)
            member = member.update(dtype=dt, weak_type=member.weak_type and dt == member.dtype)
        return member

    def batch(args, dims, *, placement, n):
        (x,), (d,) = args, dims
        return prim.bind(_moveaxis_to(x, d, 1), placement=placement, n=n), 0

    def lower_impl(x, *, placement, n):
        del placement, n
        return impl(x)

    prim.def_impl(lower_impl)
    prim.def_abstract_eval(abstract_eval)
    mlir.register_lowering(prim, mlir.lower_fun(lower_impl, multiple_results=False))
    batching.primitive_batchers[prim] = batch
    return prim


def _mean(x):
    dt = mean_result_dtype(x.dtype)
    return jnp.mean(x.astype(dt) if x.dtype != dt else x, axis=0)


def sum_result_dtype(dtype) -> np.dtype:
    """``reduce_sum`` of bools counts them in int32, as ``jnp.sum`` does."""
    dtype = np.dtype(dtype)
    return np.dtype(np.int32) if dtype == np.bool_ else dtype


sum_p = _make_reduction(
    "fed_sum", lambda x: jnp.sum(x, axis=0, dtype=sum_result_dtype(x.dtype)), sum_result_dtype
)
mean_p = _make_reduction("fed_mean", _mean, mean_result_dtype)
min_p = _make_reduction("fed_min", lambda x: jnp.min(x, axis=0))
max_p = _make_reduction("fed_max", lambda x: jnp.max(x, axis=0))


# --- fed.weighted_mean ----------------------------------------------------------------------

weighted_mean_p = core.Primitive("fed_weighted_mean")


def _weighted_mean_impl(x, w, *, placement, n):
    del placement, n
    dt = mean_result_dtype(x.dtype)
    x = x.astype(dt)
    w = w.astype(dt).reshape(w.shape + (1,) * (x.ndim - w.ndim))
    return jnp.sum(x * w, axis=0) / jnp.sum(w, axis=0)


def _weighted_mean_abstract_eval(x, w, *, placement, n):
    member = _member_aval(x, placement, n, "fed.weighted_mean")
    _member_aval(w, placement, n, "fed.weighted_mean (weight)")
    if tuple(x.shape[: w.ndim]) != tuple(w.shape):
        raise IRTypeError(
            f"fed.weighted_mean/C3: weight shape {tuple(w.shape)} must be a prefix of the "
            f"value shape {tuple(x.shape)} (a scalar per member, or one weight per element)"
        )
    if not jnp.issubdtype(w.dtype, jnp.number):
        raise IRTypeError(f"fed.weighted_mean/C4: weight must be numeric, got {w.dtype}")
    return member.update(dtype=mean_result_dtype(x.dtype), weak_type=False)


def _weighted_mean_batch(args, dims, *, placement, n):
    (x, w), (dx, dw) = args, dims
    not_mapped = None  # batching's NotMapped
    if dx is not_mapped:
        size = w.shape[dw]
        x = jnp.broadcast_to(jnp.expand_dims(x, 1), (x.shape[0], size, *x.shape[1:]))
    else:
        x = _moveaxis_to(x, dx, 1)
    if dw is not_mapped:
        # A per-member weight stays a prefix of the value once the batch axis sits at 1
        # only when it is a scalar per member; otherwise broadcast it along the batch.
        if w.ndim > 1:
            w = jnp.broadcast_to(jnp.expand_dims(w, 1), (w.shape[0], x.shape[1], *w.shape[1:]))
    else:
        w = _moveaxis_to(w, dw, 1)
    return weighted_mean_p.bind(x, w, placement=placement, n=n), 0


weighted_mean_p.def_impl(_weighted_mean_impl)
weighted_mean_p.def_abstract_eval(_weighted_mean_abstract_eval)
mlir.register_lowering(
    weighted_mean_p, mlir.lower_fun(_weighted_mean_impl, multiple_results=False)
)
batching.primitive_batchers[weighted_mean_p] = _weighted_mean_batch


# --- fed.secure_sum -------------------------------------------------------------------------

secure_sum_p = core.Primitive("fed_secure_sum")


def _secure_sum_impl(x, *, placement, n, bitwidth):
    del placement, n
    total = jnp.sum(x, axis=0, dtype=x.dtype)
    if bitwidth < np.dtype(x.dtype).itemsize * 8:
        total = jnp.bitwise_and(total, jnp.asarray((1 << bitwidth) - 1, x.dtype))
    return total


def _secure_sum_abstract_eval(x, *, placement, n, bitwidth):
    member = _member_aval(x, placement, n, "fed.secure_sum")
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise IRTypeError(f"fed.secure_sum/C2: operand must be an integer tensor, got {x.dtype}")
    bits = np.dtype(x.dtype).itemsize * 8
    if not 1 <= bitwidth <= bits:
        raise IRTypeError(
            f"fed.secure_sum/C3: bitwidth must be in [1, {bits}] for {x.dtype}, got {bitwidth}"
        )
    return member


def _secure_sum_batch(args, dims, **params):
    (x,), (d,) = args, dims
    return secure_sum_p.bind(_moveaxis_to(x, d, 1), **params), 0


secure_sum_p.def_impl(_secure_sum_impl)
secure_sum_p.def_abstract_eval(_secure_sum_abstract_eval)
mlir.register_lowering(secure_sum_p, mlir.lower_fun(_secure_sum_impl, multiple_results=False))
batching.primitive_batchers[secure_sum_p] = _secure_sum_batch


# --- fed.dp_sum / fed.dp_mean ---------------------------------------------------------------
#
# The Gaussian mechanism over one pytree: operands are the placed leaves of the pytree
# followed by the PRNG key (a value local to the current placement, the server at the
# top). One primitive for the whole pytree, not one per leaf, because the clip norm is
# the global L2 norm over every leaf of a member: the leaves are coupled.


def _norm_dtype(dtypes) -> np.dtype:
    """Accumulation dtype of the squared norm: at least f32 (bf16/f16 leaves would
    overflow or lose the small leaves' contribution), f64 if a leaf is f64."""
    return np.dtype(jnp.result_type(*dtypes, jnp.float32))


def clip_member(leaves, clip_norm: float) -> list:
    """One member's leaves scaled by ``min(1, clip_norm / norm)``, ``norm`` their global
    L2 norm; an all-zero member stays zero (scale 1).

    The ``where`` on the squared norm keeps the gradient finite at zero: sqrt's
    derivative at 0 is infinite, and the untaken branch must not see it.
    """
    acc = _norm_dtype([leaf.dtype for leaf in leaves])
    sq = None
    for leaf in leaves:
        term = jnp.sum(jnp.square(leaf.astype(acc)))
        sq = term if sq is None else sq + term
    positive = sq > 0
    norm = jnp.sqrt(jnp.where(positive, sq, jnp.ones_like(sq)))
    scale = jnp.where(positive, jnp.minimum(jnp.ones_like(sq), clip_norm / norm),
                      jnp.ones_like(sq))
    return [leaf * scale.astype(leaf.dtype) for leaf in leaves]


def dp_noise(key, i: int, shape, dtype, clip_norm: float, noise_multiplier: float):
    """The noise added to leaf ``i``: ``noise_multiplier * clip_norm * N(0, 1)`` drawn
    with ``fold_in(key, i)``, so every leaf gets independent noise from one key."""
    return noise_multiplier * clip_norm * jax.random.normal(
        jax.random.fold_in(key, i), shape, dtype
    )


def _dp_impl(*args, placement, n, clip_norm, noise_multiplier, mean):
    del placement
    *xs, key = args
    clipped = jax.vmap(lambda *m: clip_member(m, clip_norm))(*xs)
    out = []
    for i, c in enumerate(clipped):
        total = jnp.sum(c, axis=0) + dp_noise(
            key, i, c.shape[1:], c.dtype, clip_norm, noise_multiplier
        )
        out.append(total / n if mean else total)
    return out


def _is_key(aval) -> bool:
    if jax.dtypes.issubdtype(aval.dtype, jax.dtypes.prng_key):
        return aval.shape == ()
    return aval.dtype == np.uint32 and aval.shape == (2,)  # a raw (legacy) threefry key


def _dp_abstract_eval(*avals, placement, n, clip_norm, noise_multiplier, mean):
    what = "fed.dp_mean" if mean else "fed.dp_sum"
    *xs, key = avals
    if not xs:
        raise IRTypeError(f"{what}/C1: needs at least one value leaf before the key")
    if not _is_key(key):
        raise IRTypeError(
            f"{what}/C3: the key must be a PRNG key (jax.random.key(...) or a raw uint32[2] "
            f"key), got {key.str_short()}"
        )
    out = []
    for i, x in enumerate(xs):
        member = _member_aval(x, placement, n, f"{what} operand {i}")
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise IRTypeError(
                f"{what}/C4: operand {i} must be a floating-point tensor, got {x.dtype}: "
                "cast it (x.astype(jnp.float32)) before the DP aggregate"
            )
        out.append(member.update(weak_type=False))
    return out


def _dp_batch(prim):
    def batch(args, dims, **params):
        # Unrolled over the batch axis: the clip couples all leaves of one member, so a
        # batch element cannot ride along on the members' axis.
        size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
        per = []
        for b in range(size):
            sliced = [
                a if d is None else jax.lax.index_in_dim(a, b, d, keepdims=False)
                for a, d in zip(args, dims)
            ]
            per.append(prim.bind(*sliced, **params))
        return [jnp.stack(list(outs)) for outs in zip(*per)], [0] * len(per[0])

    return batch


def _make_dp(name: str, mean: bool):
    prim = core.Primitive(name)
    prim.multiple_results = True

    def impl(*args, **params):
        return _dp_impl(*args, mean=mean, **params)

    def abstract_eval(*avals, **params):
        return _dp_abstract_eval(*avals, mean=mean, **params)

    prim.def_impl(impl)
    prim.def_abstract_eval(abstract_eval)
    mlir.register_lowering(prim, mlir.lower_fun(impl, multiple_results=True))
    batching.primitive_batchers[prim] = _dp_batch(prim)
    return prim


dp_sum_p = _make_dp("fed_dp_sum", mean=False)
dp_mean_p = _make_dp("fed_dp_mean", mean=True)


# --- fed.map --------------------------------------------------------------------------------
#
# A higher-order primitive: ``body`` is a ClosedJaxpr over one member's values. Every
# operand is mapped along its leading axis; values closed over from outside are made
# explicit broadcasts by the frontend, so the region only ever sees member values. The
# body stays a sub-jaxpr, so the map boundary survives in the jaxpr (and in the IR).

map_p = core.Primitive("fed_map")
map_p.multiple_results = True


def _map_impl(*args, body, placement, n):
    del placement
    return jax.vmap(core.jaxpr_as_fun(body), axis_size=n)(*args)


def _map_abstract_eval(*avals, body, placement, n):
    member_axes = []
    for i, (aval, inner) in enumerate(zip(avals, body.in_avals)):
        member = _member_aval(aval, placement, n, f"fed.map operand {i}")
        if member.shape != inner.shape or member.dtype != inner.dtype:
            raise IRTypeError(
                f"fed.map/C2: operand {i} has member type {member.str_short()} but the region "
                f"expects {inner.str_short()}"
            )
        member_axes.append(aval.sharding.spec[0] if aval.sharding.spec else None)
    # Outputs' member axes are sharded like the operands' (vmap's rule for Explicit axes).
    if len(set(member_axes)) > 1:
        raise PlacementError(
            f"fed.map over '{placement}': operands' member axes are sharded differently "
            f"({', '.join(map(str, member_axes))}); on a mesh with Explicit axes every "
            f"operand's leading axis must be sharded alike: add a mesh axis named "
            f"'{placement}' or reshard the operands"
        )
    member_axis = member_axes[0] if member_axes else None
    mesh = avals[0].sharding.mesh if member_axis is not None else None
    return [_placed_aval(a, n, member_axis, mesh) for a in body.out_avals], body.effects


def _map_batch(axis_data, args, dims, *, body, placement, n):
    not_mapped = None  # batching's NotMapped
    batched = [d is not not_mapped for d in dims]
    args = [a if d is not_mapped else _moveaxis_to(a, d, 1) for a, d in zip(args, dims)]
    new_body, out_batched = batching.batch_jaxpr(body, axis_data, batched, False)
    outs = map_p.bind(*args, body=new_body, placement=placement, n=n)
    return outs, [1 if b else not_mapped for b in out_batched]


map_p.def_impl(_map_impl)
map_p.def_effectful_abstract_eval(_map_abstract_eval)
mlir.register_lowering(map_p, mlir.lower_fun(_map_impl, multiple_results=True))
batching.fancy_primitive_batchers[map_p] = _map_batch


REDUCTIONS = {
    "fed_sum": sum_p,
    "fed_mean": mean_p,
    "fed_min": min_p,
    "fed_max": max_p,
    "fed_weighted_mean": weighted_mean_p,
    "fed_secure_sum": secure_sum_p,
    "fed_dp_sum": dp_sum_p,
    "fed_dp_mean": dp_mean_p,
}
FEDERATED_PRIMITIVES = {"fed_broadcast": broadcast_p, "fed_map": map_p, **REDUCTIONS}
