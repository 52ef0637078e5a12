"""IR types: tensors, placed values, and pytree structures.

Text syntax (the same in the canonical text, in ``--args`` specs and in errors):

* tensor ``f32[16,1]``, ``i32[]``, ``bf16[8,128]``, ``key<fry>[4]``
* ``{T}@clients``: one value per member of ``clients`` (runtime: leading axis n)
* ``T@clients!``: the all-equal form produced by ``fed.broadcast`` (runtime: leading axis n)
* ``T@server``: a value at the server (top level of a program; no extra axis)

Inside a ``fed.map`` region, unplaced tensors are local to the member running it.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Union

import numpy as np

from fcir.errors import ParseError, UnsupportedError
from fcir.jaxcompat import prng

SERVER = "server"

_SHORT = {"bfloat16": "bf16", "bool": "bool"}
_PREFIX = (("float", "f"), ("uint", "u"), ("int", "i"), ("complex", "c"))


# dtype -> its IR name: capture names the dtype of every value it converts.
_NAMES: dict = {}


def dtype_name(dtype) -> str:
    """Short name of a dtype as written in the IR: ``f32``, ``bf16``, ``key<fry>``."""
    try:
        return _NAMES[dtype]
    except (KeyError, TypeError):  # not seen yet, or not hashable
        pass
    name = _dtype_name(dtype)
    if len(_NAMES) < 1024:
        try:
            _NAMES[dtype] = name
        except TypeError:
            pass
    return name


def _dtype_name(dtype) -> str:
    impl = getattr(dtype, "_impl", None)
    if impl is not None:  # a jax.random key dtype
        return f"key<{impl.tag}>"
    name = np.dtype(dtype).name
    if name in _SHORT:
        return _SHORT[name]
    for long, short in _PREFIX:
        if name.startswith(long):
            return short + name[len(long) :]
    raise UnsupportedError(f"dtype {name} has no fcir IR name")


def _key_impls():

    return {impl.tag: impl for impl in prng.prngs.values()}


@functools.cache
def _ir_spelling(name: str) -> str:
    """``; the IR writes it f32`` for numpy's name of a dtype (``float32``), which a
    user writes where the IR's short name is wanted; empty for other names."""
    try:
        import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy)

        dtype = np.dtype(name)
    except TypeError:
        return ""
    if dtype.name != name:  # 'int', 'float', 'f4': platform or width is not said
        return ""
    try:
        return f"; the IR writes it {dtype_name(dtype)}"
    except Exception:  # noqa: BLE001  a hint only: a numpy dtype the IR has no name for
        return ""


def dtype_from_name(name: str):
    """Inverse of :func:`dtype_name`; raises ParseError for unknown names."""
    if name.startswith("key<") and name.endswith(">"):
        impl = _key_impls().get(name[4:-1])
        if impl is None:
            raise ParseError(f"unknown PRNG key dtype {name!r}")
        import jax

        return jax.random.key(0, impl=impl.name).dtype
    if name == "bf16":
        long = "bfloat16"
    elif name == "bool":
        long = "bool"
    else:
        for lng, short in _PREFIX:
            if name.startswith(short) and name[len(short) :][:1].isdigit():
                long = lng + name[len(short) :]
                break
        else:
            raise ParseError(f"unknown dtype {name!r}{_ir_spelling(name)}")
    try:
        import ml_dtypes  # noqa: F401  (registers bf16, fp8, int4 with numpy)

        return np.dtype(long)
    except TypeError:
        import jax.numpy as jnp

        dt = getattr(jnp, long, None)
        if dt is None:
            raise ParseError(f"unknown dtype {name!r}") from None
        return np.dtype(dt)


@dataclasses.dataclass(frozen=True)
class TensorType:
    dtype: str
    shape: tuple[int, ...]

    def __str__(self) -> str:
        return f"{self.dtype}[{','.join(str(d) for d in self.shape)}]"

    @property
    def np_dtype(self):
        return dtype_from_name(self.dtype)


@dataclasses.dataclass(frozen=True)
class PlacedType:
    member: Type
    placement: str
    all_equal: bool = False

    def __str__(self) -> str:
        if self.placement == SERVER:
            return f"{self.member}@{SERVER}"
        if self.all_equal:
            return f"{self.member}@{self.placement}!"
        return f"{{{self.member}}}@{self.placement}"


Type = Union[TensorType, PlacedType]


def server(t: Type) -> PlacedType:
    return PlacedType(t, SERVER, True)


