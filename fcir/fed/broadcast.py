"""``fed.broadcast``: a value sent to every member of the placement below.

Derivative: linear. JVP: broadcast the tangent. Transpose: ``fed.sum`` (same placement
and cardinality), so the cotangent of a server value that was broadcast is the
federated sum of the members' cotangents. Registered in ``fcir.fed.sum``, with
``fed.sum``'s own transpose, since each of the two is the other's transpose.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from fcir.errors import PlacementError
from fcir.ir.types import PlacedType
from fcir.jaxcompat import core
from fcir.opkit import autodiff as AD
from fcir.opkit import placement as api
from fcir.opkit import primitives as P
from fcir.opkit import sharding

from .base import FedOp, arity, public

__all__ = ["Broadcast", "broadcast", "broadcast_like", "broadcast_p"]


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


def _impl(x, *, placement, n):
    del placement
    x = jnp.asarray(x)
    return jnp.broadcast_to(x[None], (n, *x.shape))


def _eager_impl(x, *, placement, n):
    """The impl run on concrete arrays (eager ``jax.grad``, whose rules bind this op
    directly): typed as the abstract eval types it. ``jnp.broadcast_to`` alone leaves
    the new member axis replicated where the abstract eval says it is split over an
    ``Explicit`` axis, and JAX refuses such a value as the cotangent or vmapped operand
    of a placed value ("Expected cotangent type f32[8@clients,3] but got f32[8,3]")."""
    out = _impl(x, placement=placement, n=n)
    axis = _explicit_member_axis(core.typeof(x), placement)
    sharding = getattr(x, "sharding", None)
    if axis is None or not isinstance(sharding, NamedSharding):
        return out
    spec = PartitionSpec(axis, *core.typeof(x).sharding.spec)
    # The operand's own (concrete) mesh: no jax.set_mesh needed around the call.
    return jax.sharding.reshard(out, NamedSharding(sharding.mesh, spec))


def _abstract_eval(x, *, placement, n):
    return P.placed_aval(x, n, _explicit_member_axis(x, placement))


def _batch(args, dims, *, placement, n):
    (x,), (d,) = args, dims
    return broadcast_p.bind(x, placement=placement, n=n), d + 1


broadcast_p = P.define_primitive("fed_broadcast", _impl, _abstract_eval, _batch)
broadcast_p.def_impl(_eager_impl)  # lowering keeps _impl: jax.jit's HLO, unchanged
AD.def_jvp(broadcast_p, AD.linear_jvp(broadcast_p))


def broadcast_like(v, like, placement: str, n: int):
    """``fed_broadcast`` of server value ``v`` with its member axis laid out like the
    placed value ``like`` (an array, a tracer or an aval): the broadcast a derivative
    rule binds to meet ``like`` member by member, or as ``like``'s cotangent."""
    aval = like if isinstance(like, core.AbstractValue) else core.typeof(like)
    return AD.typed_like(broadcast_p.bind(v, placement=placement, n=n), aval)


class Broadcast(FedOp):
    """Sends a value to every member of the placement below: ``T@p -> T@child!``."""

    name = "fed.broadcast"
    primitive = broadcast_p
    kind = "broadcast"
    attributes = {"to": str}
    constraints = {
        "C1": "takes one operand and gives one result",
        "C2": "operand must be placed at the parent of the target placement",
        "C3": "attribute 'to' must name the placement directly below the current one",
        "C4": "result type must be T@to! where T is the operand's member type",
    }
    placement_constraints = frozenset({"C2", "C3"})

    @classmethod
    def verify(cls, op, ctx):
        arity(cls, op, 1, 1)
        to = op.attrs.get("to")
        if not isinstance(to, str) or to != ctx.child:
            cls.fail("C3", f"to={to!r}, placement below '{ctx.here}' is {ctx.child!r}")
        x = op.operands[0].type
        if not ctx.is_local(x):
            cls.fail("C2", f"operand type {x} is not local to '{ctx.here}'")
        expected = PlacedType(ctx.member_of_local(x), to, True)
        if op.results[0].type != expected:
            cls.fail("C4", f"result {op.results[0].type}, expected {expected}")

    @classmethod
    def bind(cls, op, args, cardinality, regions=()):
        to = op.attrs["to"]
        return cls.primitive.bind(*args, placement=to, n=cardinality(to))


@public
def broadcast(x, *, to: str | None = None, mesh=None):
    """Sends a value to every member of the placement below: ``T@p -> T@child!``.

    Every leaf of pytree ``x`` gets a new leading axis of size n(child).
    """
    frame = api._current("fcir.broadcast")
    name, n = frame.child("fcir.broadcast")
    if to is not None and to != name:
        raise PlacementError(
            f"fcir.broadcast(to={to!r}): from here values can only be broadcast to '{name}', "
            "the placement directly below; broadcast step by step inside map_fn bodies"
        )
    mesh = frame.mesh if mesh is None else mesh
    leaves, tree = api._flatten(x)
    out = [
        sharding.constrain_broadcast(broadcast_p.bind(leaf, placement=name, n=n), name, mesh)
        for leaf in leaves
    ]
    return jax.tree_util.tree_unflatten(tree, out)
