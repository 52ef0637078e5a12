"""The round as one federated_language ``Computation``: a federated lambda whose local
pieces are ``Xla`` computations and whose federated steps are intrinsic calls.

Shape of the lambda (``arg`` is the round's argument pytree, every leaf a federated
value; each line is a local of one Block)::

    (arg -> let
       server_state     = federated_zip_at_server(<S leaves selected from arg>)
       prepared         = federated_apply(<server_prepare, server_state>)
       broadcast_input  = federated_apply(<(p -> p[0]), prepared>)
       temporary        = federated_apply(<(p -> p[1]), prepared>)
       broadcast_output = federated_broadcast(broadcast_input)
       client_input     = federated_zip_at_clients(<<D leaves selected from arg>,
                                                    broadcast_output>)
       client_output    = federated_map(<client_work, client_input>)
       value_v12        = federated_map(<(a -> a[i]), client_output>)      per input
       aggregate_v12    = federated_mean(value_v12)                       per intrinsic
       aggregated       = federated_zip_at_server(<v12=aggregate_v12, ...>)
       result_input     = federated_zip_at_server(<temporary, aggregated>)
       result           = federated_apply(<server_result, result_input>)
     in <the result pytree, each leaf federated_apply(<(r -> r[path]), result>)>)

Every node carries its type; intrinsic nodes carry the concrete type of their use.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax.numpy as jnp
import numpy as np

from fcir._proto import computation_pb2 as pb
from fcir.errors import ParseError
from fcir.fed import ops
from fcir.ir import Module
from fcir.ir.types import Structure, TensorType, dtype_name

from . import intrinsics as I
from . import lowering
from . import wire_types as W
from .rewrite import leaf_paths, shift, tensor
from .splitting import Aggregation, Split

HLO_TYPE_URL = "type.googleapis.com/xla.HloModuleProto"
AGGREGATE_WITH = ("intrinsics", I.AGGREGATE)
# Reductions that aggregate_with="federated_aggregate" lowers to federated_aggregate.
AGGREGATE_LOWERED = frozenset(n for n, i in I.INTRINSICS.items() if i.lowering is not None)


# --- building blocks --------------------------------------------------------------------


def _node(t: pb.Type) -> pb.Computation:
    c = pb.Computation()
    c.type.CopyFrom(t)
    return c


def reference(name: str, t: pb.Type) -> pb.Computation:
    c = _node(t)
    c.reference.name = name
    return c


def selection(source: pb.Computation, index: int) -> pb.Computation:
    c = _node(source.type.struct.element[index].value)
    c.selection.source.CopyFrom(source)
    c.selection.index = index
    return c


def struct(elements: list[tuple[str, pb.Computation]]) -> pb.Computation:
    c = _node(W.struct_type([(n, e.type) for n, e in elements]))
    c.struct.SetInParent()
    for n, e in elements:
        c.struct.element.add(name=n).value.CopyFrom(e)
    return c


def call(fn: pb.Computation, arg: pb.Computation | None = None) -> pb.Computation:
    c = _node(fn.type.function.result)
    c.call.function.CopyFrom(fn)
    if arg is not None:
        c.call.argument.CopyFrom(arg)
    return c


def lam(param_name: str, param_type: pb.Type | None, result: pb.Computation) -> pb.Computation:
    c = _node(W.function_type(param_type, result.type))
    body = getattr(c, "lambda")
    body.SetInParent()
    if param_type is not None:
        body.parameter_name = param_name
    body.result.CopyFrom(result)
    return c


def block(locals_: list[tuple[str, pb.Computation]], result: pb.Computation) -> pb.Computation:
    c = _node(result.type)
    for name, value in locals_:
        c.block.local.add(name=name).value.CopyFrom(value)
    c.block.result.CopyFrom(result)
    return c


def intrinsic(uri: str, t: pb.Type) -> pb.Computation:
    c = _node(t)
    c.intrinsic.uri = uri
    return c


def literal_int32(value: int) -> pb.Computation:
    c = _node(W.tensor_type(TensorType("i32", ())))
    c.literal.value.dtype = pb.DT_INT32
    c.literal.value.shape.SetInParent()
    c.literal.value.int32_list.value.append(value)
    return c


def binding(s: Structure) -> pb.Xla.Binding:
    """The binding mirroring structure ``s``: leaf ``i`` is HLO parameter (result) ``i``."""
    b = pb.Xla.Binding()
    if s.kind == "leaf":
        b.tensor.index = s.leaf
    else:
        b.struct.SetInParent()
        for c in s.children:
            b.struct.element.add().CopyFrom(binding(c))
    return b


def xla(
    hlo: bytes,
    param: Structure | None,
    param_leaves: list[TensorType],
    result: Structure,
    result_leaves: list[TensorType],
) -> pb.Computation:
    """An Xla computation; ``param`` None makes a no-argument function."""
    ptype = None
    if param is not None:
        ptype = W.structure_type(param, [W.tensor_type(t) for t in param_leaves])
    rtype = W.structure_type(result, [W.tensor_type(t) for t in result_leaves])
    c = _node(W.function_type(ptype, rtype))
    c.xla.hlo_module.type_url = HLO_TYPE_URL
    c.xla.hlo_module.value = hlo
    if param is not None:
        c.xla.parameter.CopyFrom(binding(param))
    c.xla.result.CopyFrom(binding(result))
    return c


def xla_of_function(
    fn: Callable,
    param: Structure | None,
    param_leaves: list[TensorType],
    result: Structure,
    result_leaves: list[TensorType],
) -> pb.Computation:
    """Lowers ``fn(*param leaves) -> tuple of result leaves`` to an Xla computation."""
    specs = [lowering.spec_of(t) for t in param_leaves]
    return xla(lowering.hlo_module_proto(fn, specs), param, param_leaves, result, result_leaves)


def xla_of_part(module: Module, hlo: bytes) -> pb.Computation:
    """The Xla computation of a server part or of client work's member module."""
    f = module.main
    return xla(
        hlo,
        f.arg_structure,
        [tensor(v.type) for v in f.body.params],
        f.result_structure,
        [tensor(v.type) for v in f.body.results],
    )


