"""Module <-> ``fcir.v1.Module`` protobuf bytes.

Serialization is deterministic (values numbered in reading order, attributes sorted,
protobuf's deterministic mode). Deserialization validates as it reads: any malformed
input is a ParseError (or a VersionError for a newer ir_version), never a protobuf
DecodeError, KeyError or IndexError.
"""

from __future__ import annotations

import math
import re

from fcir._proto import module_pb2 as pb
from fcir.errors import ParseError, VersionError
from fcir.ir import attrs as A
from fcir.ir.nodes import (
    CODECS,
    IR_VERSION,
    Func,
    Module,
    Op,
    Region,
    Value,
    check_names,
    check_structure,
    is_name,
    value_numbering,
)
from fcir.ir.types import SERVER, PlacedType, Structure, TensorType, Type, dtype_from_name
from fcir.version import __version__

_KINDS = {
    "leaf": pb.Structure.LEAF,
    "none": pb.Structure.NONE,
    "tuple": pb.Structure.TUPLE,
    "list": pb.Structure.LIST,
    "dict": pb.Structure.DICT,
    "namedtuple": pb.Structure.NAMEDTUPLE,
    "custom": pb.Structure.CUSTOM,
}
_KIND_NAMES = {v: k for k, v in _KINDS.items()}

# Names must read back from the canonical text (see the tokens in fcir.ir.text).
_OP_NAME = re.compile(r"[A-Za-z_][\w.]*(?:-\w[\w.]*)*")
_TYPE_NAME = re.compile(r"[A-Za-z_][\w.]*")
_LABEL = re.compile(r"\w+")


def _producer() -> str:
    import jax

    return f"fcir {__version__} / jax {jax.__version__}"


# --- writing ----------------------------------------------------------------------------


def to_proto(module: Module) -> pb.Module:
    check_names(module)
    out = pb.Module(ir_version=module.ir_version, name=module.name, private=module.private)
    for name, n in module.placements:
        out.placements.add(name=name, cardinality=n)
    for f in module.funcs:
        names = value_numbering(f)
        pf = out.funcs.add(name=f.name)
        _write_region(pf.body, f.body, names)
        if f.arg_structure is not None:
            _write_structure(pf.arg_structure, f.arg_structure)
        if f.result_structure is not None:
            _write_structure(pf.result_structure, f.result_structure)
    return out


def to_bytes(module: Module) -> bytes:
    return to_proto(module).SerializeToString(deterministic=True)


def _write_type(msg: pb.Type, t: Type) -> None:
    if isinstance(t, TensorType):
        msg.tensor.dtype = t.dtype
        msg.tensor.shape.extend(t.shape)
    else:
        msg.placed.placement = t.placement
        msg.placed.all_equal = t.all_equal
        _write_type(msg.placed.member, t.member)


def _write_region(msg: pb.Region, region: Region, names) -> None:
    msg.label = region.label
    for v in region.params:
        d = msg.params.add(id=names[v])
        _write_type(d.type, v.type)
    for op in region.ops:
        po = msg.ops.add(name=op.name, location=op.location)
        po.operands.extend(names[v] for v in op.operands)
        for v in op.results:
            d = po.results.add(id=names[v])
            _write_type(d.type, v.type)
        for k in sorted(op.attrs):
            na = po.attributes.add(key=k)
            _write_attr(na.value, op.attrs[k])
        for sub in op.regions:
            _write_region(po.regions.add(), sub, names)
    msg.results.extend(names[v] for v in region.results)


def _write_attr(msg: pb.Attr, a) -> None:
    if a is None:
        msg.none.SetInParent()
    elif isinstance(a, bool):
        msg.bool = a
    elif isinstance(a, int):
        msg.int = a
    elif isinstance(a, float):
        msg.float = a
    elif isinstance(a, str):
        msg.string = a
    elif isinstance(a, tuple):
        msg.list.SetInParent()
        for x in a:
            _write_attr(msg.list.items.add(), x)
    elif isinstance(a, A.DType):
        msg.dtype = a.name
    elif isinstance(a, A.Enum):
        msg.enum.type_name = a.type_name
        msg.enum.member = a.member
    elif isinstance(a, A.Record):
        msg.record.type_name = a.type_name
        for k, v in a.fields:
            _write_attr(msg.record.fields.add(key=k).value, v)
    elif isinstance(a, A.RegionRef):
        msg.region.index = a.index
        msg.region.closed = a.closed
    elif isinstance(a, A.Tensor):
        if a.data is None:
            raise ParseError(
                "cannot serialize a constant whose data was elided from the text; parse text "
                "written with full_constants=True"
            )
        msg.tensor.dtype = a.dtype
        msg.tensor.shape.extend(a.shape)
        msg.tensor.data = a.data
    else:
        raise TypeError(f"not an attribute: {a!r}")


