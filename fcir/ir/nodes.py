"""The in-memory IR: modules of functions whose bodies are regions of ops.

Values are identified by object identity; the printer (``fcir.ir.text``) and the
serializer number them in definition order, so names never come from Python ids.
An op is a namespaced name (``fed.map``, ``jax.dot_general``), operands, typed
results, attributes (plain data, see ``fcir.ir.attrs``) and nested regions.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator
from typing import Any

from fcir.errors import IRTypeError, ParseError, PlacementError
from fcir.ir.types import Structure, Type

IR_VERSION = 1  # major version of the fcir.v1 Module format this fcir reads and writes

# The printer/parser (fcir.ir.text) and the serializer (fcir.ir.serialize) build and read
# the classes below, so they import this module, not it them: each puts its entry points
# here when imported ("print", "to_bytes", "from_bytes"), and importing fcir.ir (which
# any import of this module does first) imports both. Module's methods call them.
CODECS: dict[str, Any] = {}

# Module, func and placement names: ASCII identifiers. The canonical text writes them
# bare (``@name``, ``clients:8``, ``{T}@clients``), so a name must be one token of the
# text grammar in any tokenizer: no spaces, newlines, quotes or non-ASCII letters.
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def expect_module(module, who: str) -> None:
    """Raises ``IRTypeError`` unless ``module`` is a :class:`Module` (what ``who``, a
    public function, takes), instead of an AttributeError deep inside it."""
    if not isinstance(module, Module):

        raise IRTypeError(
            f"{who}: expected an fcir.Module (from fcir.capture, fcir.parse or "
            f"fcir.Module.deserialize), got {type(module).__name__}"
        )


def is_name(name) -> bool:
    """Whether ``name`` is a valid module, func or placement name (an ASCII identifier)."""
    return isinstance(name, str) and _NAME.fullmatch(name) is not None


def check_names(module: Module) -> None:
    """Raises IRTypeError unless the module's, its funcs' and placements' names are
    names (:func:`is_name`): the printer and serializer refuse to write what the parser
    and deserializer would not read back."""
    bad = [("module", module.name)] if not is_name(module.name) else []
    bad += [("func", f.name) for f in module.funcs if not is_name(f.name)]
    bad += [("placement", p) for p, _ in module.placements if not is_name(p)]
    if bad:
        what, name = bad[0]
        raise IRTypeError(
            f"{what} name {name!r} is not an ASCII identifier ([A-Za-z_][A-Za-z0-9_]*), so "
            f"it could not be read back from text or protobuf: use e.g. {sanitize_name(name)!r}"
        )


def sanitize_name(name: str) -> str:
    """``name`` with every character outside [A-Za-z0-9_] replaced by '_' (and a leading
    '_' before a digit): a valid name derived from a Python function's name."""
    out = "".join(c if c.isascii() and (c.isalnum() or c == "_") else "_" for c in str(name))
    if not out or out[0].isdigit():
        out = "_" + out
    return out


class Value:
    """An SSA value: defined once, as a region parameter or an op result."""

    __slots__ = ("type",)

    def __init__(self, type: Type):
        self.type = type

    def __repr__(self) -> str:
        return f"Value({self.type})"


@dataclasses.dataclass(eq=False)
class Region:
    params: list[Value]
    ops: list[Op]
    results: list[Value]
    label: str = "body"


@dataclasses.dataclass(eq=False)
class Op:
    name: str
    operands: list[Value]
    results: list[Value]
    attrs: dict[str, Any] = dataclasses.field(default_factory=dict)
    regions: list[Region] = dataclasses.field(default_factory=list)
    location: str = ""  # "file.py:12" when captured with locations=True

    @property
    def dialect(self) -> str:
        return self.name.split(".", 1)[0]


@dataclasses.dataclass(eq=False)
class Func:
    name: str
    body: Region
    arg_structure: Structure | None = None
    result_structure: Structure | None = None
    result_treedef: Any = None  # the captured PyTreeDef; in-process only, never serialized