def tensor_of(aval) -> TensorType:
    """The IR tensor type of a JAX abstract value (or array, or ShapeDtypeStruct)."""
    return TensorType(dtype_name(aval.dtype), tuple(int(d) for d in aval.shape))


def runtime_type(t: Type, cardinality) -> TensorType:
    """The array type a value of IR type ``t`` has at run time.

    ``cardinality`` maps a placement name to its size. Server values carry no axis.
    """
    if isinstance(t, TensorType):
        return t
    inner = runtime_type(t.member, cardinality)
    if t.placement == SERVER:
        return inner
    return TensorType(inner.dtype, (cardinality(t.placement), *inner.shape))


def strip_server(t: Type) -> Type:
    return t.member if isinstance(t, PlacedType) and t.placement == SERVER else t


# --- pytree structures ----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Structure:
    """A pytree shape whose leaves index a flat list of values.

    kind: ``leaf`` (``leaf`` is the flat index), ``none``, ``tuple``, ``list``, ``dict``,
    ``namedtuple`` and ``custom`` (``type_name`` and field ``names`` from key paths).
    """

    kind: str
    children: tuple[Structure, ...] = ()
    names: tuple[str, ...] = ()
    type_name: str = ""
    leaf: int = -1

    def leaves(self) -> list[int]:
        if self.kind == "leaf":
            return [self.leaf]
        out: list[int] = []
        for c in self.children:
            out.extend(c.leaves())
        return out

    def __str__(self) -> str:
        if self.kind == "leaf":
            return f"${self.leaf}"
        if self.kind == "none":
            return "none"
        if self.kind == "tuple":
            return "(" + ", ".join(str(c) for c in self.children) + ")"
        if self.kind == "list":
            return "[" + ", ".join(str(c) for c in self.children) + "]"
        import json

        body = ", ".join(f"{json.dumps(n)}: {c}" for n, c in zip(self.names, self.children))
        if self.kind == "dict":
            return "{" + body + "}"
        return f"{self.kind} {json.dumps(self.type_name)} {{{body}}}"

    def unflatten(self, leaves):
        """Rebuilds Python containers (namedtuples and custom nodes become named types)."""
        import collections

        if self.kind == "leaf":
            return leaves[self.leaf]
        if self.kind == "none":
            return None
        kids = [c.unflatten(leaves) for c in self.children]
        if self.kind == "tuple":
            return tuple(kids)
        if self.kind == "list":
            return kids
        if self.kind == "dict":
            return dict(zip(self.names, kids))
        if self.kind == "namedtuple" and all(n.isidentifier() for n in self.names):
            short = self.type_name.rsplit(".", 1)[-1]
            cls = collections.namedtuple(short if short.isidentifier() else "Struct", self.names)
            return cls(*kids)
        return dict(zip(self.names, kids))


def structure_of(treedef, start: int = 0) -> Structure:
    """The Structure of a jax PyTreeDef, numbering leaves from ``start``."""
    counter = [start]

    def build(td) -> Structure:
        if td.num_nodes == 1 and td.num_leaves == 1:
            i = counter[0]
            counter[0] += 1
            return Structure("leaf", leaf=i)
        node_type, aux = td.node_data()
        kids = tuple(build(c) for c in td.children())
        if node_type is type(None):
            return Structure("none")
        if node_type is tuple:
            return Structure("tuple", kids)
        if node_type is list:
            return Structure("list", kids)
        if node_type is dict or (isinstance(node_type, type) and issubclass(node_type, dict)):
            return Structure("dict", kids, tuple(str(k) for k in aux))
        qual = f"{node_type.__module__}.{node_type.__qualname__}"
        if issubclass(node_type, tuple) and hasattr(node_type, "_fields"):
            return Structure("namedtuple", kids, tuple(node_type._fields), qual)
        names = _custom_names(node_type, aux, len(kids))
        return Structure("custom", kids, names, qual)

    return build(treedef)


def _custom_names(node_type, aux, count: int) -> tuple[str, ...]:
    import dataclasses as dc

    if dc.is_dataclass(node_type):
        fields = [f.name for f in dc.fields(node_type) if not f.metadata.get("static", False)]
        if len(fields) == count:
            return tuple(fields)
    if isinstance(aux, (tuple, list)) and len(aux) == count and all(
        isinstance(a, str) for a in aux
    ):
        return tuple(aux)
    return tuple(str(i) for i in range(count))


def dtype_bits(dtype: str) -> int:
    """The width in bits of IR dtype ``dtype`` (``"i16"`` -> 16)."""
    return np.dtype(dtype_from_name(dtype)).itemsize * 8
