"""Attributes: plain data that stands for a JAX primitive's params.

An attribute is an int, float, bool, str, None, a tuple of attributes, or one of the
records below. Nothing here is pickled or ``eval``-ed: enums and records name a JAX
class by its qualified name, and decoding only looks that name up among classes that
JAX's own modules define. Sub-jaxprs are not attributes but regions of the op; the
param refers to them with :class:`RegionRef`.

Three params hold Python objects of other kinds, each written as plain data:

* a primitive (``select_and_scatter_add``'s ``select_prim``, from the gradient of max
  pooling): ``#Primitive.ge``, decoded only from :data:`PARAM_PRIMITIVES`;
* a PyTreeDef (``debug_print``'s ``in_tree``): ``#PyTreeDef<root=...>``, its tuple,
  list, dict and None nodes as records; a custom node (a namedtuple, a dataclass) would
  need its class back, so it is an UnsupportedError;
* a traced Python function next to its jaxpr (``reduce``'s ``computation``): the
  region is what lowers and differentiates, so the function is ``#Omitted.computation``.

A Python callback (``jax.debug.callback``, ``jax.pure_callback``) cannot be plain data;
capture refuses it. ``jax.debug.print`` is no callback: it is kept as its format string
and prints again wherever the module runs.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import math
import sys
from typing import Any

import numpy as np

from fcir.errors import ParseError, UnsupportedError
from fcir.ir.types import dtype_from_name, dtype_name
from fcir.jaxcompat import core, named_sharding, prng, schema


@dataclasses.dataclass(frozen=True)
class DType:
    name: str


@dataclasses.dataclass(frozen=True)
class Enum:
    type_name: str
    member: str


@dataclasses.dataclass(frozen=True)
class Record:
    type_name: str
    fields: tuple[tuple[str, Any], ...]

    def get(self, key, default=None):
        for k, v in self.fields:
            if k == key:
                return v
        return default


@dataclasses.dataclass(frozen=True)
class RegionRef:
    index: int
    closed: bool = True  # ClosedJaxpr (True) or open Jaxpr (False) in the JAX param


@dataclasses.dataclass(frozen=True, eq=False)
class Tensor:
    """A constant. ``data`` holds the bytes (little-endian, C order); for PRNG key dtypes
    the bytes are the key data (uint32). ``data`` is None when the text elided it."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes | None
    digest: str = ""

    def __post_init__(self):
        if self.data is not None and not self.digest:
            object.__setattr__(self, "digest", hashlib.sha256(self.data).hexdigest())

    def __eq__(self, other):
        return (
            isinstance(other, Tensor)
            and (self.dtype, self.shape, self.digest) == (other.dtype, other.shape, other.digest)
        )

    def __hash__(self):
        return hash((self.dtype, self.shape, self.digest))

    @property
    def size(self) -> int:
        return math.prod(self.shape)  # exact: np.prod wraps around for huge shapes

    @staticmethod
    def from_array(value) -> Tensor:
        import jax

        dt = getattr(value, "dtype", None)
        if dt is not None and hasattr(dt, "_impl"):
            name = dtype_name(dt)
            arr = np.asarray(jax.random.key_data(value))
            return Tensor(name, tuple(np.shape(value)), arr.astype("<u4").tobytes())
        # JAX literals are TypedFloat/TypedInt (float/int subclasses with a .dtype):
        # np.asarray alone would widen them to f64/i64.
        arr = np.asarray(value) if dt is None else np.asarray(value, dtype=dt)
        name = dtype_name(arr.dtype)
        if arr.dtype.byteorder == ">":
            arr = arr.astype(arr.dtype.newbyteorder("<"))
        return Tensor(name, tuple(arr.shape), np.ascontiguousarray(arr).tobytes())

    def numpy(self) -> np.ndarray:
        """The raw numpy array (key data for key dtypes)."""
        if self.data is None:
            raise UnsupportedError(
                f"constant {self.dtype}[{','.join(map(str, self.shape))}] (sha256 "
                f"{self.digest[:16]}) was elided in the text form; load the .pb file or text "
                "written with full constants to run it"
            )
        dt = dtype_from_name(self.dtype)
        if self.dtype.startswith("key<"):
            key_shape = tuple(dt._impl.key_shape)
            dt, shape = np.dtype("<u4"), (*self.shape, *key_shape)
        else:
            shape = self.shape
        expected = math.prod(shape) * dt.itemsize
        if len(self.data) != expected:
            raise ParseError(
                f"constant {self.dtype}{list(self.shape)} holds {len(self.data)} bytes, "
                f"expected {expected}"
            )
        try:
            return np.frombuffer(self.data, dt).reshape(shape)
        except ValueError as e:  # e.g. a zero-size shape with a dimension beyond intp
            raise ParseError(f"constant {self.dtype}{list(self.shape)}: {e}") from None

    def value(self):
        """The constant as a JAX-usable value (numpy array or key array)."""
        arr = self.numpy()
        if self.dtype.startswith("key<"):
            import jax

            impl = dtype_from_name(self.dtype)._impl
            return jax.random.wrap_key_data(arr, impl=impl.name)
        return arr


