"""Key paths of pytree leaves: flattening with container kinds, matching, rebuilding.

A key path is a tuple of steps `(key, container)` where `key` is a `str` (dict key or
attribute name) or an `int` (sequence index, integer dict key) and `container` is the
`ContainerKind` the step goes through. Paths match by their keys alone, so a tree saved
as a namedtuple restores into a target written as a dict with the same names.
"""

from __future__ import annotations

from typing import Any

import jax

from fcir._proto import checkpoint_pb2 as pb
from fcir.errors import CheckpointError

Key = str | int
Step = tuple[Key, int]  # (key, pb.ContainerKind value)
Path = tuple[Step, ...]

_tu = jax.tree_util


def _step(node: Any, entry: Any, where: str) -> Step:
    if isinstance(entry, _tu.DictKey):
        key = entry.key
        if isinstance(key, bool) or not isinstance(key, (str, int)):
            raise CheckpointError(
                f"{where}: dict key {key!r} of type {type(key).__name__} cannot be saved; "
                "use str or int keys"
            )
        return key, pb.CONTAINER_KIND_DICT
    if isinstance(entry, _tu.SequenceKey):
        kind = pb.CONTAINER_KIND_LIST if isinstance(node, list) else pb.CONTAINER_KIND_TUPLE
        return entry.idx, kind
    if isinstance(entry, _tu.GetAttrKey):
        return entry.name, pb.CONTAINER_KIND_OBJECT
    if isinstance(entry, _tu.FlattenedIndexKey):
        return entry.key, pb.CONTAINER_KIND_OBJECT
    raise CheckpointError(f"{where}: unsupported pytree key {entry!r}")


def flatten(tree: Any, where: str) -> list[tuple[Path, Any]]:
    """The leaves of `tree` with their key paths, in `jax.tree_util` flattening order."""
    out: list[tuple[Path, Any]] = []

    def walk(node: Any, prefix: Path) -> None:
        children, _ = _tu.tree_flatten_with_path(node, is_leaf=lambda x: x is not node)
        if len(children) == 1 and children[0][0] == () and children[0][1] is node:
            out.append((prefix, node))
            return
        for (entry,), child in children:
            walk(child, prefix + (_step(node, entry, display(where, prefix)),))

    walk(tree, ())
    return out


def match_key(path: Path) -> tuple[Key, ...]:
    """What two paths must share to name the same leaf."""
    return tuple(key for key, _ in path)


def jax_match_key(jax_path: tuple[Any, ...]) -> tuple[Key, ...]:
    """`match_key` of a path as `jax.tree_util.tree_flatten_with_path` reports it."""
    keys: list[Key] = []
    for entry in jax_path:
        if isinstance(entry, _tu.DictKey):
            keys.append(entry.key)
        elif isinstance(entry, _tu.SequenceKey):
            keys.append(entry.idx)
        elif isinstance(entry, _tu.GetAttrKey):
            keys.append(entry.name)
        elif isinstance(entry, _tu.FlattenedIndexKey):
            keys.append(entry.key)
        else:
            raise CheckpointError(f"unsupported pytree key {entry!r} in restore target")
    return tuple(keys)


def display(item: str, path: Path | tuple[Key, ...]) -> str:
    """A leaf's name for messages: `params/dense/kernel`, `opt_state/0/mu`."""
    keys = [step[0] if isinstance(step, tuple) else step for step in path]
    return "/".join([item, *map(str, keys)])


def to_proto(path: Path) -> list[pb.PathElement]:
    out = []
    for key, container in path:
        if isinstance(key, str):
            out.append(pb.PathElement(name=key, container=container))
        else:
            out.append(pb.PathElement(index=key, container=container))
    return out


def from_proto(elements: Any) -> Path:
    path = []
    for el in elements:
        which = el.WhichOneof("key")
        if which is None:
            raise CheckpointError("layout has a key path element with neither name nor index")
        path.append((getattr(el, which), el.container))
    return tuple(path)


def unflatten(pairs: list[tuple[Path, Any]]) -> Any:
    """Rebuilds nested dicts, lists and tuples from leaves and their key paths.

    Objects (namedtuples, dataclasses, custom nodes) come back as dicts keyed by field
    name; missing sequence positions (None leaves, which have no data) become None.
    """
    if len(pairs) == 1 and pairs[0][0] == ():
        return pairs[0][1]
    if not pairs:
        return {}
    groups: dict[Key, list[tuple[Path, Any]]] = {}
    kinds: set[int] = set()
    for path, value in pairs:
        if not path:
            raise CheckpointError("layout has a leaf whose key path is a prefix of another's")
        (key, kind), rest = path[0], path[1:]
        kinds.add(kind)
        groups.setdefault(key, []).append((rest, value))
    children = {key: unflatten(sub) for key, sub in groups.items()}
    kind = kinds.pop() if len(kinds) == 1 else pb.CONTAINER_KIND_DICT
    if kind in (pb.CONTAINER_KIND_LIST, pb.CONTAINER_KIND_TUPLE) and all(
        isinstance(k, int) and k >= 0 for k in children
    ):
        seq = [children.get(i) for i in range(max(children) + 1)]  # type: ignore[type-var]
        return seq if kind == pb.CONTAINER_KIND_LIST else tuple(seq)
    return children
