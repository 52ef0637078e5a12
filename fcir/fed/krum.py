"""``fed.krum``: the members with the lowest Krum scores (Blanchard et al. 2017), and the
public function ``reduce_krum`` (``m = 1``: that member); ``fed.multi_krum``
(``fcir.fed.multi_krum``) is the mean of the ``m`` chosen members.

A member's score is the sum of its squared L2 distances to its ``n - f - 2`` nearest
other members, as Flower's ``Krum``/``MultiKrum`` strategies compute it (row ``i`` of
the distance matrix sorted, its first entry, the member itself at distance 0,
skipped). ``fed.krum``'s result is the chosen members' values stacked in increasing
score order, ties to the lower member index: ``{fN[s]}@child -> fN[m, s]``. Distances
span the whole member value; the public functions flatten a pytree into one vector per member
first (one ``fed.map``), so the distance covers every leaf, as Flower's covers every
array of an update, and split the result back at the server.

Every sum over a member's coordinates (a distance, a score) adds in a fixed order that
does not depend on how many rows are summed at once (``row_sums``): the streamed
distance matrix, built chunk by chunk, then has the unstreamed one's bits.

Not secure: whoever aggregates sees every member's value (production gathers every
client's value with ``federated_aggregate``; Flower's ServerApp runs
``server_aggregate`` over the replies).

Derivative: the choice is piecewise constant, so the tangent of slot ``j`` is the
tangent of the member chosen there. No member knows its own index, so the rule finds
it by value: member ``i`` passes ``t_i / c_j`` to slot ``j`` when its value equals the
chosen one, ``c_j`` the number of members holding that value (a ``fed.sum``). Equal
members have equal scores, so sharing among them is the order statistics' tie rule.
The ops that choose members or aggregate chosen ones (``fed.multi_krum``,
``fed.bulyan_select``, ``fed.bulyan``) share this module's primitive factory
(``define_gathered``), this rule (``selection_jvp``; ``aggregate_jvp`` for an aggregate
of the chosen), the distances and the pytree helpers (``flatten_members``).
"""

from __future__ import annotations

import numpy as np
from jax.sharding import PartitionSpec

from fcir.ir.types import TensorType
from fcir.opkit import autodiff as AD
from fcir.opkit import primitives as P
from fcir.opkit.sharding import gather_members

from .base import Reduction, public
from .broadcast import broadcast_p
from .map import member_map, member_slices
from .sum import sum_p

__all__ = ["Krum", "krum_p", "reduce_krum"]


def _float(dtype: str) -> bool:
    return dtype.startswith("f") or dtype == "bf16"