@dataclasses.dataclass(eq=False)
class Module:
    """A federated program: placements (outermost first) and its ``main`` function."""

    name: str
    placements: list[tuple[str, int]]
    funcs: list[Func]
    ir_version: int = IR_VERSION
    # @fcir.program(private=True): client data reaches the server only through the DP
    # aggregates (checked by fcir.check, see fcir.privacy).
    private: bool = False

    @property
    def main(self) -> Func:
        for f in self.funcs:
            if f.name == "main":
                return f
        raise IRTypeError(f"module @{self.name} has no func @main")

    def cardinality(self, placement: str) -> int:
        for name, n in self.placements:
            if name == placement:
                return n
        raise PlacementError(
            f"placement '{placement}' is not declared by module @{self.name} "
            f"(placements: {[p for p, _ in self.placements]})"
        )

    def parent_of(self, placement: str) -> str:
        names = [p for p, _ in self.placements]
        i = names.index(placement)
        return "server" if i == 0 else names[i - 1]

    def to_text(self, *, full_constants: bool = False, locations: bool = False) -> str:
        """Canonical, deterministic text. Large constants are elided to shape + sha256
        unless ``full_constants``; source locations are printed only if asked."""
        return CODECS["print"](self, full_constants=full_constants, locations=locations)

    def serialize(self) -> bytes:
        """Bytes of the ``fcir.v1.Module`` protobuf (deterministic)."""
        return CODECS["to_bytes"](self)

    @classmethod
    def deserialize(cls, data: bytes) -> Module:
        return CODECS["from_bytes"](data)

    def __str__(self) -> str:
        return self.to_text()


def check_structure(structure: Structure, count: int, what: str) -> None:
    """Raises ParseError unless ``structure`` is well formed and its leaves index each of
    ``count`` flat values exactly once (a permutation of ``range(count)``)."""
    leaves: list[int] = []
    stack = [structure]
    while stack:
        s = stack.pop()
        if s.kind == "leaf":
            if s.children or s.names or s.type_name:
                raise ParseError(f"{what}: a leaf has children, names or a type name")
            leaves.append(s.leaf)
            continue
        if s.kind in ("none", "tuple", "list") and (s.names or s.type_name):
            raise ParseError(f"{what}: a {s.kind} node has names or a type name")
        if s.kind == "none" and s.children:
            raise ParseError(f"{what}: a none node has children")
        if s.kind == "dict" and s.type_name:
            raise ParseError(f"{what}: a dict node has a type name")
        stack.extend(s.children)
    if sorted(leaves) != list(range(count)):
        raise ParseError(
            f"{what}: leaves {sorted(leaves)[:8]}{'...' if len(leaves) > 8 else ''} must "
            f"index each of the {count} flat values exactly once"
        )


def walk(region: Region, path: tuple = ()) -> Iterator[tuple[tuple, Op]]:
    """Yields (path, op) for every op, depth first in program order.

    A path is ``(op index, region index, op index, ...)`` from the function body.
    """
    for i, op in enumerate(region.ops):
        yield (*path, i), op
        for r, sub in enumerate(op.regions):
            yield from walk(sub, (*path, i, r))


def value_numbering(func: Func) -> dict[Value, int]:
    """Value -> number, in definition order (the printer's and serializer's names)."""
    names: dict[Value, int] = {}

    def number(region: Region) -> None:
        for v in region.params:
            names.setdefault(v, len(names))
        for op in region.ops:
            for v in op.results:
                names.setdefault(v, len(names))
            for sub in op.regions:
                number(sub)

    # Reading order of the canonical text: an op's results print before its regions.
    for v in func.body.params:
        names.setdefault(v, len(names))
    number(func.body)
    return names


def describe(module: Module, path: tuple, op: Op, names: dict[Value, int] | None = None) -> str:
    """Human-readable position of an op for error messages."""
    names = names if names is not None else value_numbering(module.main)
    where = "op " + "/".join(str(p) for p in path)
    res = ", ".join(f"%{names[v]}" for v in op.results if v in names)
    loc = f" at {op.location}" if op.location else ""
    return f"{op.name} ({where}{', defining ' + res if res else ''}){loc}"
