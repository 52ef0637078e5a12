"""Placed values through JAX control flow: the typing rules capture, check and the
interpreters share.

``jax.scan``, ``jax.while`` and ``jax.cond`` (``lax.switch`` and ``fori_loop`` are these
primitives too) run their regions at the level of the op itself: a scan at the server
runs its body at the server, so its regions may hold fed ops, and may pass placed values
along. The op itself only hands values to its regions and back, it never reads them, so
it is no communication; what its regions do with the values is checked op by op like
any other region (a local op at the server that reads a placed value is still local/C1).

How each op binds operands to region parameters (``bindings``):

* ``jax.scan`` (operands ``consts, init carry, xs``): the body's parameters are the
  consts, the carry and one slice of each ``xs``; it yields the new carry and one slice of
  each ``ys``. A placed ``xs``/``ys`` is *stacked per member*: ``{f32[T,4]}@clients`` holds
  each member's T slices, so the body sees ``{f32[4]}@clients``. At run time the member
  axes stay first (``[n, T, 4]``), where JAX's own scan stacks along axis 0 (``[T, n,
  4]``); the interpreters move the scan axis around the scan (:func:`scan_axis`).
* ``jax.while`` (operands ``cond consts, body consts, init carry``): the condition gets
  its consts and the carry and yields a server ``bool[]``; the body gets its consts and the
  carry and yields the new carry.
* ``jax.cond`` (operands ``index, ops``): every branch gets ``ops`` and yields the results.

A loop-carried value has one type through all iterations: an all-equal value
(``T@clients!``) that becomes per-member in the body is typed per-member (``{T}@clients``)
from the start (:func:`join`); the branches of a cond join the same way. An operand or
yielded value may be all-equal where its parameter or result is per-member
(:func:`assignable`): both have one value per member, laid out alike.
"""

from __future__ import annotations

import dataclasses

from fcir.errors import IRTypeError
from fcir.ir.types import SERVER, PlacedType, TensorType, Type

PRIMITIVES = frozenset({"scan", "while", "cond"})

# Call-like primitives: operand i is region parameter i, region result i is op result i.
CALLS = {
    "jit": "jaxpr",
    "pjit": "jaxpr",
    "closed_call": "call_jaxpr",
    "core_call": "call_jaxpr",
    "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr",
    "remat2": "jaxpr",
    "checkpoint": "jaxpr",
}


def is_placed(t) -> bool:
    """A value placed below the current level (not a server value)."""
    return isinstance(t, PlacedType) and t.placement != SERVER


def join(a: Type, b: Type) -> Type | None:
    """The one type both ``a`` and ``b`` fit (None if there is none): equal types, or an
    all-equal and a per-member value of the same placement and joined member types."""
    if a == b:
        return a
    if is_placed(a) and is_placed(b) and a.placement == b.placement:
        member = join(a.member, b.member)
        if member is not None:
            return PlacedType(member, a.placement, a.all_equal and b.all_equal)
    return None


def assignable(src: Type, dst: Type) -> bool:
    """Whether a value of type ``src`` may stand where ``dst`` is expected."""
    return join(src, dst) == dst


def stack(t: Type, length: int) -> Type | None:
    """The type of ``length`` values of type ``t`` stacked by a scan (None: cannot).
    Placed values stack inside their members, at every level: member axes first."""
    if isinstance(t, TensorType):
        return TensorType(t.dtype, (length, *t.shape))
    if isinstance(t, PlacedType):
        member = stack(t.member, length)
        return None if member is None else PlacedType(member, t.placement, t.all_equal)
    return None


def unstack(t: Type) -> Type | None:
    """The type of one slice of a scanned-over value (None: it has no scan axis)."""
    if isinstance(t, TensorType):
        return TensorType(t.dtype, t.shape[1:]) if t.shape else None
    if isinstance(t, PlacedType):
        member = unstack(t.member)
        return None if member is None else PlacedType(member, t.placement, t.all_equal)
    return None


def scan_axis(t: Type) -> int:
    """Where a scan stacks values of type ``t`` at run time: after its member axes (the
    placements it is nested in, server excluded); JAX's own scan stacks at axis 0."""
    if isinstance(t, PlacedType):
        return scan_axis(t.member) + (t.placement != SERVER)
    return 0


def innermost(t: Type) -> TensorType | None:
    while isinstance(t, PlacedType):
        t = t.member
    return t if isinstance(t, TensorType) else None