# --- federated intrinsics ---------------------------------------------------------------


def _pair(a: pb.Computation, b: pb.Computation) -> pb.Computation:
    return struct([("", a), ("", b)])


def federated_apply(fn: pb.Computation, arg: pb.Computation) -> pb.Computation:
    out = W.federated_type(fn.type.function.result, W.SERVER_URI, True)
    pair = _pair(fn, arg)
    return call(intrinsic(I.APPLY, W.function_type(pair.type, out)), pair)


def federated_map(fn: pb.Computation, arg: pb.Computation) -> pb.Computation:
    out = W.federated_type(fn.type.function.result, W.CLIENTS_URI, False)
    pair = _pair(fn, arg)
    return call(intrinsic(I.MAP, W.function_type(pair.type, out)), pair)


def federated_broadcast(x: pb.Computation) -> pb.Computation:
    out = W.federated_type(x.type.federated.member, W.CLIENTS_URI, True)
    return call(intrinsic(I.BROADCAST, W.function_type(x.type, out)), x)


def _has_federated(t: pb.Type) -> bool:
    kind = t.WhichOneof("type")
    if kind == "federated":
        return True
    return kind == "struct" and any(_has_federated(e.value) for e in t.struct.element)


def federated_zip(value: pb.Computation, uri: str) -> pb.Computation:
    """A struct of values placed at ``uri`` -> one federated struct. A struct without
    federated leaves (an empty one) becomes ``federated_value_at_<uri>`` of itself."""
    member = W.strip_placement(value.type)
    at_server = uri == W.SERVER_URI
    out = W.federated_type(member, uri, at_server)
    if not _has_federated(value.type):
        name = I.VALUE_AT_SERVER if at_server else I.VALUE_AT_CLIENTS
        out = W.federated_type(member, uri, True)
        return call(intrinsic(name, W.function_type(value.type, out)), value)
    param = value.type if at_server else W.clients_not_all_equal(value.type)
    name = I.ZIP_AT_SERVER if at_server else I.ZIP_AT_CLIENTS
    return call(intrinsic(name, W.function_type(param, out)), value)


def federated_reduce(uri: str, x: pb.Computation) -> pb.Computation:
    """``federated_sum`` / ``_mean`` / ``_min`` / ``_max``: ``{T}@C -> T@S``."""
    out = W.federated_type(x.type.federated.member, W.SERVER_URI, True)
    return call(intrinsic(uri, W.function_type(x.type, out)), x)


def federated_weighted_mean(x: pb.Computation, w: pb.Computation) -> pb.Computation:
    out = W.federated_type(x.type.federated.member, W.SERVER_URI, True)
    pair = _pair(x, w)
    return call(intrinsic(I.WEIGHTED_MEAN, W.function_type(pair.type, out)), pair)


