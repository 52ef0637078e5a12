"""``fed.dp_sum``: the Gaussian mechanism over the members' clipped pytrees.

The kind "dp"'s base module: ``fed.dp_mean`` (``fcir.fed.dp_mean``) and the ``ddp``
ops (``fcir.fed.ddp_sum``) share the derivative here (``dp_jvp``).

One primitive for the whole pytree, not one per leaf, because the clip norm is the
global L2 norm over every leaf of a member: the leaves are coupled. Operands are the
placed leaves followed by the PRNG key (a value local to the current placement).

Derivative: the noise is a constant (it depends on the key only), so the tangent is the
sum of the members' clip tangents: ``fed.sum(map(jvp(clip)))`` (divided by n for the
mean, on the server). The map region is linear in the tangents, so partial evaluation
splits it like weighted_mean's and the VJP is a broadcast followed by a member-wise map
(clipping differentiated per member).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from fcir.errors import IRTypeError, PlacementError
from fcir.ir.types import TensorType
from fcir.jaxcompat import batching, core, mlir
from fcir.jaxcompat import core as _core
from fcir.mechanisms import lattice
from fcir.mechanisms.clipping import clip_member
from fcir.mechanisms.gaussian import dp_noise
from fcir.opkit import autodiff as AD
from fcir.opkit import placement as api
from fcir.opkit import primitives as P

from .base import FedOp, public
from .map import member_map, member_slices
from .sum import sum_p

__all__ = ["DpSum", "define_dp", "define_dp_op", "dp_jvp", "dp_release", "dp_sum", "dp_sum_p",
           "exact_params_of"]



# --- the primitive ------------------------------------------------------------------------


def _impl(*args, placement, n, clip_norm, noise_multiplier, mean, gamma=None):
    del placement
    *xs, key = args
    clipped = jax.vmap(lambda *m: clip_member(m, clip_norm))(*xs)
    if gamma is not None:  # exact mode: integers from the grid on (fcir.mechanisms.lattice)
        p = exact_params(
            n, clip_norm, noise_multiplier, gamma, [x.shape[1:] for x in xs], [x.dtype for x in xs]
        )
        return [
            lattice.release(
                jnp.sum(lattice.to_grid(c, gamma), axis=0, dtype=jnp.int32)
                + lattice.noise(key, i, c.shape[1:], p),
                n,
                mean,
                gamma,
                c.dtype,
            )
            for i, c in enumerate(clipped)
        ]
    out = []
    for i, c in enumerate(clipped):
        total = jnp.sum(c, axis=0) + dp_noise(
            key, i, c.shape[1:], c.dtype, clip_norm, noise_multiplier
        )
        out.append(total / n if mean else total)
    return out


def exact_params(n, clip_norm, noise_multiplier, gamma, shapes, dtypes, what="fed.dp_*"):
    """``fcir.mechanisms.lattice.params`` for an exact-mode op over members of leaf
    ``shapes`` and ``dtypes``."""
    dim = int(sum(int(np.prod(s, dtype=np.int64)) for s in shapes))
    return lattice.params(dim, n, clip_norm, noise_multiplier, gamma, dtypes, what)

def exact_params_of(op, n: int):
    """The lattice parameters (``exact_params``) of an exact-mode ``fed.dp_*`` op of the
    IR whose placement has ``n`` members: its attributes and its members' types."""
    members = [v.type.member for v in op.operands[:-1]]
    a = op.attrs
    return exact_params(
        n,
        a["clip_norm"],
        a["noise_multiplier"],
        a["gamma"],
        [t.shape for t in members],
        [t.np_dtype for t in members],
        op.name,
    )


