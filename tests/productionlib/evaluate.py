"""A small evaluator of federated_language Computations, for tests.

It runs what a production runtime would: Lambda, Block, Call, Struct, Selection,
Reference, Literal, intrinsics with their federated semantics (clients as a Python
list of member values), and Xla pieces compiled from their HloModuleProto through their
parameter and result bindings. It reads the Computation with fcir's compat schema
only, so it checks the bytes, not fcir's in-memory objects.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
from fcir.interpreters.production import wire_types as W
from jax._src import compiler
from jax._src import xla_bridge as xb
from jax._src.lib import _jax

from fcir._proto import computation_pb2 as pb


@dataclasses.dataclass
class Placed:
    """A federated value: one member value at the server, or a list of them at clients."""

    at: str  # "server" or "clients"
    value: object


@dataclasses.dataclass
class Struct:
    names: list
    values: list


@functools.lru_cache(maxsize=64)
def _compile(hlo: bytes):
    backend = xb.get_backend("cpu")
    device = backend.devices()[0]
    exe = backend.compile_and_load(
        _jax.mlir.hlo_to_stablehlo(hlo),
        _jax.DeviceList((device,)),
        compiler.get_compile_options(1, 1),
    )
    return exe, device


def run_hlo(hlo: bytes, args: list[np.ndarray]) -> list[np.ndarray]:
    """Compiles (once) a serialized HloModuleProto and runs it on the CPU."""
    exe, device = _compile(hlo)
    bufs = [jax.device_put(np.asarray(a), device) for a in args]
    outs = exe.execute_sharded(bufs).disassemble_into_single_device_arrays()
    return [np.asarray(o[0]) for o in outs]


class Evaluator:
    def __init__(self, num_clients: int):
        self.n = num_clients
        self.calls: list[str] = []

    def eval(self, c: pb.Computation, env: dict):
        kind = c.WhichOneof("computation")
        if kind == "reference":
            return env[c.reference.name]
        if kind == "lambda":
            lam = getattr(c, "lambda")

            def fn(arg=None):
                inner = dict(env)
                if lam.parameter_name:
                    inner[lam.parameter_name] = arg
                return self.eval(lam.result, inner)

            return fn
        if kind == "block":
            inner = dict(env)
            for local in c.block.local:
                inner[local.name] = self.eval(local.value, inner)
            return self.eval(c.block.result, inner)
        if kind == "call":
            fn = self.eval(c.call.function, env)
            if c.call.HasField("argument"):
                return fn(self.eval(c.call.argument, env))
            return fn()
        if kind == "struct":
            return Struct(
                [e.name for e in c.struct.element],
                [self.eval(e.value, env) for e in c.struct.element],
            )
        if kind == "selection":
            return self.eval(c.selection.source, env).values[c.selection.index]
        if kind == "literal":
            return literal(c.literal.value)
        if kind == "intrinsic":
            self.calls.append(c.intrinsic.uri)
            return self.intrinsic(c.intrinsic.uri)
        if kind == "xla":
            return self.xla(c)
        raise NotImplementedError(kind)

    # -- local code -------------------------------------------------------------------------

    def xla(self, c: pb.Computation):
        assert c.xla.hlo_module.type_url == "type.googleapis.com/xla.HloModuleProto"
        hlo = c.xla.hlo_module.value
        ftype = c.type.function

        def fn(arg=None):
            args: dict[int, np.ndarray] = {}
            if c.xla.HasField("parameter"):
                bind(c.xla.parameter, ftype.parameter, arg, args)
            else:
                assert arg is None and not ftype.HasField("parameter")
            outs = run_hlo(hlo, [args[i] for i in range(len(args))])
            return unbind(c.xla.result, ftype.result, outs)

        return fn

    # -- intrinsics -------------------------------------------------------------------------

    def intrinsic(self, uri: str):
        n = self.n
        reductions = {
            "federated_sum": lambda xs: _tree(lambda *m: _sum(m), *xs),
            "federated_mean": lambda xs: _tree(
                lambda *m: (_sum(m) / len(m)).astype(m[0].dtype), *xs
            ),
            "federated_min": lambda xs: _tree(lambda *m: np.minimum.reduce(m), *xs),
            "federated_max": lambda xs: _tree(lambda *m: np.maximum.reduce(m), *xs),
        }
        if uri in reductions:
            return lambda x: Placed("server", reductions[uri](_members(x, n)))
        if uri == "federated_broadcast":
            return lambda x: Placed("clients", [x.value] * n)
        if uri == "federated_apply":
            return lambda a: Placed("server", a.values[0](a.values[1].value))
        if uri == "federated_map":
            return lambda a: Placed("clients", [a.values[0](m) for m in _members(a.values[1], n)])
        if uri in ("federated_zip_at_server", "federated_zip_at_clients"):
            at = "server" if uri.endswith("server") else "clients"
            if at == "server":
                return lambda s: Placed("server", _zip(s, None))
            return lambda s: Placed("clients", [_zip(s, i) for i in range(n)])
        if uri == "federated_value_at_server":
            return lambda x: Placed("server", x)
        if uri == "federated_value_at_clients":
            return lambda x: Placed("clients", [x] * n)
        if uri == "federated_weighted_mean":

            def wmean(a):
                xs, ws = _members(a.values[0], n), _members(a.values[1], n)
                num = _sum([x * w for x, w in zip(xs, ws)])
                return Placed("server", (num / _sum(ws)).astype(xs[0].dtype))

            return wmean
        if uri == "federated_secure_sum_bitwidth":

            def secure(a):
                xs, bw = _members(a.values[0], n), int(a.values[1])
                # Each client's value must lie in [0, 2**bitwidth), its bits read unsigned.
                unsigned = [x.view(np.dtype(f"u{x.dtype.itemsize}")).astype(np.uint64) for x in xs]
                assert all(np.all(u < 2**bw) for u in unsigned), "client value out of range"
                return Placed("server", _sum(xs))

            return secure
        if uri == "federated_aggregate":

            def aggregate(a):
                value, zero, accumulate, merge, report = a.values
                members = _members(value, n)
                # Two partial accumulators merged: what an aggregation tree does.
                halves = [members[: n // 2], members[n // 2 :]]
                partials = []
                for half in halves:
                    u = zero
                    for t in half:
                        u = accumulate(Struct(["", ""], [u, t]))
                    partials.append(u)
                return Placed("server", report(merge(Struct(["", ""], partials))))

            return aggregate
        raise NotImplementedError(uri)


def _members(x: Placed, n: int) -> list:
    assert isinstance(x, Placed) and x.at == "clients" and len(x.value) == n, x
    return list(x.value)


def _sum(values):
    total = values[0]
    for v in values[1:]:
        total = total + v
    return np.asarray(total).astype(np.asarray(values[0]).dtype)


def _tree(fn, *members):
    first = members[0]
    if isinstance(first, Struct):
        return Struct(
            first.names,
            [_tree(fn, *(m.values[i] for m in members)) for i in range(len(first.values))],
        )
    return fn(*[np.asarray(m) for m in members])


def _zip(s, i):
    if isinstance(s, Placed):
        return s.value if i is None else s.value[i]
    assert isinstance(s, Struct)
    return Struct(s.names, [_zip(v, i) for v in s.values])


def literal(a: pb.Array) -> np.ndarray:
    field = a.WhichOneof("kind")
    dtype = W.DTYPE_NAMES[a.dtype]
    from fcir.ir.types import dtype_from_name

    values = list(getattr(a, field).value)
    return np.asarray(values, dtype_from_name(dtype)).reshape(tuple(a.shape.dim))


def bind(b: pb.Xla.Binding, t: pb.Type, value, out: dict) -> None:
    """Flattens ``value`` of type ``t`` into HLO parameters by binding ``b``."""
    if b.WhichOneof("binding") == "tensor":
        assert t.WhichOneof("type") == "tensor"
        arr = np.asarray(value)
        assert arr.shape == tuple(t.tensor.dims), (arr.shape, t)
        out[b.tensor.index] = arr
        return
    assert isinstance(value, Struct) and len(value.values) == len(b.struct.element)
    for sub, et, v in zip(b.struct.element, t.struct.element, value.values):
        bind(sub, et.value, v, out)


def unbind(b: pb.Xla.Binding, t: pb.Type, outs: list):
    if b.WhichOneof("binding") == "tensor":
        arr = outs[b.tensor.index]
        assert arr.shape == tuple(t.tensor.dims), (arr.shape, t)
        return arr
    return Struct(
        [e.name for e in t.struct.element],
        [unbind(sub, e.value, outs) for sub, e in zip(b.struct.element, t.struct.element)],
    )


def round_argument(param_type: pb.Type, leaves: list, counter=None):
    """The round's argument from its flat leaves (client leaves split per member)."""
    counter = counter if counter is not None else [0]
    kind = param_type.WhichOneof("type")
    if kind == "struct":
        return Struct(
            [e.name for e in param_type.struct.element],
            [round_argument(e.value, leaves, counter) for e in param_type.struct.element],
        )
    x = np.asarray(leaves[counter[0]])
    counter[0] += 1
    if param_type.federated.placement.value.uri == "server":
        return Placed("server", x)
    return Placed("clients", [x[i] for i in range(x.shape[0])])


def result_leaves(value) -> list:
    """The round's result leaves in order (each a server value)."""
    if isinstance(value, Struct):
        return [leaf for v in value.values for leaf in result_leaves(v)]
    assert isinstance(value, Placed) and value.at == "server", value
    return [np.asarray(value.value)]


def evaluate(data: bytes, leaves: list, num_clients: int) -> tuple[list, list[str]]:
    """Runs Computation bytes on the round's flat argument leaves; returns the flat
    result leaves and the intrinsics called."""
    c = pb.Computation.FromString(data)
    ev = Evaluator(num_clients)
    fn = ev.eval(c, {})
    ftype = c.type.function
    if ftype.HasField("parameter"):
        out = fn(round_argument(ftype.parameter, leaves))
    else:
        out = fn()
    return result_leaves(out), ev.calls