@dataclasses.dataclass
class Binding:
    """How one region of a control-flow op is fed and what it yields.

    ``params[i]`` is ``(operand index, sliced)``: region parameter i is that operand, or
    one slice of it (scan ``xs``). ``results[j]`` is ``(kind, k)``: ``("carry", k)`` feeds
    region parameter k on the next iteration and is op result j after the last one;
    ``("result", k)`` is op result k (= j); ``("stacked", k)`` is one slice of op result k
    (= j, scan ``ys``); ``("predicate", 0)`` is a while loop's condition.
    """

    region: int
    params: list[tuple[int, bool]]
    results: list[tuple[str, int]]


class BindingError(Exception):
    """The op's attributes do not describe its operands and regions."""


def _int(attrs, key) -> int:
    v = attrs.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise BindingError(f"attribute {key}={v!r} must be a non-negative int")
    return v


def _ref(attrs, key, regions: int) -> int:
    ref = attrs.get(key)
    index = getattr(ref, "index", None)
    if not isinstance(index, int) or not 0 <= index < regions:
        raise BindingError(f"attribute {key}={ref!r} must name one of the op's {regions} regions")
    return index


def bindings(name: str, attrs: dict, operands: int, results: int, regions: int) -> list[Binding]:
    """The Bindings of ``jax.<name>`` (a control-flow or call-like primitive) from its
    attributes and its operand/result/region counts; raises BindingError if they
    disagree."""
    if name == "scan":
        nc, nk = _int(attrs, "num_consts"), _int(attrs, "num_carry")
        if nc + nk > operands or nk > results:
            raise BindingError(f"num_consts={nc}, num_carry={nk} for {operands} operands, "
                               f"{results} results")
        body = _ref(attrs, "jaxpr", regions)
        params = [(i, False) for i in range(nc + nk)] + [(i, True) for i in
                                                          range(nc + nk, operands)]
        outs = [("carry", nc + k) for k in range(nk)] + [("stacked", k) for k in
                                                          range(nk, results)]
        return [Binding(body, params, outs)]
    if name == "while":
        cn, bn = _int(attrs, "cond_nconsts"), _int(attrs, "body_nconsts")
        nk = operands - cn - bn
        if nk < 0 or nk != results:
            raise BindingError(f"cond_nconsts={cn}, body_nconsts={bn} for {operands} operands, "
                               f"{results} results")
        cond, body = _ref(attrs, "cond_jaxpr", regions), _ref(attrs, "body_jaxpr", regions)
        carry = [(cn + bn + k, False) for k in range(nk)]
        return [
            Binding(cond, [(i, False) for i in range(cn)] + carry, [("predicate", 0)]),
            Binding(body, [(cn + i, False) for i in range(bn)] + carry,
                    [("carry", bn + k) for k in range(nk)]),
        ]
    if name == "cond":
        branches = attrs.get("branches")
        if not isinstance(branches, tuple) or not branches or operands < 1:
            raise BindingError("needs an index operand and a tuple of branch regions")
        out = []
        for b in range(len(branches)):
            index = getattr(branches[b], "index", None)
            if not isinstance(index, int) or not 0 <= index < regions:
                raise BindingError(f"branch {b} names no region of the op")
            out.append(Binding(index, [(i, False) for i in range(1, operands)],
                               [("result", k) for k in range(results)]))
        return out
    if name in CALLS:
        body = _ref(attrs, CALLS[name], regions)
        return [Binding(body, [(i, False) for i in range(operands)],
                        [("result", k) for k in range(results)])]
    raise BindingError(f"jax.{name} is not a control-flow op")


def bindings_of(op) -> list[Binding] | None:
    """The Bindings of IR op ``op`` (a ``jax.*`` control-flow or call op), or None where
    its attributes do not describe its operands and regions (a hand-edited module, an
    op this module does not know): the analyses then treat its regions conservatively,
    and the checker reports it."""
    try:
        return bindings(
            op.name.removeprefix("jax."),
            op.attrs,
            len(op.operands),
            len(op.results),
            len(op.regions),
        )
    except BindingError:
        return None


def scan_length(op) -> int:
    """A ``jax.scan``'s trip count; IRTypeError (not OverflowError from ``int(inf)``)
    when a hand-edited module's ``length`` is not a non-negative int."""
    v = op.attrs.get("length", 1)
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:

        raise IRTypeError(f"{op.name}: attribute length={v!r} must be a non-negative int")
    return v


def scan_slices(attrs: dict, operands: int, results: int) -> tuple[range, range]:
    """(operand indices of ``xs``, result indices of ``ys``) of a ``jax.scan``; a
    ``BindingError`` when the counts are not non-negative ints."""
    nc, nk = _int(attrs, "num_consts"), _int(attrs, "num_carry")
    return range(nc + nk, operands), range(nk, results)