# --- encoding JAX params --------------------------------------------------------------------

# Params that hold Python callables used only by differentiation. Capture happens after
# differentiation, so the IR keeps the primal region and records that these were omitted.
OMITTED_PARAMS = {
    "custom_jvp_call": ("jvp_jaxpr_fun",),
    "custom_vjp_call": ("fwd_jaxpr_thunk", "bwd", "out_trees"),
}
# The Python function a reduction's region was traced from: JAX lowers, batches and
# differentiates the region (``jaxpr``), so the IR keeps that and omits the function.
OMITTED_COMPUTATIONS = {"reduce": ("computation",)}

# Primitives JAX passes as params, by name: select_and_scatter_add and
# select_and_gather_add compare with one of these. Decoding looks names up here only.
PARAM_PRIMITIVES = ("ge", "gt", "le", "lt")

# Primitives whose params hold a Python function to call at run time: no plain-data
# form exists, so capture names the limit instead of failing on an unknown param.
_CALLBACKS = {
    "debug_callback": "jax.debug.callback",
    "pure_callback": "jax.pure_callback",
    "io_callback": "jax.experimental.io_callback",
}


# Primitives some of whose params are encoded by name rather than by type.
_BY_NAME = frozenset({*OMITTED_PARAMS, *OMITTED_COMPUTATIONS, *_CALLBACKS})


def _qualname(cls) -> str:
    return cls.__qualname__


# Exact types whose values are their own attribute (``int(v) is v`` for an exact int...).
_SELF_ENCODED = frozenset({int, float, bool, str, type(None)})


def encode(value, prim: str, key: str, add_region) -> Any:
    """JAX param value -> attribute. ``add_region(jaxpr, closed)`` returns a RegionRef."""
    # Fast paths for what most params are (shapes, axes, dimension numbers): the same
    # result as the checks below, without walking them for every element. A plain
    # tuple is none of the special records, but a few params of a few primitives are
    # encoded by their name (``_encode_special``), so those take the long way.
    t = type(value)
    if t in _SELF_ENCODED:
        return value
    if t is tuple and prim not in _BY_NAME:
        return tuple([encode(v, prim, key, add_region) for v in value])

    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, enum.Enum):  # before int: RoundingMethod is an IntEnum
        return Enum(_qualname(type(value)), value.name)
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return float(value)
    closed = schema.region_kind(value, prim, key)
    if closed is not None:
        return add_region(value, closed)
    if isinstance(value, np.dtype) or hasattr(value, "_impl") and hasattr(value, "name"):
        return DType(dtype_name(value))
    if isinstance(value, type) and issubclass(value, np.generic):
        return DType(dtype_name(np.dtype(value)))
    if isinstance(value, np.ndarray):
        return Tensor.from_array(value)
    special = _encode_special(value, prim, key, add_region)
    if special is not None:
        return special
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return Record(
            _qualname(type(value)),
            tuple((f, encode(getattr(value, f), prim, key, add_region)) for f in value._fields),
        )
    if isinstance(value, (tuple, list)):
        return tuple(encode(v, prim, key, add_region) for v in value)
    if isinstance(value, frozenset):
        return tuple(encode(v, prim, key, add_region) for v in sorted(value, key=repr))
    if dataclasses.is_dataclass(value) and type(value).__module__.startswith("jax"):
        return Record(
            _qualname(type(value)),
            tuple(
                (f.name, encode(getattr(value, f.name), prim, key, add_region))
                for f in dataclasses.fields(value)
            ),
        )
    raise UnsupportedError(
        f"jax.{prim}: param {key}={value!r} of type {type(value).__name__} has no fcir "
        "attribute encoding"
    )