def _abstract_eval(op, *avals, placement, n, clip_norm, noise_multiplier, mean, gamma=None):
    *xs, key = avals
    if not xs:
        raise op.error("C1", "no value leaf before the key")
    if not P.is_key(key):
        raise op.error(
            "C3", f"got {key.str_short()}; pass jax.random.key(...) or a raw uint32[2] key"
        )
    out = float_members(op, xs, placement, n)
    for i, x in enumerate(xs):
        bound = sum_bound(n, clip_norm, noise_multiplier, x.dtype)
        if bound is not None:
            raise op.error("C7", f"operand {i}: {bound}")
    if gamma is not None:
        try:
            exact_params(
                n,
                clip_norm,
                noise_multiplier,
                gamma,
                [x.shape for x in out],
                [x.dtype for x in out],
                op.name,
            )
        except IRTypeError as e:
            raise op.error("C8", str(e)) from None
    return out


def sum_bound(n, clip_norm: float, noise_multiplier: float, dtype) -> str | None:
    """Why ``n`` members clipped to ``clip_norm`` may sum past ``dtype``'s largest
    finite value (None if they cannot). Each entry of a clipped member is at most
    ``clip_norm``; ``(1 + n u)`` bounds the float error of adding ``n`` of them. An
    overflow before the noise is added is a release the noise does not cover: the sum
    of one cohort is inf, its neighbour's finite (float16: 4 clients of 17000 each
    clipped to 30000 gave inf in every run, 3 of them in 31%). A release without noise
    (``noise_multiplier`` 0) claims no privacy, so nothing is hidden for an overflow to
    reveal: it overflows as ``jnp.sum`` of the same members does."""
    if noise_multiplier == 0:
        return None
    finfo = jnp.finfo(dtype)
    u = float(finfo.eps) / 2
    if n * clip_norm * (1 + n * u) < float(finfo.max):
        return None
    return (
        f"{n} members clipped to {clip_norm} may sum to {n * clip_norm:.4g}, past "
        f"{np.dtype(dtype).name}'s largest value {float(finfo.max):.4g}, before the noise "
        "is added: lower clip_norm or sum in a wider dtype (x.astype(jnp.float32))"
    )


def check_leaves_then_key(cls, op) -> None:
    """C1 of a DP aggregate (central or distributed): value leaves, then one key operand,
    one result per leaf and no regions."""
    k = len(op.operands) - 1
    if k < 1 or len(op.results) != k or op.regions:
        cls.fail(
            "C1",
            f"has {len(op.operands)} operands, {len(op.results)} results, "
            f"{len(op.regions)} regions",
        )


def check_noise_and_values(cls, op, ctx) -> list:
    """C5, then C2, C4 and C6 of each value operand, of a DP aggregate (central or
    distributed): the rules both kinds share. The value operands' placed types, for the
    checks of the op's own."""
    for name in ("clip_norm", "noise_multiplier"):
        a = op.attrs.get(name)
        low_ok = isinstance(a, float) and ((a > 0) if name == "clip_norm" else (a >= 0))
        if not low_ok or not np.isfinite(a):
            cls.fail("C5", f"{name}={a!r}")
    placed = []
    for i, (v, r) in enumerate(zip(op.operands[:-1], op.results)):
        t = cls.placed_operand(ctx, v, "C2")
        if not isinstance(t.member, TensorType) or not DpSum.is_float(t.member.dtype):
            cls.fail("C4", f"operand {i} has member type {t.member}")
        if r.type != ctx.local(t.member):
            cls.fail("C6", f"result {i} is {r.type}, expected {ctx.local(t.member)}")
        placed.append(t)
    return placed


def float_members(op, xs, placement, n) -> list:
    """The member avals of a DP aggregate's value leaves (central or distributed), each
    placed at ``placement`` and floating (C4 otherwise)."""
    out = []
    for i, x in enumerate(xs):
        member = P.member_aval(x, placement, n, f"{op.name} operand {i}")
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise op.error(
                "C4",
                f"operand {i} has dtype {x.dtype}: cast it (x.astype(jnp.float32)) "
                "before the DP aggregate",
            )
        out.append(member.update(weak_type=False))
    return out


# --- the derivative (shared by the kinds "dp" and "ddp") -----------------------------------