def _write_structure(msg: pb.Structure, s: Structure) -> None:
    msg.kind = _KINDS[s.kind]
    if s.kind == "leaf":
        msg.leaf = s.leaf
    msg.names.extend(s.names)
    msg.type_name = s.type_name
    for c in s.children:
        _write_structure(msg.children.add(), c)


# --- reading ----------------------------------------------------------------------------


def from_bytes(data: bytes) -> Module:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ParseError(f"Module.deserialize expects bytes, got {type(data).__name__}")
    msg = pb.Module()
    try:
        msg.ParseFromString(bytes(data))
    except Exception as e:  # google.protobuf.message.DecodeError and friends
        raise ParseError(f"not a serialized fcir.v1.Module: {e}") from None
    return from_proto(msg)


def from_proto(msg: pb.Module) -> Module:
    if msg.ir_version > IR_VERSION:
        raise VersionError(
            f"module @{msg.name} has ir_version={msg.ir_version}; this fcir reads ir_version "
            f"<= {IR_VERSION}: upgrade fcir"
        )
    if msg.ir_version < 1:
        raise ParseError("serialized module has no ir_version (is this an fcir.v1.Module?)")
    if not is_name(msg.name):
        raise ParseError(f"module name {msg.name!r} is not an identifier")
    placements = []
    for p in msg.placements:
        if not is_name(p.name) or p.name == SERVER or p.name in dict(placements):
            raise ParseError(f"bad placement name {p.name!r}")
        if p.cardinality < 1:
            raise ParseError(f"placement '{p.name}' has cardinality {p.cardinality}")
        placements.append((p.name, int(p.cardinality)))
    reader = _Reader({p for p, _ in placements})
    funcs = []
    for f in msg.funcs:
        if not is_name(f.name) or any(g.name == f.name for g in funcs):
            raise ParseError(f"bad or repeated func name {f.name!r}")
        reader.values = {}
        body = reader.region(f.body)
        arg_s = reader.structure(f.arg_structure) if f.HasField("arg_structure") else None
        res_s = reader.structure(f.result_structure) if f.HasField("result_structure") else None
        if arg_s is not None:
            check_structure(arg_s, len(body.params), f"func @{f.name} argument structure")
        if res_s is not None:
            check_structure(res_s, len(body.results), f"func @{f.name} result structure")
        funcs.append(Func(f.name, body, arg_s, res_s))
    if not any(f.name == "main" for f in funcs):
        raise ParseError(f"module @{msg.name} has no func @main")
    return Module(msg.name, placements, funcs, msg.ir_version, private=msg.private)