def _encode_special(value, prim, key, add_region):
    import jax

    if isinstance(value, named_sharding.UnspecifiedValue):
        return Enum("Sharding", "UNSPECIFIED")
    if isinstance(value, prng.PRNGImpl):
        return Enum("PRNGImpl", value.name)
    if isinstance(value, (jax.sharding.Mesh, jax.sharding.AbstractMesh)):
        # A concrete mesh is recorded by its axes only and rebuilt over this process's
        # devices; an abstract mesh stays abstract.
        return Record(
            "Mesh" if isinstance(value, jax.sharding.Mesh) and value.axis_names else "AbstractMesh",
            (
                ("axis_names", tuple(str(a) for a in value.axis_names)),
                ("axis_sizes", tuple(int(s) for s in value.axis_sizes)),
                ("axis_types", tuple(Enum("AxisType", t.name) for t in value.axis_types)),
            ),
        )
    if isinstance(value, jax.sharding.PartitionSpec):
        return Record("PartitionSpec", (("spec", _encode_spec(value)),))
    if isinstance(value, jax.sharding.NamedSharding):
        return Record(
            "NamedSharding",
            (
                ("mesh", _encode_special(value.mesh, prim, key, add_region)),
                ("spec", _encode_spec(value.spec)),
            ),
        )
    if key == "policy" and callable(value):
        for name in dir(jax.checkpoint_policies):
            if getattr(jax.checkpoint_policies, name) is value:
                return Enum("checkpoint_policy", name)
        # A remat policy only steers differentiation, which happens before capture.
        return Enum("checkpoint_policy", "custom")
    if prim in OMITTED_PARAMS and key in OMITTED_PARAMS[prim]:
        return Enum("Omitted", "derivative_rule")
    if prim in OMITTED_COMPUTATIONS and key in OMITTED_COMPUTATIONS[prim]:
        return Enum("Omitted", "computation")
    if prim in _CALLBACKS and callable(value):
        raise UnsupportedError(
            f"jax.{prim}: param {key} is the Python function {_CALLBACKS[prim]} calls, which "
            "the IR cannot hold as plain data (modules are never pickled); use "
            "jax.debug.print, which is kept as its format string, or call the function "
            "outside the captured program"
        )
    if isinstance(value, core.Primitive):
        if value.name not in PARAM_PRIMITIVES:
            raise UnsupportedError(
                f"jax.{prim}: param {key} is the primitive {value.name}; fcir encodes only "
                f"{', '.join(PARAM_PRIMITIVES)} as a param"
            )
        return Enum("Primitive", value.name)
    if isinstance(value, jax.tree_util.PyTreeDef):
        return Record("PyTreeDef", (("root", _encode_treedef(value, prim, key)),))
    return None


def _encode_treedef(td, prim: str, key: str):
    """A PyTreeDef's nodes as records; leaves are ``#PyTreeDef.LEAF``."""
    data = td.node_data()
    if data is None:
        return Enum("PyTreeDef", "LEAF")
    node_type, aux = data
    kids = tuple(_encode_treedef(c, prim, key) for c in td.children())
    if node_type is type(None):
        return Enum("PyTreeDef", "NONE")
    if node_type is tuple or node_type is list:
        return Record(f"PyTreeDef.{node_type.__name__}", (("items", kids),))
    if node_type is dict and all(type(k) in (str, int) for k in aux):
        return Record("PyTreeDef.dict", (("keys", tuple(aux)), ("items", kids)))
    raise UnsupportedError(
        f"jax.{prim}: param {key} holds a pytree node of class "
        f"{getattr(node_type, '__qualname__', node_type)}; fcir writes only tuple, list, "
        "dict (str or int keys) and None nodes, since rebuilding another class would mean "
        "loading a class named by the IR: pass its leaves or a dict instead"
    )