def _clip_tangent_region(clip_norm: float, nonzero: tuple[bool, ...]):
    def clip_tangent(*args):
        k = len(nonzero)
        xs, given = list(args[:k]), iter(args[k:])
        ts = [next(given) if nz else jnp.zeros_like(x) for x, nz in zip(xs, nonzero)]
        _, out = jax.jvp(lambda *m: clip_member(m, clip_norm), xs, ts)
        return list(out)

    return clip_tangent


def dp_jvp(prim, mean: bool, primals, tangents, **params):
    """The JVP of a DP aggregate (``fed.dp_*``, ``fed.ddp_*``): the noise (and ddp's
    rounding) is a constant, so the tangent is the sum (mean) of the members' clipped
    tangents. The last operand is the key(s)."""
    *xs, _ = primals
    ys = prim.bind(*primals, **params)
    nonzero = tuple(not AD.is_zero(t) for t in tangents[:-1])
    if not any(nonzero):
        return ys, [AD.zero_tangent(y) for y in ys]
    ts = [t for t, nz in zip(tangents, nonzero) if nz]
    placement, n = params["placement"], params["n"]
    clipped = member_map(
        _clip_tangent_region, (params["clip_norm"], nonzero), placement, n, *xs, *ts
    )
    out = [sum_p.bind(c, placement=placement, n=n) for c in clipped]
    return ys, [o / n for o in out] if mean else out


def define_dp(name: str, impl, abstract_eval, *, compiled: bool = False):
    """A multiple-results DP aggregate primitive for a fed op module (``fed.dp_*``,
    ``fed.ddp_*``): ``impl(*leaves, key(s), placement=..., n=..., **params)`` is its
    eager impl and its lowering, ``abstract_eval(*avals, **params)`` raises the op's
    constraint errors and gives the results' avals; batching unrolls the batch axis.
    ``compiled``: evaluate eagerly through ``jax.jit`` of ``impl`` (``_compiled_per_params``),
    for an impl whose bits cannot depend on it (``fed.ddp_*``: float32 with fixed-order
    sums, then integers; no bf16 intermediate a compiled program could keep wider)."""
    prim = core.Primitive(name)
    prim.multiple_results = True
    prim.def_impl(_compiled_per_params(impl) if compiled else impl)
    prim.def_abstract_eval(abstract_eval)
    mlir.register_lowering(prim, mlir.lower_fun(impl, multiple_results=True))
    batching.primitive_batchers[prim] = _dp_batch(prim)
    return prim


def _compiled_per_params(impl):
    """``impl`` run eagerly as one compiled function per set of op parameters (and, by
    ``jax.jit``, per operand types): the same function the lowering traces, so the
    same bits. Op by op, a DP aggregate dispatches hundreds of small kernels (each
    while loop of the discrete Gaussian sampler compiles afresh), which made one
    reference run of a small ``fed.ddp_sum`` round take seconds."""
    import functools

    @functools.cache
    def compiled(params: tuple):
        return jax.jit(functools.partial(impl, **dict(params)))

    def eager(*args, **params):
        return compiled(tuple(sorted(params.items())))(*args)

    return eager


def _dp_batch(prim):
    def batch(args, dims, **params):
        # Unrolled over the batch axis: the clip couples all leaves of one member, so a
        # batch element cannot ride along on the members' axis.
        # The placed leaves are sliced member by member (inside a fed.map, so that no op
        # at the server reads them); the key, where the result lives, directly.
        size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
        *xs, key = args
        *xdims, kdim = dims
        xs = [x if d is None or d > 0 else P.moveaxis_to(x, 0, 1) for x, d in zip(xs, xdims)]
        xdims = [d if d is None or d > 0 else 1 for d in xdims]
        per = []
        for b in range(size):
            sliced = member_slices(xs, xdims, b, params["placement"], params["n"])
            k = key if kdim is None else jax.lax.index_in_dim(key, b, kdim, keepdims=False)
            per.append(prim.bind(*sliced, k, **params))
        return [jnp.stack(list(outs)) for outs in zip(*per)], [0] * len(per[0])

    return batch


