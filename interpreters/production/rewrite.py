"""IR surgery for the split: copy ops into new regions and splice traced JAX into them.

Copies always get fresh values, so a part never shares a value (or a region) with the
round it came from or with another part.
"""

from __future__ import annotations

from collections.abc import Callable

import jax

from fcir.frontend.capture import capture
from fcir.ir import Op, Region, Value
from fcir.ir.types import PlacedType, Structure, TensorType, Type


def member_type(t: Type) -> Type:
    """The type one member (or the server) holds locally: ``{T}@clients`` -> ``T``."""
    return t.member if isinstance(t, PlacedType) else t


def clone_region(region: Region, retype: Callable[[Type], Type] | None = None) -> Region:
    """Deep copy with fresh values (regions are isolated from above); ``retype`` maps
    every value's type, nested regions included."""
    env = {v: Value(retype(v.type) if retype else v.type) for v in region.params}
    new = Region([env[v] for v in region.params], [], [], region.label)
    for op in region.ops:
        new.ops.append(clone_op(op, env, retype))
    new.results = [env[v] for v in region.results]
    return new


def clone_op(op: Op, env: dict, retype: Callable[[Type], Type] | None = None) -> Op:
    """Copies ``op`` reading its operands through ``env``; records its new results there.
    ``retype`` maps the types of its results and of every value in its regions."""
    results = [Value(retype(v.type) if retype else v.type) for v in op.results]
    env.update(zip(op.results, results))
    return Op(
        op.name,
        [env[v] for v in op.operands],
        results,
        dict(op.attrs),
        [clone_region(r, retype) for r in op.regions],
        op.location,
    )


def splice(region: Region, fn: Callable, inputs: list[Value], *, member: bool) -> list[Value]:
    """Appends the ops of ``fn`` (a plain JAX function of arrays) to ``region``.

    ``member``: the region runs at one client (plain tensor types); otherwise at the
    server (``T@server`` types). Returns the values ``fn`` returns, flattened.
    """
    specs = []
    for v in inputs:
        t = member_type(v.type)
        specs.append(jax.ShapeDtypeStruct(t.shape, t.np_dtype))
    traced = capture(fn, *specs).main.body
    env = dict(zip(traced.params, inputs))
    for op in traced.ops:
        region.ops.append(clone_op(op, env, member_type if member else None))
    return [env[v] for v in traced.results]


# --- structures -------------------------------------------------------------------------


def leaf_paths(s: Structure, prefix: tuple = ()) -> dict[int, tuple[int, ...]]:
    """Leaf index -> path of child positions from the root."""
    if s.kind == "leaf":
        return {s.leaf: prefix}
    out: dict[int, tuple[int, ...]] = {}
    for i, c in enumerate(s.children):
        out.update(leaf_paths(c, (*prefix, i)))
    return out


def prune(s: Structure, keep) -> tuple[Structure, list[int]]:
    """The part of ``s`` whose leaves are in ``keep``, renumbered 0.. in reading order.

    Returns the new structure and the old leaf index of each new leaf. Containers left
    empty disappear; the root is a tuple (possibly empty) if everything goes.
    """
    old: list[int] = []

    def go(node: Structure) -> Structure | None:
        if node.kind == "leaf":
            if node.leaf not in keep:
                return None
            old.append(node.leaf)
            return Structure("leaf", leaf=len(old) - 1)
        if node.kind == "none":
            return None
        kids, names = [], []
        for i, c in enumerate(node.children):
            k = go(c)
            if k is not None:
                kids.append(k)
                if node.names:
                    names.append(node.names[i])
        if not kids:
            return None
        return Structure(node.kind, tuple(kids), tuple(names), node.type_name)

    pruned = go(s)
    if pruned is None:
        pruned = Structure("tuple")
    return pruned, old


def shift(s: Structure, offset: int) -> Structure:
    """``s`` with every leaf index moved by ``offset``."""
    if s.kind == "leaf":
        return Structure("leaf", leaf=s.leaf + offset)
    return Structure(s.kind, tuple(shift(c, offset) for c in s.children), s.names, s.type_name)


def named(names: list[str], offset: int = 0) -> Structure:
    """A dict structure over ``names`` (already in the sorted order JAX flattens dicts in)."""
    assert names == sorted(names)
    return Structure(
        "dict", tuple(Structure("leaf", leaf=offset + i) for i in range(len(names))), tuple(names)
    )


def count_leaves(s: Structure) -> int:
    return len(s.leaves())


def tensor(t: Type) -> TensorType:
    t = member_type(t)
    assert isinstance(t, TensorType), t
    return t