class _Reader:
    def __init__(self, placements: set[str]):
        self.placements = placements
        self.values: dict[int, Value] = {}

    def type(self, msg: pb.Type, depth: int = 0) -> Type:
        which = msg.WhichOneof("kind")
        if which == "tensor":
            try:
                dtype_from_name(msg.tensor.dtype)
            except ParseError:
                raise
            except Exception:
                raise ParseError(f"unknown dtype {msg.tensor.dtype!r}") from None
            if any(d < 0 for d in msg.tensor.shape):
                raise ParseError(f"negative dimension in {list(msg.tensor.shape)}")
            return TensorType(msg.tensor.dtype, tuple(int(d) for d in msg.tensor.shape))
        if which == "placed":
            p = msg.placed.placement
            if p != SERVER and p not in self.placements:
                raise ParseError(f"type names undeclared placement {p!r}")
            if depth > 16:
                raise ParseError("placed types nested too deeply")
            return PlacedType(self.type(msg.placed.member, depth + 1), p,
                              msg.placed.all_equal or p == SERVER)
        raise ParseError("a value has no type")

    def define(self, d: pb.ValueDef) -> Value:
        if d.id in self.values:
            raise ParseError(f"value %{d.id} is defined twice")
        v = Value(self.type(d.type))
        self.values[d.id] = v
        return v

    def use(self, i: int) -> Value:
        v = self.values.get(i)
        if v is None:
            raise ParseError(f"value %{i} is used before it is defined")
        return v

    def region(self, msg: pb.Region, depth: int = 0) -> Region:
        if depth > 64:
            raise ParseError("regions nested too deeply")
        params = [self.define(d) for d in msg.params]
        ops = []
        if not _LABEL.fullmatch(msg.label or "body"):
            raise ParseError(f"bad region label {msg.label!r}")
        for o in msg.ops:
            if "." not in o.name or not _OP_NAME.fullmatch(o.name):
                raise ParseError(f"op name {o.name!r} is not a namespaced name like jax.add")
            operands = [self.use(i) for i in o.operands]
            results = [self.define(d) for d in o.results]
            attrs = {}
            for na in o.attributes:
                if not na.key.isidentifier() or na.key in attrs:
                    raise ParseError(f"{o.name}: bad or repeated attribute {na.key!r}")
                attrs[na.key] = self.attr(na.value)
            regions = [self.region(r, depth + 1) for r in o.regions]
            ops.append(Op(o.name, operands, results, attrs, regions, o.location))
        results = [self.use(i) for i in msg.results]
        return Region(params, ops, results, msg.label or "body")

    def attr(self, msg: pb.Attr, depth: int = 0):
        if depth > 64:
            raise ParseError("attribute nested too deeply")
        which = msg.WhichOneof("kind")
        if which == "none":
            return None
        if which in ("int", "bool", "string"):
            return getattr(msg, which)
        if which == "float":
            x = msg.float
            return x if not math.isnan(x) else float("nan")
        if which == "dtype":
            dtype_from_name(msg.dtype)
            return A.DType(msg.dtype)
        if which == "list":
            return tuple(self.attr(x, depth + 1) for x in msg.list.items)
        if which == "enum":
            if not _TYPE_NAME.fullmatch(msg.enum.type_name) or not _LABEL.fullmatch(
                msg.enum.member
            ):
                raise ParseError(f"bad enum {msg.enum.type_name!r}.{msg.enum.member!r}")
            return A.Enum(msg.enum.type_name, msg.enum.member)
        if which == "record":
            if not _TYPE_NAME.fullmatch(msg.record.type_name):
                raise ParseError(f"bad record type name {msg.record.type_name!r}")
            for f in msg.record.fields:
                if not f.key.isidentifier():
                    raise ParseError(f"record {msg.record.type_name}: bad field {f.key!r}")
            return A.Record(
                msg.record.type_name,
                tuple((f.key, self.attr(f.value, depth + 1)) for f in msg.record.fields),
            )
        if which == "region":
            return A.RegionRef(msg.region.index, msg.region.closed)
        if which == "tensor":
            t = A.Tensor(msg.tensor.dtype, tuple(int(d) for d in msg.tensor.shape),
                         bytes(msg.tensor.data))
            if any(d < 0 for d in t.shape):
                raise ParseError("negative dimension in a constant")
            t.numpy()  # validates dtype and length
            return t
        raise ParseError("an attribute has no value")

    def structure(self, msg: pb.Structure, depth: int = 0) -> Structure:
        if depth > 256:
            raise ParseError("structure nested too deeply")
        kind = _KIND_NAMES.get(msg.kind)
        if kind is None:
            raise ParseError(f"unknown structure kind {msg.kind}")
        kids = tuple(self.structure(c, depth + 1) for c in msg.children)
        if kind in ("dict", "namedtuple", "custom") and len(msg.names) != len(kids):
            raise ParseError(f"{kind} structure needs one name per child")
        return Structure(kind, kids, tuple(msg.names), msg.type_name, int(msg.leaf) if kind == "leaf" else -1)


CODECS["to_bytes"] = to_bytes  # Module.serialize
CODECS["from_bytes"] = from_bytes  # Module.deserialize