def define_dp_op(op: type[FedOp], mean: bool):
    """The primitive of ``op`` (``fed.dp_sum`` or, with ``mean``, ``fed.dp_mean``) with
    its derivative, set as ``op.primitive``."""
    import functools

    def impl(*args, **params):
        return _impl(*args, mean=mean, **params)

    def abstract_eval(*avals, **params):
        return _abstract_eval(op, *avals, mean=mean, **params)

    prim = define_dp("fed_" + op.name.removeprefix("fed."), impl, abstract_eval)
    AD.def_jvp(prim, functools.partial(dp_jvp, prim, mean))
    op.primitive = prim
    return prim


class DpSum(FedOp):
    """Differentially private sum of a pytree: each member's leaves are clipped to global
    L2 norm ``clip_norm``, summed, and Gaussian noise of std ``noise_multiplier *
    clip_norm`` is added where the result lives:
    ``({T1}@child, ..., {Tk}@child, K) -> (T1, ..., Tk)``, ``K`` a PRNG key local to
    the current placement. Leaf ``i``'s noise is drawn with ``fold_in(key, i)``."""

    name = "fed.dp_sum"
    kind = "dp"
    multiple_results = True
    attributes = {"clip_norm": float, "noise_multiplier": float}
    # Exact mode (fcir.mechanisms.lattice): the grid step, present only when set.
    optional_attributes = {"gamma": float}
    constraints = {
        "C1": "takes k >= 1 value operands followed by one key operand, and gives k results",
        "C2": "value operands must be placed at the placement directly below the current one",
        "C3": "the last operand must be a PRNG key (key<...>[] or u32[2]) local to the "
        "current placement",
        "C4": "value operands must be floating-point tensors",
        "C5": "attribute 'clip_norm' must be a finite float > 0 and 'noise_multiplier' a "
        "finite float >= 0",
        "C6": "result i must be operand i's member type, local to the current placement",
        "C7": "with noise_multiplier > 0, n * clip_norm must stay below each operand "
        "dtype's largest finite value (the clipped sum may not overflow before the noise "
        "is added)",
        "C8": "attribute 'gamma', when present (exact mode), must be a power of two with "
        "which every release k * gamma is a lattice point of each operand's dtype: "
        "|k| <= 2**24 and |k| * gamma finite (fcir.mechanisms.lattice.params)",
    }
    placement_constraints = frozenset({"C2", "C3"})

    @staticmethod
    def is_key(dtype: str, shape) -> bool:
        return (dtype.startswith("key<") and tuple(shape) == ()) or (
            dtype == "u32" and tuple(shape) == (2,)
        )

    @staticmethod
    def is_float(dtype: str) -> bool:
        return dtype.startswith("f") or dtype == "bf16"

    @classmethod
    def verify(cls, op, ctx):
        check_leaves_then_key(cls, op)
        key = op.operands[-1].type
        member = ctx.member_of_local(key) if ctx.is_local(key) else None
        if not isinstance(member, TensorType) or not cls.is_key(member.dtype, member.shape):
            cls.fail("C3", f"key operand has type {key}")
        members = check_noise_and_values(cls, op, ctx)
        for i, t in enumerate(members):
            n = ctx.cardinality.get(t.placement)
            if isinstance(n, int) and not isinstance(n, bool) and n >= 1:
                bound = sum_bound(
                    n, op.attrs["clip_norm"], op.attrs["noise_multiplier"], t.member.np_dtype
                )
                if bound is not None:
                    cls.fail("C7", f"operand {i}: {bound}")
        if "gamma" in op.attrs:
            n = ctx.cardinality.get(members[0].placement)
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                n = 1
            try:
                exact_params(
                    n,
                    op.attrs["clip_norm"],
                    op.attrs["noise_multiplier"],
                    op.attrs["gamma"],
                    [t.member.shape for t in members],
                    [t.member.np_dtype for t in members],
                    cls.name,
                )
            except IRTypeError as e:
                cls.fail("C8", str(e))