def federated_secure_sum_bitwidth(x: pb.Computation, bitwidth: int) -> pb.Computation:
    out = W.federated_type(x.type.federated.member, W.SERVER_URI, True)
    pair = _pair(x, literal_int32(bitwidth))
    return call(intrinsic(I.SECURE_SUM, W.function_type(pair.type, out)), pair)


def federated_aggregate(value, zero, accumulate, merge, report) -> pb.Computation:
    out = W.federated_type(report.type.function.result, W.SERVER_URI, True)
    args = struct([("", value), ("", zero), ("", accumulate), ("", merge), ("", report)])
    return call(intrinsic(I.AGGREGATE, W.function_type(args.type, out)), args)


# --- federated_aggregate helpers ---------------------------------------------------------


@dataclasses.dataclass
class _Accumulator:
    """zero/accumulate/merge/report of one reduction, as plain JAX on flat leaves."""

    state: Structure  # U
    state_leaves: list[TensorType]
    zero: Callable
    accumulate: Callable  # (*U, *T) -> U
    merge: Callable  # (*U, *U) -> U
    report: Callable  # (*U) -> R


def _leaf(i: int = 0) -> Structure:
    return Structure("leaf", leaf=i)


def _accumulator(intrinsic_uri: str, value: TensorType) -> tuple[_Accumulator, I.Lowering]:
    """The accumulator of the intrinsic's lowering (``intrinsics.INTRINSICS``) over
    ``value``, with the state and input structures the Xla helpers take."""
    low = I.INTRINSICS[intrinsic_uri].lowering(value.shape, value.np_dtype)
    return _Accumulator(
        _named(low.state, 0),
        _tensors(low.state_types),
        low.zero,
        low.accumulate,
        low.merge,
        low.report,
    ), low


def _named(names: tuple, first: int) -> Structure:
    """One leaf (``(None,)``), or a dict of leaves ``first, first + 1, ...``."""
    if names == (None,):
        return _leaf(first)
    return Structure("dict", tuple(_leaf(first + i) for i in range(len(names))), names)


def _tensors(types: list) -> list[TensorType]:
    return [TensorType(dtype_name(np.dtype(dt)), tuple(shape)) for shape, dt in types]


def _aggregate_call(uri: str, value: pb.Computation, member: TensorType) -> pb.Computation:
    """``uri`` (sum, mean or weighted mean) as federated_aggregate with Xla helpers."""
    acc, low = _accumulator(uri, member)
    n = len(acc.state_leaves)
    t_struct, t_leaves = _named(low.inputs, n), _tensors(low.input_types)
    u, u_leaves = acc.state, acc.state_leaves
    zero = call(xla_of_function(acc.zero, None, [], u, u_leaves))
    accumulate = xla_of_function(
        acc.accumulate, Structure("tuple", (u, t_struct)), u_leaves + t_leaves, u, u_leaves
    )
    merge = xla_of_function(
        acc.merge, Structure("tuple", (u, shift(u, n))), u_leaves + u_leaves, u, u_leaves
    )
    report = xla_of_function(acc.report, u, u_leaves, _leaf(), [member])
    return federated_aggregate(value, zero, accumulate, merge, report)


def _gathered_call(agg: Aggregation, value, member: TensorType, n: int) -> pb.Computation:
    """``agg``'s op at the server over every client's value: federated_aggregate whose
    accumulator is the ``n`` values in arrival order and whose report binds the op's
    own primitive (``fcir.fed``) on them. Not secure: the aggregator sees each value."""
    from jax import lax

    prim, attrs = ops()[agg.fed_op].primitive, dict(agg.attrs)
    dt = member.np_dtype
    state = Structure("dict", (_leaf(0), _leaf(1)), ("count", "values"))
    leaves = [TensorType("i32", ()), TensorType(member.dtype, (n, *member.shape))]

    def accumulate(c, buf, t):
        return (c + 1, lax.dynamic_update_index_in_dim(buf, t, c, 0))

    def merge(c1, b1, c2, b2):
        first = (jnp.arange(n) < c1).reshape((n,) + (1,) * len(member.shape))
        return (c1 + c2, jnp.where(first, b1, jnp.roll(b2, c1, axis=0)))

    def report(c, buf):
        return (prim.bind(buf, placement="clients", n=n, **attrs),)

    zero = call(
        xla_of_function(
            lambda: (jnp.zeros((), jnp.int32), jnp.zeros((n, *member.shape), dt)),
            None,
            [],
            state,
            leaves,
        )
    )
    t = _leaf(2)
    acc = xla_of_function(
        accumulate, Structure("tuple", (state, t)), [*leaves, member], state, leaves
    )
    mrg = xla_of_function(
        merge, Structure("tuple", (state, shift(state, 2))), leaves + leaves, state, leaves
    )
    # The op's own result type: a member's for the order statistics, a stack of chosen
    # members for the selections (fed.krum).
    import jax

    buf = jax.ShapeDtypeStruct((n, *member.shape), dt)
    shape = jax.eval_shape(report, jax.ShapeDtypeStruct((), jnp.int32), buf)[0].shape
    rep = xla_of_function(report, state, leaves, _leaf(), [TensorType(member.dtype, shape)])
    return federated_aggregate(value, zero, acc, mrg, rep)