def _encode_spec(spec) -> tuple:
    import jax

    out = []
    for entry in spec:
        if entry is None:
            out.append(None)
        elif entry is jax.sharding.PartitionSpec.UNCONSTRAINED:
            out.append(Enum("PartitionSpec", "UNCONSTRAINED"))
        elif isinstance(entry, tuple):
            out.append(tuple(str(e) for e in entry))
        else:
            out.append(str(entry))
    return tuple(out)


# --- decoding to JAX params -----------------------------------------------------------------

_CLASS_CACHE: dict[str, Any] = {}


def find_jax_class(qualname: str):
    """Looks a class up by qualified name among JAX's modules; never evaluates text."""
    if qualname in _CLASS_CACHE:
        return _CLASS_CACHE[qualname]
    head, _, rest = qualname.partition(".")
    for modname, mod in sorted(sys.modules.items()):
        if not modname.startswith("jax") or mod is None:
            continue
        obj = vars(mod).get(head)
        if isinstance(obj, type) and getattr(obj, "__module__", "").startswith("jax"):
            for part in rest.split(".") if rest else ():
                obj = vars(obj).get(part)
                if obj is None:
                    break
            if isinstance(obj, type) and obj.__qualname__ == qualname:
                _CLASS_CACHE[qualname] = obj
                return obj
    raise UnsupportedError(f"attribute names unknown JAX type {qualname!r}")


def _omitted_rule(*args, **kwargs):
    raise UnsupportedError(
        "custom derivative rules are not kept in the fcir IR: differentiate the program "
        "before capturing it (fcir.capture(jax.grad(f), ...))"
    )


def decode(attr, get_region) -> Any:
    """Attribute -> JAX param value. ``get_region(ref)`` returns the (Closed)Jaxpr."""
    if attr is None or isinstance(attr, (bool, int, float, str)):
        return attr
    if isinstance(attr, tuple):
        return tuple(decode(a, get_region) for a in attr)
    if isinstance(attr, RegionRef):
        return get_region(attr)
    if isinstance(attr, DType):
        return dtype_from_name(attr.name)
    if isinstance(attr, Tensor):
        return attr.value()
    if isinstance(attr, Enum):
        return _decode_enum(attr)
    if isinstance(attr, Record):
        return _decode_record(attr, get_region)
    raise ParseError(f"not an attribute: {attr!r}")


def _decode_enum(attr: Enum):
    import jax

    if attr.type_name == "Sharding" and attr.member == "UNSPECIFIED":
        return named_sharding.UNSPECIFIED
    if attr.type_name == "PRNGImpl":
        impl = prng.prngs.get(attr.member)
        if impl is None:
            raise ParseError(f"unknown PRNG implementation {attr.member!r}")
        return impl
    if attr.type_name == "checkpoint_policy":
        return getattr(jax.checkpoint_policies, attr.member, None)
    if attr.type_name == "Omitted":
        return _OMITTED_COMPUTATION if attr.member == "computation" else _OmittedFun()
    if attr.type_name == "Primitive":
        if attr.member not in PARAM_PRIMITIVES:
            raise ParseError(
                f"#Primitive.{attr.member}: only {', '.join(PARAM_PRIMITIVES)} are primitives "
                "an attribute may name"
            )
        from jax import lax

        return getattr(lax, f"{attr.member}_p")
    if attr.type_name == "AxisType":
        return jax.sharding.AxisType[attr.member]
    if attr.type_name == "PartitionSpec" and attr.member == "UNCONSTRAINED":
        return jax.sharding.PartitionSpec.UNCONSTRAINED
    cls = find_jax_class(attr.type_name)
    if not issubclass(cls, enum.Enum) or attr.member not in cls.__members__:
        raise ParseError(f"{attr.type_name} has no member {attr.member!r}")
    return cls[attr.member]


class _OmittedFun:
    """Stands for a derivative-rule callable the IR does not keep."""

    def __call__(self, *args, **kwargs):
        _omitted_rule()

    def call_wrapped(self, *args, **kwargs):
        _omitted_rule()


