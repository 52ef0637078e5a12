"""``fed.weighted_mean``: ``sum(w*x)/sum(w)`` over the members.

Derivative: ``y = sum(w x) / W`` with ``W = sum(w)``; nonlinear in ``w``: ``dy =
sum_members(w dx + dw (x - y)) / W``. The bracket is a ``fed_map`` region over ``(w, x,
broadcast(y), dx, dw)``, linear in ``(dx, dw)``; the member sum is ``fed.sum`` and the
division by ``W`` happens on the server. Partial evaluation splits the region into a
known map (residuals ``w``, ``x - y`` stay placed) and a linear map, so the VJP is
``broadcast(ct / W)`` followed by a member-wise map. Integer values or weights
contribute no tangent.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from fcir.errors import PlacementError
from fcir.ir.types import TensorType, dtype_name
from fcir.opkit import autodiff as AD
from fcir.opkit import placement as api
from fcir.opkit import primitives as P

from .base import FedOp, arity, public
from .broadcast import broadcast_like
from .map import map_p, member_map
from .mean import mean_dtype
from .sum import sum_p

__all__ = ["WeightedMean", "reduce_weighted_mean", "weighted_mean_p"]


# --- the primitive ------------------------------------------------------------------------


def _impl(x, w, *, placement, n):
    del placement, n
    dt = P.mean_result_dtype(x.dtype)
    x = x.astype(dt)
    w = w.astype(dt).reshape(w.shape + (1,) * (x.ndim - w.ndim))
    return jnp.sum(x * w, axis=0) / jnp.sum(w, axis=0)


def _abstract_eval(x, w, *, placement, n):
    member = P.member_aval(x, placement, n, "fed.weighted_mean")
    P.member_aval(w, placement, n, "fed.weighted_mean (weight)")
    wdt = dtype_name(w.dtype) if jnp.issubdtype(w.dtype, jnp.number) else "bool"
    found = WeightedMean.problem(x.shape[1:], w.shape[1:], wdt)
    if found is not None:
        raise WeightedMean.error(*found)
    return member.update(dtype=P.mean_result_dtype(x.dtype), weak_type=False)


def _member_repeat(x, size: int, placement: str, n: int):
    """Each member's value of placed ``x`` repeated ``size`` times along a new axis 1 (a
    batch axis), inside a fed.map: no op at the server reads a placed value."""

    def body(m):
        return [jnp.broadcast_to(jnp.expand_dims(m, 0), (size, *m.shape))]

    closed = jax.make_jaxpr(body)(jax.ShapeDtypeStruct(x.shape[1:], x.dtype))
    (out,) = map_p.bind(x, body=closed, placement=placement, n=n)
    return out


def _batch(args, dims, *, placement, n):
    (x, w), (dx, dw) = args, dims
    not_mapped = None  # batching's NotMapped
    if dx is not_mapped:
        x = _member_repeat(x, w.shape[dw], placement, n)
    else:
        x = P.moveaxis_to(x, dx, 1)
    if dw is not_mapped:
        # A per-member weight stays a prefix of the value once the batch axis sits at 1
        # only when it is a scalar per member; otherwise broadcast it along the batch.
        if w.ndim > 1:
            w = _member_repeat(w, x.shape[1], placement, n)
    else:
        w = P.moveaxis_to(w, dw, 1)
    return weighted_mean_p.bind(x, w, placement=placement, n=n), 0


# --- the derivative -----------------------------------------------------------------------


def _weighted_tangent_region(dtype, has_dx: bool, has_dw: bool):
    def weighted_tangent(w, x, y, *ts):
        ts = list(ts)
        dx = ts.pop(0) if has_dx else None
        dw = ts.pop(0) if has_dw else None
        expand = (1,) * (x.ndim - w.ndim)
        out = None
        if has_dx:
            out = w.astype(dtype).reshape(w.shape + expand) * dx
        if has_dw:
            dev = x.astype(dtype) - y
            term = dw.astype(dtype).reshape(w.shape + expand) * dev
            out = term if out is None else out + term
        return [out]

    return weighted_tangent


def _cast_region(dtype):
    def cast(w):
        return [w.astype(dtype)]

    return cast


def _jvp(primals, tangents, *, placement, n):
    (x, w), (dx, dw) = primals, tangents
    y = weighted_mean_p.bind(x, w, placement=placement, n=n)
    x_aval, w_aval = AD.typeof(x), AD.typeof(w)
    has_dx = not AD.is_zero(dx) and AD.inexact(x_aval.dtype)
    has_dw = not AD.is_zero(dw) and AD.inexact(w_aval.dtype)
    if not (has_dx or has_dw):
        return y, AD.zero_tangent(y)
    dt = np.dtype(P.mean_result_dtype(x_aval.dtype))
    # W = sum of the weights (in the result dtype, as the primal computes it).
    w_dt = w if w_aval.dtype == dt else member_map(_cast_region, (dt,), placement, n, w)[0]
    total = sum_p.bind(w_dt, placement=placement, n=n)
    y_at_members = broadcast_like(y, x, placement, n)
    ts = [t for t, has in ((dx, has_dx), (dw, has_dw)) if has]
    (num_members,) = member_map(
        _weighted_tangent_region, (dt, has_dx, has_dw), placement, n, w, x, y_at_members, *ts
    )
    num = sum_p.bind(num_members, placement=placement, n=n)
    total = total.reshape(total.shape + (1,) * (num.ndim - total.ndim))
    return y, num / total


weighted_mean_p = P.define_primitive("fed_weighted_mean", _impl, _abstract_eval, _batch)
AD.def_jvp(weighted_mean_p, _jvp)


class WeightedMean(FedOp):
    """``sum(w*x)/sum(w)`` over members: ``({T}@child, {W}@child) -> T``."""

    name = "fed.weighted_mean"
    primitive = weighted_mean_p
    kind = "reduction"
    constraints = {
        "C1": "takes two operands (values, weights) and gives one result",
        "C2": "values and weights must be placed at the placement directly below the current one",
        "C3": "the weight shape must be a prefix of the value shape (a scalar per member, or "
        "one weight per element)",
        "C4": "weights must be numeric",
        "C5": "result must be the value member type (f32 for integer members), local to the "
        "current placement",
    }
    placement_constraints = frozenset({"C2"})

    @classmethod
    def problem(cls, x_shape, w_shape, w_dtype: str) -> tuple[str, str] | None:
        """The violated constraint for member shapes and the weight dtype (by name), as
        (code, detail), else None; asked while tracing and by the checker."""
        if tuple(x_shape[: len(w_shape)]) != tuple(w_shape):
            return "C3", f"weight shape {tuple(w_shape)}, value shape {tuple(x_shape)}"
        if w_dtype == "bool" or w_dtype.startswith("key<"):
            return "C4", f"weight dtype {w_dtype}"
        return None

    @classmethod
    def verify(cls, op, ctx):
        arity(cls, op, 2, 1)
        x = cls.placed_operand(ctx, op.operands[0], "C2")
        w = cls.placed_operand(ctx, op.operands[1], "C2")
        if not isinstance(x.member, TensorType) or not isinstance(w.member, TensorType):
            cls.fail("C3", "nested placed members are not supported")
        found = cls.problem(x.member.shape, w.member.shape, w.member.dtype)
        if found is not None:
            cls.fail(*found)
        expected = ctx.local(TensorType(mean_dtype(x.member.dtype), x.member.shape))
        if op.results[0].type != expected:
            cls.fail("C5", f"result {op.results[0].type}, expected {expected}")


@public
def reduce_weighted_mean(x, w):
    """Weighted mean ``sum(w*x)/sum(w)``: ``({T}@child, {W}@child) -> T@p``.

    ``w`` is a placed scalar per member (shape ``[n]``) or a pytree matching ``x``.
    A zero total weight is an InterpreterError in the reference interpreter; compiled
    code (jit, the XLA backend) divides by zero there, as jnp.average does: NaN where
    the weighted sum is 0 too (all weights 0), +-inf where it is not (weights such as
    ``[1, -1]`` that cancel).
    """
    what = "fcir.reduce_weighted_mean"
    frame = api._current(what)
    name, n = frame.child(what)
    leaves, tree = api._flatten(x)
    w_leaves, w_tree = api._flatten(w)
    # One weight per member for every leaf: a lone weight array (also for a one-leaf
    # pytree of values, {'loss': x}), or any one-leaf weight for several leaves.
    if len(w_leaves) == 1 and w_tree != tree and (w_tree.num_nodes == 1 or tree.num_leaves != 1):
        w_leaves = w_leaves * len(leaves)
    elif w_tree != tree:
        raise PlacementError(
            f"{what}: weights must be one placed scalar per member or a pytree with the "
            f"structure of the values; got {w_tree} for values {tree}"
        )
    api._check_placed(leaves, name, n, what)
    api._check_placed(w_leaves, name, n, f"{what} (weights)")
    out = [
        weighted_mean_p.bind(leaf, wl, placement=name, n=n) for leaf, wl in zip(leaves, w_leaves)
    ]
    return jax.tree_util.tree_unflatten(tree, out)