# --- the round ----------------------------------------------------------------------------


class _Block:
    """The round's Computation being written: its argument and the block's locals."""

    def __init__(self, split: Split):
        main = split.round.main
        self.arg_struct = main.arg_structure or Structure(
            "tuple", tuple(_leaf(i) for i in range(len(main.body.params)))
        )
        self.arg_type = W.structure_type(
            self.arg_struct, [W.value_type(v.type) for v in main.body.params]
        )
        self.arg = reference("arg", self.arg_type)
        self.paths = leaf_paths(self.arg_struct)
        self.locals: list[tuple[str, pb.Computation]] = []

    def let(self, name: str, value: pb.Computation) -> pb.Computation:
        """``value`` as the block's next local ``name``; a reference to it."""
        self.locals.append((name, value))
        return reference(name, value.type)

    def from_arg(self, s: Structure, leaves: list[int]) -> pb.Computation:
        """The round argument's leaves ``leaves`` in the structure ``s``."""
        if s.kind == "leaf":
            c = self.arg
            for i in self.paths[leaves[s.leaf]]:
                c = selection(c, i)
            return c
        names = W.element_names(s)
        return struct(list(zip(names, (self.from_arg(c, leaves) for c in s.children))))


def _pick(source: pb.Computation, path: tuple[int, ...], name: str) -> pb.Computation:
    """The function selecting ``path`` from ``source``'s member."""
    member = source.type.federated.member
    body = reference(name, member)
    for i in path:
        body = selection(body, i)
    return lam(name, member, body)


def round_computation(
    split: Split, hlo: dict[str, bytes], aggregate_with: str = "intrinsics"
) -> pb.Computation:
    """The Computation of ``split``'s round; ``hlo`` holds the server_prepare,
    client_work (member-level) and server_result HLO module protos."""
    b = _Block(split)
    temporary, broadcast = _server_prepare(b, split, hlo)
    client_output = _client_work(b, split, hlo, broadcast)
    aggregated = _aggregations(b, split, client_output, aggregate_with)
    parts = split.parts
    result_input = b.let("result_input", federated_zip(_pair(temporary, aggregated), W.SERVER_URI))
    result = b.let(
        "result",
        federated_apply(xla_of_part(parts["server_result"], hlo["server_result"]), result_input),
    )
    out_struct = parts["server_result"].main.result_structure
    out_paths = leaf_paths(out_struct)

    def output(s: Structure) -> pb.Computation:
        if s.kind == "leaf":
            if out_struct.kind == "leaf":
                return result
            return federated_apply(_pick(result, out_paths[s.leaf], "r"), result)
        if s.kind == "none":
            return struct([])
        return struct(list(zip(W.element_names(s), (output(c) for c in s.children))))

    body = block(b.locals, output(out_struct))
    return lam("arg", b.arg_type if split.round.main.body.params else None, body)


def _server_prepare(b: _Block, split: Split, hlo) -> tuple[pb.Computation, pb.Computation]:
    """server_prepare on the server's state, and its broadcast: (the temporary the server
    keeps for server_result, the broadcast at the clients)."""
    prepare = split.parts["server_prepare"].main
    server_state = b.let(
        "server_state",
        federated_zip(b.from_arg(prepare.arg_structure, split.server_args), W.SERVER_URI),
    )
    part = xla_of_part(split.parts["server_prepare"], hlo["server_prepare"])
    prepared = b.let("prepared", federated_apply(part, server_state))
    broadcast_input = b.let(
        "broadcast_input", federated_apply(_pick(prepared, (0,), "p"), prepared)
    )
    temporary = b.let("temporary", federated_apply(_pick(prepared, (1,), "p"), prepared))
    return temporary, b.let("broadcast_output", federated_broadcast(broadcast_input))


