"""Parts -> XLA: HLO module protos (for the Computation) and jax.export artifacts.

A part runs as ``fcir.Interpreter().run(part, *leaves)`` under ``jax.jit``: the base
interpreter binds each op's JAX primitive, so the compiled code is the program's own
code. Every function here takes and returns flat tuples of arrays: HLO parameter ``i``
is leaf ``i`` of the part's parameters, result ``i`` leaf ``i`` of its results.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import jax
import numpy as np

from fcir import jaxcompat as jc
from fcir.base_interpreter import Interpreter
from fcir.errors import ExportError
from fcir.ir import Func, Module
from fcir.ir.types import runtime_type
from fcir.jaxcompat import config

# Platforms the StableHLO artifacts are lowered for; the bundle runs wherever one of
# them is the default backend.
PLATFORMS = ("cpu", "cuda", "tpu")


def flat_function(module: Module) -> tuple[Callable, list[jax.ShapeDtypeStruct]]:
    """``module``'s main as ``fn(*leaves) -> tuple`` and the specs of its leaves."""
    flat = Module(module.name, module.placements, [Func("main", module.main.body)])

    def fn(*leaves):
        return tuple(Interpreter().run(flat, *leaves))

    specs = []
    for v in module.main.body.params:
        t = runtime_type(v.type, module.cardinality)
        specs.append(jax.ShapeDtypeStruct(t.shape, t.np_dtype))
    return fn, specs


@contextlib.contextmanager
def _no_source_paths():
    """Lowers without the exporting machine's file paths and call stacks in locations, so
    artifacts are reproducible and leak nothing about where they were built."""
    with (
        config.include_full_tracebacks_in_locations(False),
        config.traceback_in_locations_limit(0),
        config.hlo_source_file_canonicalization_regex(".*"),
    ):
        yield


def hlo_module_proto(fn: Callable, specs) -> bytes:
    """Serialized ``xla.HloModuleProto`` of ``fn``; every parameter kept."""
    with _no_source_paths():
        lowered = jax.jit(fn, keep_unused=True).lower(*specs)
        data = lowered.compiler_ir("hlo").as_serialized_hlo_module_proto()
    return _without_module_id(data)


_HLO_MODULE_ID = 5  # HloModuleProto.id: a per-process counter, reassigned when loaded


def _without_module_id(data: bytes) -> bytes:
    """``data`` without ``HloModuleProto.id``, so equal programs give equal bytes."""
    from google.protobuf.internal.decoder import _DecodeVarint

    out, pos = bytearray(), 0
    while pos < len(data):
        start = pos
        tag, pos = _DecodeVarint(data, pos)
        wire = tag & 7
        if wire == 0:
            _, pos = _DecodeVarint(data, pos)
        elif wire == 2:
            size, pos = _DecodeVarint(data, pos)
            pos += size
        elif wire in (1, 5):
            pos += 8 if wire == 1 else 4
        else:  # groups are not used by HloModuleProto
            return data
        if tag >> 3 != _HLO_MODULE_ID:
            out += data[start:pos]
    return bytes(out)


def stablehlo_artifact(fn: Callable, specs) -> tuple[bytes, tuple[str, ...]]:
    """A serialized ``jax.export`` artifact of ``fn`` and the platforms it runs on."""
    problem = jc.export_serialization_problem()
    if problem is not None:
        raise ExportError(
            f"writing StableHLO artifacts needs jax.export serialization: {problem} "
            "(pip install flatbuffers)"
        )
    jitted = jax.jit(fn, keep_unused=True)
    with _no_source_paths():
        try:
            exported = jax.export.export(jitted, platforms=PLATFORMS)(*specs)
        except (NotImplementedError, ValueError):  # no lowering for some platform: host only
            exported = jax.export.export(jitted)(*specs)
        return bytes(exported.serialize()), tuple(exported.platforms)


def load_artifact(data: bytes):
    """The ``jax.export.Exported`` in ``data``."""
    return jax.export.deserialize(bytearray(data))


def spec_of(t) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(t.shape, np.dtype(t.np_dtype))
