"""``fed.member_index``: each member's position in its placement, ``0 .. n - 1``.

``{T}@p -> {i32[]}@p``: the operand names the placement (and, on a mesh, the member
axis's layout); its values are not read. No member can know its own position from the
values it holds, and a derivative that must reach a particular member (one the forward
pass found by sorting: ``fcir.fed.trimmed_mean``'s band edges) finds it by this index
instead of by comparing values that a backward pass recomputes, whose last bits need not
match the forward's (XLA fuses and vectorizes each program its own way; compiled at
optimization level 0 they did not).

Not a public function: the derivative rules bind it. It carries no client data (it is
an iota), so a private program's leak check lets it pass; it sends nothing. A client of
a production or Flower deployment does not know its position among the replies, so the
exports refuse it (a derivative program is not exported: it has a second exchange).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from fcir.ir.types import PlacedType, TensorType
from fcir.jaxcompat import core
from fcir.opkit import autodiff as AD
from fcir.opkit import primitives as P

from .base import FedOp, arity

__all__ = ["MemberIndex", "member_index", "member_index_p"]


def _aval(x, n: int):
    """``i32[n]`` with the member axis laid out as ``x``'s."""
    spec = PartitionSpec(x.sharding.spec[0] if x.sharding.spec else None)
    return core.ShapedArray((n,), jnp.int32, sharding=x.sharding.update(spec=spec))


def _abstract_eval(x, *, placement, n):
    P.member_aval(x, placement, n, MemberIndex.name)
    return _aval(x, n)


def _impl(x, *, placement, n):
    del x, placement
    return jnp.arange(n, dtype=jnp.int32)


def _batch(args, dims, *, placement, n):
    # The position of a member does not depend on what a batch element holds.
    (x,), (d,) = args, dims
    x = P.moveaxis_to(x, d, 1)[:, 0]
    return member_index_p.bind(x, placement=placement, n=n), None


member_index_p = P.define_primitive("fed_member_index", _impl, _abstract_eval, _batch)
AD.def_jvp_zero(member_index_p)


class MemberIndex(FedOp):
    """Each member's position in its placement: ``{T}@p -> {i32[]}@p``."""

    name = "fed.member_index"
    primitive = member_index_p
    kind = "index"
    constraints = {
        "C1": "takes one operand and gives one result",
        "C2": "operand must be placed at the placement directly below the current one",
        "C3": "result must be {i32[]} at the operand's placement",
    }
    placement_constraints = frozenset({"C2"})

    @classmethod
    def verify(cls, op, ctx):
        arity(cls, op, 1, 1)
        t = cls.placed_operand(ctx, op.operands[0], "C2")
        expected = PlacedType(TensorType("i32", ()), t.placement)
        if op.results[0].type != expected:
            cls.fail("C3", f"result {op.results[0].type}, expected {expected}")

    @classmethod
    def reference(cls, x: np.ndarray, attrs: dict) -> np.ndarray:
        return np.arange(np.shape(x)[0], dtype=np.int32)


def member_index(x, placement: str, n: int):
    """The positions of the members of placed ``x`` (``{i32[]}`` at ``placement``),
    laid out like ``x``: what a derivative rule binds to tell the members apart."""
    return AD.typed_like(member_index_p.bind(x, placement=placement, n=n), _aval(core.typeof(x), n))