def _client_work(b: _Block, split: Split, hlo, broadcast: pb.Computation) -> pb.Computation:
    """client_work at each client on its data and the broadcast."""
    member = split.client_member
    d_struct = member.main.arg_structure.children[0]
    client_input = b.let(
        "client_input",
        federated_zip(_pair(b.from_arg(d_struct, split.client_args), broadcast), W.CLIENTS_URI),
    )
    return b.let(
        "client_output", federated_map(xla_of_part(member, hlo["client_work"]), client_input)
    )


def _aggregations(b: _Block, split: Split, client_output, aggregate_with) -> pb.Computation:
    """Every aggregation of the clients' outputs, zipped at the server in the order
    client_to_server_aggregation gives them."""
    member = split.client_member
    a_in = member.main.result_structure
    position = {n: i for i, n in enumerate(a_in.names)}
    a_in_leaves = {
        n: tensor(member.main.body.results[c.leaf].type) for n, c in zip(a_in.names, a_in.children)
    }
    n = split.round.placements[0][1]
    aggregated = {
        agg.output: b.let(
            f"aggregate_{agg.output}",
            _aggregation(
                agg, client_output, position, a_in_leaves, aggregate_with, _pick, b.let, n
            ),
        )
        for agg in split.aggregations
    }
    a_out = split.parts["client_to_server_aggregation"].main.result_structure
    zipped = federated_zip(struct([(n, aggregated[n]) for n in a_out.names]), W.SERVER_URI)
    return b.let("aggregated", zipped)


def _aggregation(
    agg: Aggregation, client_output, position, leaves, aggregate_with, pick, let, n: int
) -> pb.Computation:
    def client_value(name: str) -> pb.Computation:
        return let(
            f"value_{name}",
            federated_map(pick(client_output, (position[name],), "a"), client_output),
        )

    uri = agg.intrinsic
    member = leaves[agg.inputs[0]]
    if aggregate_with == I.AGGREGATE and uri in AGGREGATE_LOWERED:
        names = I.INTRINSICS[uri].lowering(member.shape, member.np_dtype).inputs
        if names != (None,):
            a_type = client_output.type.federated.member
            body = struct(
                [
                    (name, selection(reference("a", a_type), position[leaf]))
                    for name, leaf in zip(names, agg.inputs)
                ]
            )
            value = let(f"value_{agg.output}", federated_map(lam("a", a_type, body), client_output))
        else:
            value = client_value(agg.inputs[0])
        return _aggregate_call(uri, value, member)
    if uri == I.AGGREGATE:  # an order statistic: every value to the server
        return _gathered_call(agg, client_value(agg.inputs[0]), member, n)
    values = [client_value(name) for name in agg.inputs]
    if uri == I.WEIGHTED_MEAN:
        return federated_weighted_mean(values[0], values[1])
    if uri == I.SECURE_SUM:
        return federated_secure_sum_bitwidth(values[0], agg.bitwidth)
    return federated_reduce(uri, values[0])


# --- reading ------------------------------------------------------------------------------


def parse(data: bytes) -> pb.Computation:
    """Computation bytes -> message (ParseError on bad bytes)."""
    from google.protobuf.message import DecodeError

    c = pb.Computation()
    try:
        c.ParseFromString(data)
    except DecodeError as e:
        raise ParseError(f"not a federated_language Computation: {e}") from None
    return c


def walk(c: pb.Computation):
    """Every Computation node under ``c`` (itself included), in reading order."""
    yield c
    kind = c.WhichOneof("computation")
    if kind == "lambda":
        yield from walk(getattr(c, "lambda").result)
    elif kind == "block":
        for local in c.block.local:
            yield from walk(local.value)
        yield from walk(c.block.result)
    elif kind == "call":
        yield from walk(c.call.function)
        if c.call.HasField("argument"):
            yield from walk(c.call.argument)
    elif kind == "struct":
        for e in c.struct.element:
            yield from walk(e.value)
    elif kind == "selection":
        yield from walk(c.selection.source)


def intrinsic_uses(c: pb.Computation) -> list[tuple[str, str]]:
    """Every intrinsic in ``c`` with its concrete type, in reading order."""
    return [
        (n.intrinsic.uri, W.format_type(n.type))
        for n in walk(c)
        if n.WhichOneof("computation") == "intrinsic"
    ]
