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

from fcir.errors import PlacementError
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
    "define_dp",
    "is_key",
    "member_aval",
    "clip_member",
    "dp_noise",
    "mean_result_dtype",
    "define_reduction",
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


def define_reduction(name: str, impl, check=None):
    """A reduction primitive with static params of its own, for a fed op module.

    ``impl(x, n=..., **params)`` reduces the member axis (axis 0) of ``x`` with jnp ops
    (it is the primitive's eager impl and its lowering); ``check(member_aval, n=...,
    **params)`` raises the op's constraint errors while tracing. The result has the
    member's shape and dtype. Batching moves the batch axis behind the member axis.
    """
    prim = core.Primitive(name)

    def abstract_eval(x, *, placement, n, **params):
        member = _member_aval(x, placement, n, f"fed.{name.removeprefix('fed_')}")
        if check is not None:
            check(member, n=n, **params)
        return member.update(weak_type=False)

    def batch(args, dims, *, placement, n, **params):
        (x,), (d,) = args, dims
        return prim.bind(_moveaxis_to(x, d, 1), placement=placement, n=n, **params), 0

    def lower_impl(x, *, placement, n, **params):
        del placement
        return impl(x, n=n, **params)

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
    from fcir.fed.weighted_mean import WeightedMean
    from fcir.types import dtype_name

    wdt = dtype_name(w.dtype) if jnp.issubdtype(w.dtype, jnp.number) else "bool"
    found = WeightedMean.problem(x.shape[1:], w.shape[1:], wdt)
    if found is not None:
        raise WeightedMean.error(*found)
    return member.update(dtype=mean_result_dtype(x.dtype), weak_type=False)


def _weighted_mean_batch(args, dims, *, placement, n):
    (x, w), (dx, dw) = args, dims
    not_mapped = None  # batching's NotMapped
    if dx is not_mapped:
        x = _member_repeat(x, w.shape[dw], placement, n)
    else:
        x = _moveaxis_to(x, dx, 1)
    if dw is not_mapped:
        # A per-member weight stays a prefix of the value once the batch axis sits at 1
        # only when it is a scalar per member; otherwise broadcast it along the batch.
        if w.ndim > 1:
            w = _member_repeat(w, x.shape[1], placement, n)
    else:
        w = _moveaxis_to(w, dw, 1)
    return weighted_mean_p.bind(x, w, placement=placement, n=n), 0


def _member_repeat(x, size: int, placement: str, n: int):
    """Each member's value of placed ``x`` repeated ``size`` times along a new axis 1 (a
    batch axis), inside a fed.map: no op at the server reads a placed value."""

    def body(m):
        return [jnp.broadcast_to(jnp.expand_dims(m, 0), (size, *m.shape))]

    closed = jax.make_jaxpr(body)(jax.ShapeDtypeStruct(x.shape[1:], x.dtype))
    (out,) = map_p.bind(x, body=closed, placement=placement, n=n)
    return out


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
    from fcir.fed.secure_sum import SecureSum
    from fcir.types import dtype_name

    found = SecureSum.problem(dtype_name(x.dtype), bitwidth)
    if found is not None:
        raise SecureSum.error(*found)
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
    from fcir.fed import DpMean, DpSum

    op = DpMean if mean else DpSum
    what = op.name
    *xs, key = avals
    if not xs:
        raise op.error("C1", "no value leaf before the key")
    if not _is_key(key):
        raise op.error(
            "C3", f"got {key.str_short()}; pass jax.random.key(...) or a raw uint32[2] key"
        )
    out = []
    for i, x in enumerate(xs):
        member = _member_aval(x, placement, n, f"{what} operand {i}")
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise op.error(
                "C4", f"operand {i} has dtype {x.dtype}: cast it (x.astype(jnp.float32)) "
                "before the DP aggregate"
            )
        out.append(member.update(weak_type=False))
    return out


def _dp_batch(prim):
    def batch(args, dims, **params):
        # Unrolled over the batch axis: the clip couples all leaves of one member, so a
        # batch element cannot ride along on the members' axis.
        # The placed leaves are sliced member by member (inside a fed.map, so that no op
        # at the server reads them); the key, where the result lives, directly.
        size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
        *xs, key = args
        *xdims, kdim = dims
        xs = [x if d is None or d > 0 else _moveaxis_to(x, 0, 1) for x, d in zip(xs, xdims)]
        xdims = [d if d is None or d > 0 else 1 for d in xdims]
        per = []
        for b in range(size):
            sliced = _member_slices(xs, xdims, b, params["placement"], params["n"])
            k = key if kdim is None else jax.lax.index_in_dim(key, b, kdim, keepdims=False)
            per.append(prim.bind(*sliced, k, **params))
        return [jnp.stack(list(outs)) for outs in zip(*per)], [0] * len(per[0])

    return batch


def _member_slices(xs, dims, b: int, placement: str, n: int) -> list:
    """Element ``b`` of the batch axis ``dims[i]`` (>= 1) of each placed ``xs[i]``,
    taken by a fed.map over the members (unbatched leaves as they are)."""
    batched = [i for i, d in enumerate(dims) if d is not None]
    if not batched:
        return list(xs)

    def body(*members):
        return [jax.lax.index_in_dim(m, b, dims[i] - 1, keepdims=False)
                for i, m in zip(batched, members)]

    avals = [jax.ShapeDtypeStruct(xs[i].shape[1:], xs[i].dtype) for i in batched]
    closed = jax.make_jaxpr(body)(*avals)
    outs = map_p.bind(*[xs[i] for i in batched], body=closed, placement=placement, n=n)
    got = list(xs)
    for i, o in zip(batched, outs):
        got[i] = o
    return got


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


def define_dp(name: str, impl, abstract_eval):
    """A multiple-results DP aggregate primitive for a fed op module (``fed.ddp_*``):
    ``impl(*leaves, keys, placement=..., n=..., **params)`` is its eager impl and its
    lowering, ``abstract_eval(*avals, **params)`` raises the op's constraint errors and
    gives the results' avals; batching unrolls the batch axis as for ``fed.dp_*``."""
    prim = core.Primitive(name)
    prim.multiple_results = True
    prim.def_impl(impl)
    prim.def_abstract_eval(abstract_eval)
    mlir.register_lowering(prim, mlir.lower_fun(impl, multiple_results=True))
    batching.primitive_batchers[prim] = _dp_batch(prim)
    return prim


# For fed op modules that define their primitive's abstract evaluation.
member_aval = _member_aval
is_key = _is_key


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
            from fcir.fed import Map

            raise Map.error(
                "C3", f"operand {i} has member type {member.str_short()} but the region "
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