class _OmittedComputation:
    """Stands for a reduction's Python function; JAX uses the region (``jaxpr``) only.
    One instance, so that equal ops give equal (cacheable) params."""

    def __call__(self, *args, **kwargs):
        raise UnsupportedError(
            "the Python function of a jax.reduce is not kept in the fcir IR; its region "
            "(the jaxpr param) is the computation"
        )


_OMITTED_COMPUTATION = _OmittedComputation()


def _decode_treedef(node):
    import jax

    def skeleton(n):
        if isinstance(n, Enum) and n.type_name == "PyTreeDef" and n.member in ("LEAF", "NONE"):
            return 0 if n.member == "LEAF" else None
        if isinstance(n, Record) and n.type_name in ("PyTreeDef.tuple", "PyTreeDef.list"):
            kids = [skeleton(k) for k in n.get("items", ())]
            return tuple(kids) if n.type_name == "PyTreeDef.tuple" else kids
        if isinstance(n, Record) and n.type_name == "PyTreeDef.dict":
            keys, items = n.get("keys", ()), n.get("items", ())
            if len(keys) != len(items) or any(type(k) not in (str, int) for k in keys):
                raise ParseError("#PyTreeDef.dict needs as many str or int keys as items")
            return dict(zip(keys, (skeleton(k) for k in items)))
        raise ParseError(f"not a PyTreeDef node: {n!r}")

    try:
        return jax.tree_util.tree_structure(skeleton(node))
    except (TypeError, ValueError) as e:  # e.g. int and str keys in one dict
        raise ParseError(f"#PyTreeDef: {e}") from None


def _decode_spec(entries):
    import jax

    out = []
    for e in entries:
        if isinstance(e, Enum):
            out.append(jax.sharding.PartitionSpec.UNCONSTRAINED)
        else:
            out.append(e)
    return jax.sharding.PartitionSpec(*out)


def _decode_mesh(rec: Record):
    import jax

    names = tuple(rec.get("axis_names", ()))
    sizes = tuple(rec.get("axis_sizes", ()))
    types = tuple(jax.sharding.AxisType[t.member] for t in rec.get("axis_types", ()))
    # Under ``jax.set_mesh`` (and inside shard_map) JAX compares meshes with the
    # context's abstract mesh, which also carries the device kind and, in shard_map,
    # Manual axis types: the same axes there mean that mesh.
    current = jax.sharding.get_abstract_mesh()
    if (
        names and current is not None and tuple(current.axis_names) == names
        and tuple(current.axis_sizes) == sizes
        and all(c == t or c == jax.sharding.AxisType.Manual
                for c, t in zip(current.axis_types, types or current.axis_types))
    ):
        return current
    return jax.sharding.AbstractMesh(sizes, names, axis_types=types or None)


def _concrete(mesh):
    """An abstract mesh laid over this process's devices (in id order), when they fit."""
    import jax

    devices = jax.devices()
    if mesh.size == 0 or mesh.size > len(devices):
        return mesh
    return jax.sharding.Mesh(
        np.array(devices[: mesh.size]).reshape(mesh.axis_sizes),
        mesh.axis_names,
        axis_types=mesh.axis_types,
    )


def _decode_record(attr: Record, get_region):
    import jax

    if attr.type_name == "PyTreeDef":
        return _decode_treedef(attr.get("root"))
    if attr.type_name == "AbstractMesh":
        return _decode_mesh(attr)
    if attr.type_name == "Mesh":
        return _concrete(_decode_mesh(attr))
    if attr.type_name == "PartitionSpec":
        return _decode_spec(attr.get("spec", ()))
    if attr.type_name == "NamedSharding":
        rec = attr.get("mesh")
        mesh = _decode_mesh(rec)
        if rec.type_name == "Mesh":
            mesh = _concrete(mesh)
        return jax.sharding.NamedSharding(mesh, _decode_spec(attr.get("spec", ())))
    cls = find_jax_class(attr.type_name)
    kwargs = {k: decode(v, get_region) for k, v in attr.fields}
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise ParseError(f"cannot build {attr.type_name} from fields {list(kwargs)}: {e}") from e