dp_sum_p = define_dp_op(DpSum, mean=False)


def dp_release(prim, what: str, x, clip_norm, noise_multiplier, key, exact=False, gamma=None):
    """Binds DP aggregate ``prim`` on placed pytree ``x`` from the public functions
    (``fcir.dp_sum``, ``fcir.dp_mean``), its static attributes checked first; ``exact``
    (with grid step ``gamma``, default ``fcir.mechanisms.lattice.default_gamma``): the
    lattice release of ``fcir.mechanisms.lattice``."""
    frame = api._current(what)
    name, n = frame.child(what)
    clip = api._dp_static(what, "clip_norm", clip_norm, 0.0, True)
    z = api._dp_static(what, "noise_multiplier", noise_multiplier, 0.0, False)
    leaves, tree = api._flatten(x)
    if not leaves:
        raise PlacementError(f"{what}: x has no array leaves")
    api._check_placed(leaves, name, n, what)
    if not isinstance(key, (jax.Array, _core.Tracer)):
        try:
            key = jax.numpy.asarray(key)
        except (TypeError, ValueError):
            raise PlacementError(
                f"{what}: key must be a PRNG key at the server (jax.random.key(seed)), got "
                f"{type(key).__name__}"
            ) from None
    if not isinstance(exact, (bool, np.bool_)):
        raise PlacementError(f"{what}: exact must be True or False, got {exact!r}")
    if gamma is not None and not exact:
        raise PlacementError(f"{what}: gamma is the grid step of exact=True; pass exact=True")
    if exact:
        if gamma is None:
            dim = sum(int(np.prod(np.shape(v)[1:], dtype=np.int64)) for v in leaves)
            gamma = lattice.default_gamma(clip, dim)
        if isinstance(gamma, (int, np.integer, np.floating)) and not isinstance(gamma, bool):
            gamma = float(gamma)
        if not lattice.is_power_of_two(gamma):
            raise PlacementError(f"{what}: gamma must be a power of two, got {gamma!r}")
    out = prim.bind(
        *leaves,
        key,
        placement=name,
        n=n,
        clip_norm=clip,
        noise_multiplier=z,
        gamma=gamma if exact else None,
    )
    return jax.tree_util.tree_unflatten(tree, out)


@public
def dp_sum(x, clip_norm, noise_multiplier, key, *, exact=False, gamma=None):
    """Differentially private sum: ``{T}@child -> T@p`` for a placed pytree ``x``.

    Each member's pytree is scaled by ``min(1, clip_norm / norm)`` (``norm`` its global
    L2 norm over all leaves; a zero member stays zero; ``clip_norm`` less the float
    error of the clip, so the clipped norm is at most ``clip_norm``: docs/privacy.md),
    the clipped members are summed,
    and where the result lives leaf ``i`` gets
    ``noise_multiplier * clip_norm * fcir.mechanisms.gaussian.standard_normal(fold_in(key, i), ...)``.
    ``key`` is a PRNG key at the server (the current placement). ``clip_norm`` and
    ``noise_multiplier`` are Python numbers: they are attributes of the op, read by
    ``fcir.privacy.epsilon``. Gradients treat the noise as a constant.

    ``exact=True``: ε holds for the released bits (``fcir.mechanisms.lattice``): the
    clipped members are rounded to the grid of step ``gamma`` (a power of two; default
    ``fcir.mechanisms.lattice.default_gamma(clip_norm, d)``), summed in integers with
    discrete Gaussian noise, and released as ``k * gamma``. The accountant charges the
    rounding (sensitivity ``clip_norm + sqrt(d) * gamma / 2``) and the sampler's δ.
    """
    return dp_release(dp_sum_p, "fcir.dp_sum", x, clip_norm, noise_multiplier, key, exact, gamma)
