"""federated_language types on the wire (``fcir.compat.federated_language.Type``).

fcir tensors map to ``TensorType`` with TensorFlow's DataType numbers; a value at the
server is ``T@SERVER`` (all-equal), ``{T}@clients`` is ``{T}@CLIENTS`` and the
all-equal ``T@clients!`` is ``T@CLIENTS``; pytree structures map to struct types whose
element names are the dict keys / field names (positional elements are unnamed).
"""

from __future__ import annotations

import jax
import numpy as np

from fcir._proto import computation_pb2 as pb
from fcir.ir.types import SERVER, Structure, TensorType, Type, dtype_from_name

CLIENTS_URI = "clients"
SERVER_URI = "server"

# fcir dtype name -> TensorFlow DataType number (the wire's DataType enum).
DATA_TYPES = {
    "f32": pb.DT_FLOAT,
    "f64": pb.DT_DOUBLE,
    "i32": pb.DT_INT32,
    "u8": pb.DT_UINT8,
    "i16": pb.DT_INT16,
    "i8": pb.DT_INT8,
    "c64": pb.DT_COMPLEX64,
    "i64": pb.DT_INT64,
    "bool": pb.DT_BOOL,
    "bf16": pb.DT_BFLOAT16,
    "u16": pb.DT_UINT16,
    "c128": pb.DT_COMPLEX128,
    "f16": pb.DT_HALF,
    "u32": pb.DT_UINT32,
    "u64": pb.DT_UINT64,
}
DTYPE_NAMES = {v: k for k, v in DATA_TYPES.items()}
_TEXT_NAMES = {
    "f32": "float32",
    "f64": "float64",
    "f16": "float16",
    "bf16": "bfloat16",
    "bool": "bool",
    "c64": "complex64",
    "c128": "complex128",
}


def unsupported_dtype(dtype: str) -> str | None:
    """Why a tensor of ``dtype`` cannot cross a part boundary, or None if it can."""
    if dtype.startswith("key<"):
        return (
            f"PRNG key dtype {dtype} has no federated_language DataType: pass "
            "jax.random.key_data(keys) (uint32) instead and jax.random.wrap_key_data it "
            "where it is used"
        )
    if dtype not in DATA_TYPES:
        return (
            f"dtype {dtype} has no federated_language DataType (supported: "
            f"{', '.join(sorted(DATA_TYPES))})"
        )
    np_dtype = np.dtype(dtype_from_name(dtype))
    if jax.dtypes.canonicalize_dtype(np_dtype) != np_dtype:
        return f"dtype {dtype} needs jax_enable_x64 to be set when exporting and running"
    return None


# --- constructors -----------------------------------------------------------------------


def tensor_type(t: TensorType) -> pb.Type:
    out = pb.Type()
    out.tensor.dtype = DATA_TYPES[t.dtype]
    out.tensor.dims.extend(t.shape)
    return out


def federated_type(member: pb.Type, uri: str, all_equal: bool) -> pb.Type:
    out = pb.Type()
    out.federated.placement.value.uri = uri
    out.federated.all_equal = all_equal
    out.federated.member.CopyFrom(member)
    return out


def value_type(t: Type) -> pb.Type:
    """The wire type of an fcir value type (placements: server and one client level)."""
    if isinstance(t, TensorType):
        return tensor_type(t)
    member = value_type(t.member)
    if t.placement == SERVER:
        return federated_type(member, SERVER_URI, True)
    return federated_type(member, CLIENTS_URI, t.all_equal)


def struct_type(elements: list[tuple[str, pb.Type]]) -> pb.Type:
    out = pb.Type()
    out.struct.SetInParent()
    for name, t in elements:
        e = out.struct.element.add(name=name)
        e.value.CopyFrom(t)
    return out


def function_type(parameter: pb.Type | None, result: pb.Type) -> pb.Type:
    out = pb.Type()
    out.function.SetInParent()
    if parameter is not None:
        out.function.parameter.CopyFrom(parameter)
    out.function.result.CopyFrom(result)
    return out


def structure_type(s: Structure, leaves: list[pb.Type]) -> pb.Type:
    """The struct type of pytree structure ``s`` whose leaf ``i`` has type ``leaves[i]``."""
    if s.kind == "leaf":
        return leaves[s.leaf]
    if s.kind == "none":
        return struct_type([])
    names = s.names if s.names else ("",) * len(s.children)
    return struct_type([(n, structure_type(c, leaves)) for n, c in zip(names, s.children)])


def element_names(s: Structure) -> list[str]:
    return list(s.names) if s.names else [""] * len(s.children)


def strip_placement(t: pb.Type) -> pb.Type:
    """``<a=X@S, b=Y@S>`` -> ``<a=X, b=Y>``; ``X@P`` -> ``X``."""
    kind = t.WhichOneof("type")
    if kind == "federated":
        return t.federated.member
    if kind == "struct":
        return struct_type([(e.name, strip_placement(e.value)) for e in t.struct.element])
    return t


def clients_not_all_equal(t: pb.Type) -> pb.Type:
    """``T@CLIENTS`` (all-equal) -> ``{T}@CLIENTS`` everywhere in ``t`` (how a zip at the
    clients declares its parameter)."""
    kind = t.WhichOneof("type")
    if kind == "federated" and t.federated.placement.value.uri == CLIENTS_URI:
        return federated_type(t.federated.member, CLIENTS_URI, False)
    if kind == "struct":
        return struct_type([(e.name, clients_not_all_equal(e.value)) for e in t.struct.element])
    return t


# --- text -------------------------------------------------------------------------------


def format_type(t: pb.Type) -> str:
    """federated_language's compact notation: ``<a=float32[3],int32>@SERVER``,
    ``{float32}@CLIENTS``, ``(<x=float32> -> float32)``."""
    kind = t.WhichOneof("type")
    if kind == "tensor":
        name = DTYPE_NAMES.get(t.tensor.dtype, f"dtype{t.tensor.dtype}")
        name = _TEXT_NAMES.get(name, name.replace("i", "int").replace("u", "uint"))
        if t.tensor.unknown_rank:
            return f"{name}[?]"
        dims = ",".join(str(d) if d >= 0 else "?" for d in t.tensor.dims)
        return f"{name}[{dims}]" if t.tensor.dims else name
    if kind == "struct":
        parts = [
            f"{e.name}={format_type(e.value)}" if e.name else format_type(e.value)
            for e in t.struct.element
        ]
        return "<" + ",".join(parts) + ">"
    if kind == "federated":
        f = t.federated
        uri = f.placement.value.uri or f.placement.label.label
        member = format_type(f.member)
        if f.all_equal:
            return f"{member}@{uri.upper()}"
        return f"{{{member}}}@{uri.upper()}"
    if kind == "function":
        param = format_type(t.function.parameter) if t.function.HasField("parameter") else ""
        return f"({param} -> {format_type(t.function.result)})"
    if kind == "sequence":
        return f"{format_type(t.sequence.element)}*"
    if kind == "abstract":
        return t.abstract.label
    if kind == "placement":
        return "placement"
    return "?"