def _int_attr(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


# --- the server's computations ------------------------------------------------------------
#
# Self-contained (jnp and numpy, imports inside): the Flower app copies their source with
# the ops' server_aggregate (``server_helpers``), and streaming runs them on the distance
# matrix it builds chunk by chunk (interpreters/xla/streaming_robust.py).


def row_sums(v):
    """The sums over the last axis of ``v`` (``[rows, s]``), each added in an order that
    depends on ``s`` only: lanes accumulated block by block, then folded in halves.
    XLA's own reduction associates a row's adds differently for different numbers of
    rows (measured on CPU for s = 130 and 1000), which would give a distance computed
    for a chunk of members other bits than the same distance computed for all."""
    import jax
    import jax.numpy as jnp

    rows, s = v.shape
    if s == 0:
        return jnp.zeros((rows,), v.dtype)
    lanes = min(128, 1 << (s - 1).bit_length())
    blocks = -(-s // lanes)
    v = jnp.pad(v, ((0, 0), (0, blocks * lanes - s))).reshape(rows, blocks, lanes)
    t = jax.lax.fori_loop(1, blocks, lambda j, t: t + v[:, j], v[:, 0])
    while lanes > 1:
        lanes //= 2
        t = t[:, :lanes] + t[:, lanes:]
    return t[:, 0]


def sq_distances(a, b):
    """``[p, q]``: the squared L2 distances between the rows of ``a`` (``[p, s]``) and of
    ``b`` (``[q, s]``), in float32 or wider; entry ``(i, j)`` has the same bits whatever
    other rows ``a`` and ``b`` hold, and ``(j, i)``'s."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    acc = np.result_type(a.dtype, np.float32)
    b = b.astype(acc)
    return jax.lax.map(lambda row: row_sums(jnp.square(b - row.astype(acc))), a)


def ordered_mean(rows):
    """The mean of ``rows`` (axis 0) in float32 or wider, added one by one from the
    first, rounded to ``rows``' dtype: each coordinate's adds are the same whatever
    other coordinates are averaged beside it (a stream averages them a block at a
    time)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    acc = np.result_type(rows.dtype, np.float32)
    first = rows[0].astype(acc)
    total = jax.lax.fori_loop(1, rows.shape[0], lambda i, t: t + rows[i].astype(acc), first)
    return (total / jnp.asarray(rows.shape[0], acc)).astype(rows.dtype)


def krum_order(d, f, m):
    """The ``m`` members with the lowest Krum scores in the distance matrix ``d``, by
    increasing score (ties to the lower index; a NaN score last)."""
    import jax.numpy as jnp

    n = d.shape[0]
    scores = row_sums(jnp.sort(d, axis=1)[:, 1 : max(1, n - f - 2) + 1])
    return jnp.argsort(scores, stable=True)[:m]


def scores_numpy(x: np.ndarray, q: int) -> np.ndarray:
    n = x.shape[0]
    flat = np.asarray(x).reshape(n, -1).astype(np.result_type(x.dtype, np.float32))
    d = np.stack([np.sum(np.square(flat - row), axis=1) for row in flat])
    return np.sum(np.sort(d, axis=1)[:, 1 : q + 1], axis=1)


def neighbours(n: int, f: int) -> int:
    """How many nearest others a member's score sums over (Flower: at least 1)."""
    return max(1, n - f - 2)


# --- the ops ------------------------------------------------------------------------------


class Krum(Reduction):
    """The ``m`` lowest-Krum-score members, by increasing score:
    ``{fN[s]}@child -> fN[m, s]``. Not secure: the aggregator sees every value."""

    name = "fed.krum"
    attributes = {"f": int, "m": int}
    constraints = {
        **Reduction.constraints,
        "C3": "result must be fN[m, *member shape], local to the current placement",
        "C4": "operand must be a floating-point tensor",
        "C5": "attribute 'f' must be an int >= 0 with n >= f + 3, n the cardinality of the "
        "placement reduced over (each member is scored over its n - f - 2 >= 1 nearest "
        "others)",
        "C6": "attribute 'm' must be an int with 1 <= m <= n",
    }
    server_helpers = (row_sums, sq_distances, krum_order)

    @staticmethod
    def server_aggregate(x, *, f, m):
        """The ``m`` lowest-score replies stacked, as a Flower ServerApp computes them
        (self-contained: the app copies this source and ``server_helpers``')."""
        import jax.numpy as jnp

        flat = x.reshape(x.shape[0], -1)
        return jnp.take(x, krum_order(sq_distances(flat, flat), f, m), axis=0)

    @classmethod
    def choose(cls, d, attrs: dict):
        """The chosen members' indices, in the result's order, from the members'
        squared distances ``d`` (``[n, n]``, ``sq_distances``)."""
        return krum_order(d, attrs["f"], attrs["m"])

    @classmethod
    def from_chosen(cls, chosen, attrs: dict):
        """The op's result from the chosen members' values stacked in that order."""
        return chosen

    @classmethod
    def problem(cls, dtype: str, n: int | None, attrs: dict) -> tuple[str, str] | None:
        """The violated constraint (code, detail) or None: asked while tracing and by
        the checker."""
        if not _float(dtype):
            return "C4", f"operand member dtype {dtype}; cast it (x.astype(jnp.float32)) first"
        f, m = attrs.get("f"), attrs.get("m")
        if not _int_attr(f) or f < 0 or (n is not None and n < f + 3):
            return "C5", f"f={f!r} over {n} members"
        if not _int_attr(m) or m < 1 or (n is not None and m > n):
            return "C6", f"m={m!r} over {n} members"
        return None

    @classmethod
    def result_shape(cls, shape: tuple, attrs: dict, n: int | None = None) -> tuple | None:
        return (attrs["m"], *shape)

    @classmethod
    def verify(cls, op, ctx):
        verify_gathered(cls, op, ctx)

    @classmethod
    def reference(cls, x: np.ndarray, attrs: dict) -> np.ndarray:
        n = x.shape[0]
        s = scores_numpy(x, neighbours(n, attrs["f"]))
        return np.asarray(x)[np.argsort(s, kind="stable")[: attrs["m"]]]


# --- the primitives (shared with fed.multi_krum, fed.bulyan_select and fed.bulyan) --------


def verify_gathered(cls, op, ctx, result_dtype=None) -> None:
    """The type rule of an op over every member's value (``cls``: Krum and its kin,
    ``fed.band_edges``): one operand placed below, tensors for members, the attributes
    ``cls.problem`` allows, and a result of ``cls.result_shape`` (dtype
    ``result_dtype(member dtype)``, by default the member's) local to this placement."""
    from .base import arity

    arity(cls, op, 1, 1)
    t = cls.placed_operand(ctx, op.operands[0], "C2")
    if not isinstance(t.member, TensorType):
        cls.fail("C4", f"operand member type {t.member}")
    n = ctx.cardinality.get(t.placement)
    if not _int_attr(n) or n < 1:
        n = None  # module/C2 reports the cardinality
    found = cls.problem(t.member.dtype, n, op.attrs)
    if found is not None:
        cls.fail(*found)
    shape = cls.result_shape(tuple(t.member.shape), op.attrs, n)
    if shape is None:
        return  # the result's shape needs n, which module/C2 reports
    dtype = t.member.dtype if result_dtype is None else result_dtype(t.member.dtype)
    expected = ctx.local(TensorType(dtype, shape))
    if op.results[0].type != expected:
        cls.fail("C3", f"result {op.results[0].type}, expected {expected}")


def define_gathered(cls, jvp="selection", result_dtype=None):
    """The primitive of ``cls``, an op over every member's value whose impl and
    lowering are its ``server_aggregate`` and whose result shape is
    ``cls.result_shape`` (dtype ``result_dtype(member dtype)``, by default the
    member's): its abstract evaluation raises ``cls``'s constraints; batching unrolls
    the batch axis (a choice per batch element); derivative ``jvp`` (``(prim, primals,
    tangents, **params)``; ``"selection"``: ``selection_jvp``; None: not
    differentiable)."""

    from fcir.ir.types import dtype_name

    def abstract_eval(x, *, placement, n, **attrs):
        member = P.member_aval(x, placement, n, cls.name)
        found = cls.problem(dtype_name(member.dtype), n, attrs)
        if found is not None:
            raise cls.error(*found)
        shape = cls.result_shape(tuple(member.shape), attrs, n)
        from fcir.jaxcompat import core

        dtype = member.dtype if result_dtype is None else result_dtype(member.dtype)
        # At the server, whole: on the operand's mesh (Explicit axes type it), replicated.
        sharding = member.sharding.update(spec=PartitionSpec(*([None] * len(shape))))
        return core.ShapedArray(shape, dtype, sharding=sharding)

    def lower(x, *, placement, n, **attrs):
        # The op's one definition is the copy the Flower app runs (server_aggregate).
        # On Explicit mesh axes the member axis is typed as sharded, and the distances'
        # lax.map refuses to scan over it: the whole op runs on the gathered members.
        del placement, n
        return cls.server_aggregate(gather_members(x), **attrs)

    prim = P.define_primitive(
        f"fed_{cls.name.removeprefix('fed.')}", lower, abstract_eval, unrolled_batch(lambda: prim)
    )
    cls.primitive = prim
    if jvp is None:
        AD.def_jvp_zero(prim)
        return prim
    rule = selection_jvp if jvp == "selection" else jvp

    def prim_jvp(primals, tangents, **params):
        return rule(prim, primals, tangents, **params)

    AD.def_jvp(prim, prim_jvp)
    return prim


def unrolled_batch(primitive):
    """A batching rule that binds ``primitive()`` once per batch element (sliced inside a
    fed.map): these ops couple every entry of a member (a distance over the whole value),
    so a batch axis cannot ride along inside the member."""

    def batch(args, dims, *, placement, n, **attrs):
        import jax.numpy as jnp

        (x,), (d,) = args, dims
        if d == 0:
            x, d = P.moveaxis_to(x, 0, 1), 1
        prim = primitive()
        outs = [
            prim.bind(
                member_slices([x], [d], b, placement, n)[0], placement=placement, n=n, **attrs
            )
            for b in range(x.shape[d])
        ]
        return jnp.stack(outs), 0

    return batch


def _equal_region(rank: int):
    def equal(x, chosen):
        import jax.numpy as jnp

        axes = tuple(range(1, rank + 1))
        return [jnp.all(chosen == x[None], axis=axes).astype(jnp.float32)]

    return equal


def _share_region(rank: int):
    def share(x, chosen, inv_count, t):
        import jax.numpy as jnp

        axes = tuple(range(1, rank + 1))
        hit = jnp.all(chosen == x[None], axis=axes).astype(jnp.float32) * inv_count
        return [hit.reshape(hit.shape + (1,) * rank).astype(t.dtype) * t[None]]

    return share


def selection_jvp(prim, primals, tangents, *, placement, n, **attrs):
    """Chosen members' tangents: slot ``j`` gets ``sum_i [x_i == y_j] t_i / c_j``, all in
    ``fed_map`` regions and ``fed.sum`` (the gradient program stays federated)."""
    import jax.numpy as jnp

    (x,), (t,) = primals, tangents
    y = prim.bind(x, placement=placement, n=n, **attrs)
    if AD.is_zero(t):
        return y, AD.zero_tangent(y)
    kw = {"placement": placement, "n": n}
    rank = x.ndim - 1
    at = broadcast_p.bind(y, **kw)
    (hits,) = member_map(_equal_region, (rank,), placement, n, x, at)
    count = sum_p.bind(hits, **kw)
    # A NaN member equals nothing: its slot keeps a zero tangent.
    inv = jnp.where(count > 0, 1.0 / jnp.maximum(count, 1.0), 0.0).astype(jnp.float32)
    inv_at = broadcast_p.bind(inv, **kw)
    (parts,) = member_map(_share_region, (rank,), placement, n, x, at, inv_at, t)
    return y, sum_p.bind(parts, **kw)


def aggregate_jvp(selection, finish):
    """The derivative of an aggregate of chosen members (``fed.multi_krum``,
    ``fed.bulyan``): ``finish(chosen, **attrs)`` of the chosen members' values that the
    selection primitive ``selection()`` gives, differentiated through ``selection_jvp``
    and JAX's rules for ``finish`` (plain jnp at the server)."""

    def jvp(prim, primals, tangents, *, placement, n, **attrs):
        import jax

        (x,), (t,) = primals, tangents
        ans = prim.bind(x, placement=placement, n=n, **attrs)
        if AD.is_zero(t):
            return ans, AD.zero_tangent(ans)
        chosen, dchosen = selection_jvp(
            selection(), primals, tangents, placement=placement, n=n, **attrs
        )
        _, tangent = jax.jvp(lambda c: finish(c, n=n, **attrs), (chosen,), (dchosen,))
        return ans, tangent

    return jvp


krum_p = define_gathered(Krum)
# --- pytrees: one vector per member -------------------------------------------------------


def _concat_region(dtype: str):
    def concat(*leaves):
        import jax.numpy as jnp

        return [jnp.concatenate([leaf.reshape(-1).astype(dtype) for leaf in leaves])]

    return concat


def flatten_members(x, what: str):
    """``(flat, placement, n, unflatten)``: the placed pytree ``x`` as one placed value
    (a single leaf as it is; several leaves concatenated per member, in their common
    dtype, by one ``fed.map``) and ``unflatten(y, lead)``, which splits a server value
    whose trailing axes are ``flat``'s member shape back into ``x``'s structure, each
    leaf in its own dtype, after ``lead`` leading axes."""
    import jax
    import jax.numpy as jnp

    from fcir.opkit.placement import _check_placed, _current

    frame = _current(what)
    name, n = frame.child(what)
    _check_placed(x, name, n, what)
    leaves, tree = jax.tree_util.tree_flatten(x)
    if not leaves:
        raise _empty(what)
    leaves = [jnp.asarray(leaf) for leaf in leaves]
    if len(leaves) == 1:
        return leaves[0], name, n, lambda y, lead: jax.tree_util.tree_unflatten(tree, [y])
    for leaf in leaves:
        if not jnp.issubdtype(leaf.dtype, jnp.floating):
            raise _not_float(what, leaf.dtype)
    dtype = np.dtype(jnp.result_type(*leaves)).name
    (flat,) = member_map(_concat_region, (dtype,), name, n, *leaves)

    def unflatten(y, lead: int):
        out, start = [], 0
        for leaf in leaves:
            size = int(np.prod(leaf.shape[1:], dtype=int))
            part = y[..., start : start + size].reshape(y.shape[:lead] + leaf.shape[1:])
            out.append(part.astype(leaf.dtype))
            start += size
        return jax.tree_util.tree_unflatten(tree, out)

    return flat, name, n, unflatten


def _empty(what: str):
    from fcir.errors import PlacementError

    return PlacementError(f"{what}: the value has no leaves")


def _not_float(what: str, dtype):
    from fcir.errors import IRTypeError

    return IRTypeError(f"{what}: a leaf has dtype {dtype}; cast it (x.astype(jnp.float32)) first")


def int_arg(what: str, name: str, v) -> int:
    from fcir.errors import PlacementError

    if not _int_attr(v):
        raise PlacementError(f"{what}: {name} must be an int, got {v!r}")
    return int(v)


# --- the public functions -----------------------------------------------------------------


@public
def reduce_krum(x, f: int):
    """The member with the lowest Krum score: ``{T}@child -> T@p``.

    A member's score is the sum of its squared L2 distances, over every leaf of the
    pytree together, to its ``n - f - 2`` nearest other members (Blanchard et al.
    2017; Flower's ``Krum``); ties go to the lower member index. Needs ``n >= f + 3``
    and float leaves. A robust aggregate, not a secure one: whoever aggregates sees
    every member's value. The gradient reaches the chosen member (shared equally
    among members holding exactly its value); the choice itself has none.
    """
    what = "fcir.reduce_krum"
    f = int_arg(what, "f", f)
    flat, name, n, unflatten = flatten_members(x, what)
    y = krum_p.bind(flat, placement=name, n=n, f=f, m=1)
    return unflatten(y[0], 0)
