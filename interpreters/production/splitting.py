"""The split pass: one round -> the five DistributeAggregateForm parts.

Every op of the round's ``main`` is classified by where its value lives and what it
depends on (a straight dataflow pass; the program order is a topological order):

* ``S``: server values that depend on no aggregate (the server arguments, and server
  ops over them);
* ``K``: constants (ops whose operands are all constants), copied wherever needed;
* ``C``: client values (client arguments, broadcasts, fed.map results, per-member
  elementwise ops);
* ``P``: server values that depend on an aggregate.

A broadcast of a ``P`` value would need a second exchange, and is rejected. Ops then go
to parts by what needs them: **server_prepare** holds the ``S`` ops the broadcasts need
(everything else waits for server_result, which gets the server values it needs through
the temporary state ``T``); **client_work** fuses every fed.map region and per-member op
into one region that one client runs; **client_to_server_aggregation** holds only the
reductions; **server_result** holds the rest.

Reductions become the intrinsics production runtimes implement, with the conversions
they need at the clients (before) and at the server (after):

==========================  ======================  ===================================
fcir                        intrinsic               around it
==========================  ======================  ===================================
fed.sum                     federated_sum
fed.mean (floats)           federated_mean
fed.mean (ints, bools)      federated_mean          clients cast to f32
fed.weighted_mean (w: [])   federated_weighted_mean clients cast values and weight
fed.weighted_mean (w: [k])  federated_sum x2        clients send w*x and w; server divides
fed.min / fed.max           federated_min / _max    bools travel as int32
fed.secure_sum              federated_secure_sum_   clients and server reduce mod
                            bitwidth                2**bitwidth (full-width signed
                                                    values travel as unsigned bits)
==========================  ======================  ===================================

Interfaces between parts are dict structures whose keys name the round's values:
``v12`` carries ``%12`` of the round's text (``v12_weight``: the weight of the weighted
mean defining ``%12``). The server arguments (``S``) and the client data (``D``) keep
the round's pytree structure, names included.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from fcir import fed as F
from fcir.ir import Func, Module, Op, Region, Value, value_numbering
from fcir.ir.elementwise import LAYOUT
from fcir.ir.types import SERVER, PlacedType, Structure, TensorType, dtype_bits, dtype_name
from fcir.opkit.primitives import mean_result_dtype

from . import checks, ddp, dp
from . import intrinsics as I
from .rewrite import clone_op, clone_region, member_type, named, prune, shift, splice, tensor
from .wire_types import unsupported_dtype

PARTS = (
    "server_prepare",
    "server_to_client_broadcast",
    "client_work",
    "client_to_server_aggregation",
    "server_result",
)

# Where each part runs (for the manifest and the docs).
RUNS_ON = {
    "server_prepare": "server",
    "server_to_client_broadcast": "transport (server to every client)",
    "client_work": "each client",
    "client_to_server_aggregation": "aggregation service",
    "server_result": "server",
}


@dataclasses.dataclass(frozen=True)
class Aggregation:
    """One intrinsic use of client_to_server_aggregation."""

    fed_op: str  # the op in the aggregation part
    intrinsic: str  # the federated_language intrinsic URI
    inputs: tuple[str, ...]  # client_work outputs it reads (values; then weights)
    output: str  # the aggregated entry it writes
    bitwidth: int | None  # for federated_secure_sum_bitwidth
    source: str  # text location of the round's op
    attrs: tuple = ()  # the op's other attributes, (name, value) pairs (trim=...)


@dataclasses.dataclass
class _Lowered:
    """How one fed reduction of the round travels: client outputs, intrinsic uses, and the
    server's finishing step (``post`` maps the aggregated values to the op's result)."""

    result: Value
    aggregations: list[Aggregation]
    outputs: list[str]  # aggregated entries, in the order ``post`` takes them
    post: object = None  # fn(*aggregated) -> result, or None for the identity

    def finish(self, region: Region, values: list[Value]) -> Value:
        if self.post is None:
            return values[0]
        return splice(region, self.post, values, member=False)[0]


# --- what the split does with each fed op ---------------------------------------------------


class Rule:
    """An entry of :data:`OP_RULES`: the part an op runs in and the intrinsic it becomes
    (``str()`` says it in words)."""

    part = ""
    intrinsic = ""

    def __str__(self) -> str:
        return f"{self.part}: {self.intrinsic}"


class Broadcasting(Rule):
    """``fed.broadcast``: the transport from the server to every client."""

    part = "server_to_client_broadcast"
    intrinsic = I.BROADCAST

    def __call__(self, value: Value, result_type, clients: str) -> Op:
        """The broadcast part's op sending ``value`` to ``clients``."""
        return Op(F.Broadcast.name, [value], [Value(result_type)], {"to": clients})


class ClientWork(Rule):
    """``fed.map``: its region is fused into the one region each client runs."""

    part = "client_work"
    intrinsic = I.MAP

    def __call__(self, op: Op, env: dict, fused: Region) -> None:
        """Appends ``op``'s region to ``fused``, reading its operands through ``env``
        (which then holds its results)."""
        body = op.regions[0]
        inner = {p: env[v] for p, v in zip(body.params, op.operands)}
        for sub in body.ops:
            fused.ops.append(clone_op(sub, inner))
        env.update(zip(op.results, (inner[y] for y in body.results)))

    def wrap(self, params: list[Value], body: Region, clients: str) -> Op:
        """The client_work part's op running ``body`` at every client."""
        results = [Value(PlacedType(y.type, clients)) for y in body.results]
        return Op(F.Map.name, list(params), results, {}, [body])


class _Site:
    """One reduction of the round being lowered: its op, the name of its result and
    the client region its clients' outputs are spliced into."""

    def __init__(self, sp: _Splitter, i: int, fused: Region, env: dict, outputs: dict):
        self.sp, self.op = sp, sp.ops[i]
        self.result = self.op.results[0]
        self.name = sp.name(self.result)
        self.where = sp.op_where(i)
        self.x = env[self.op.operands[0]]
        self.xt = tensor(self.x.type)
        self.env, self.fused, self.outputs = env, fused, outputs

    def send(self, key: str, fn=None, *inputs) -> str:
        """Client output ``key``: ``fn`` (traced JAX) of ``inputs`` (the op's operand by
        default) at each client."""
        vals = [self.x, *inputs] if not inputs else list(inputs)
        out = splice(self.fused, fn, vals, member=True)[0] if fn is not None else vals[0]
        self.outputs[key] = out
        return key

    def one(self, intrinsic: str, key: str, bitwidth=None, post=None) -> _Lowered:
        """The op as one use of ``intrinsic`` over client output ``key``."""
        attrs = tuple(sorted((k, v) for k, v in self.op.attrs.items() if k != "bitwidth"))
        agg = Aggregation(self.op.name, intrinsic, (key,), self.name, bitwidth, self.where, attrs)
        return _Lowered(self.result, [agg], [self.name], post)


class Aggregate(Rule):
    """A reduction in client_to_server_aggregation: what each client sends, the
    intrinsic over it, and what the server does with the aggregate. This base sends
    the value as it is and keeps the intrinsic's result."""

    part = "client_to_server_aggregation"

    def __init__(self, intrinsic: str):
        self.intrinsic = intrinsic

    def result_dtype(self, t: TensorType) -> str:
        """The dtype of the aggregation part's op over client outputs of type ``t``."""
        return t.dtype

    def result_shape(self, agg: Aggregation, t: TensorType, n: int) -> tuple:
        """The shape of the aggregation part's op over ``n`` client outputs of type ``t``."""
        return t.shape

    def lower(self, at: _Site) -> _Lowered:
        return at.one(self.intrinsic, at.send(at.name))

    def __call__(self, sp: _Splitter, i: int, fused: Region, env: dict, outputs: dict):
        """Op ``i`` of the round lowered: its clients' outputs spliced into ``fused``
        (recorded in ``outputs`` by name), its intrinsic uses, the server's step."""
        return self.lower(_Site(sp, i, fused, env, outputs))


class Summing(Aggregate):
    """``fed.sum``: ``federated_sum``, which has no bool counterpart."""

    def lower(self, at):
        if at.xt.dtype == "bool":
            raise at.sp.fail(
                at.where,
                checks.UNSUPPORTED_DTYPE,
                f"{at.op.name} of bool values has no {self.intrinsic} counterpart: sum them "
                "as int32 (x.astype(jnp.int32)) before reducing",
            )
        return super().lower(at)


class Averaging(Aggregate):
    """``fed.mean``: ``federated_mean``; ints and bools are cast to f32 at the clients
    (the op's result dtype)."""

    def result_dtype(self, t):
        return dtype_name(mean_result_dtype(t.np_dtype))

    def lower(self, at):
        if at.xt.np_dtype != mean_result_dtype(at.xt.np_dtype):
            return at.one(self.intrinsic, at.send(at.name, lambda a: a.astype(jnp.float32)))
        return super().lower(at)


class WeightedAveraging(Averaging):
    """``fed.weighted_mean``: ``federated_weighted_mean`` for a scalar weight; for
    per-element weights (which it does not take) the weighted values and the weights
    are summed with ``elementwise``'s intrinsic and divided at the server."""

    def __init__(self, intrinsic: str, elementwise: Aggregate):
        super().__init__(intrinsic)
        self.elementwise = elementwise

    def lower(self, at):
        name, xt = at.name, at.xt
        w = at.env[at.op.operands[1]]
        wt = tensor(w.type)
        dt = mean_result_dtype(xt.np_dtype)
        extra = (1,) * (len(xt.shape) - len(wt.shape))
        if wt.shape == ():
            vkey = at.send(name, lambda a: a.astype(dt))
            wkey = at.send(f"{name}_weight", lambda b: b.astype(dt), w)
            agg = Aggregation(at.op.name, self.intrinsic, (vkey, wkey), name, None, at.where)
            return _Lowered(at.result, [agg], [name])
        at.send(name, lambda a, b: a.astype(dt) * b.astype(dt).reshape(b.shape + extra), at.x, w)
        at.send(f"{name}_weight", lambda b: b.astype(dt), w)
        op, uri = F.Sum.name, self.elementwise.intrinsic
        aggs = [
            Aggregation(op, uri, (name,), name, None, at.where),
            Aggregation(op, uri, (f"{name}_weight",), f"{name}_weight", None, at.where),
        ]
        return _Lowered(
            at.result,
            aggs,
            [name, f"{name}_weight"],
            lambda num, den: num / den.reshape(den.shape + extra),
        )


class Extremum(Aggregate):
    """``fed.min`` / ``fed.max``: bools travel as int32 and are read back as bools."""

    def lower(self, at):
        if at.xt.dtype == "bool":
            return at.one(
                self.intrinsic,
                at.send(at.name, lambda a: a.astype(jnp.int32)),
                post=lambda a: a.astype(jnp.bool_),
            )
        return super().lower(at)


class SecureSumming(Aggregate):
    """``fed.secure_sum``: ``federated_secure_sum_bitwidth`` wants each client's value
    in ``[0, 2**bitwidth)`` and returns the plain sum, so clients and server reduce
    modulo ``2**bitwidth`` to keep fcir's modular result; full-width signed values
    travel as their unsigned bits."""

    def lower(self, at):
        name, xt = at.name, at.xt
        bits, bw = dtype_bits(xt.dtype), at.op.attrs["bitwidth"]
        if bw >= bits and xt.dtype[0] == "u":
            return at.one(self.intrinsic, at.send(name), bw)
        if bw >= bits:
            # A full-width signed value is in [0, 2**bitwidth) only read unsigned: send its
            # bits as the unsigned type, and read the sum's bits back as signed.
            unsigned, signed = jnp.dtype(f"uint{bits}"), xt.np_dtype
            return at.one(
                self.intrinsic,
                at.send(name, lambda a: lax.bitcast_convert_type(a, unsigned)),
                bw,
                lambda a: lax.bitcast_convert_type(a, signed),
            )
        mask = (1 << bw) - 1

        def reduce(a):
            return jnp.bitwise_and(a, jnp.asarray(mask, a.dtype))

        return at.one(self.intrinsic, at.send(name, reduce), bw, reduce)


class Gathering(Aggregate):
    """A reduction with no intrinsic (the order statistics): ``federated_aggregate``
    gathers every client's value into one array at the server, whose report binds the
    op's primitive. Not secure: the aggregator sees every client's value
    (docs/production.md)."""

    def __init__(self):
        super().__init__(I.AGGREGATE)

    def result_shape(self, agg, t, n):
        """The op's primitive's abstract evaluation over the stacked values: the member's
        shape for the order statistics, a stack of chosen members for the selections
        (fed.krum)."""
        prim = F.ops()[agg.fed_op].primitive
        arg = jax.ShapeDtypeStruct((n, *t.shape), t.np_dtype)
        attrs = dict(agg.attrs)
        out = jax.eval_shape(lambda a: prim.bind(a, placement="clients", n=n, **attrs), arg)
        return tuple(out.shape)

    def __str__(self):
        return f"{self.part}: {self.intrinsic} of every client's value"


_SUM = Summing(I.SUM)

# What the split does with each fed op, keyed by op class: the entry is the op's
# decomposition (what the clients compute, the intrinsic, what the server does after).
# tests/fed/test_op_coverage.py fails when a fed op has no entry here.
_OWN_RULES: dict[type[F.FedOp] | str, object] = {
    F.Broadcast: Broadcasting(),
    F.Map: ClientWork(),
    F.Sum: _SUM,
    F.Mean: Averaging(I.MEAN),
    F.WeightedMean: WeightedAveraging(I.WEIGHTED_MEAN, _SUM),
    F.Min: Extremum(I.MIN),
    F.Max: Extremum(I.MAX),
    F.SecureSum: SecureSumming(I.SECURE_SUM),
    # Rewritten into plain fed ops before the split (interpreters/production/dp.py):
    # clipped in client_work, federated_sum, Gaussian noise in server_result.
    F.DpSum: dp.Decomposition(dp.gaussian_program, mean=False),
    F.DpMean: dp.Decomposition(dp.gaussian_program, mean=True),
    # Distributed DP (interpreters/production/ddp.py): clipped, rotated, quantized and
    # noised in client_work, federated_secure_sum_bitwidth, decoded in server_result.
    F.DdpSum: dp.Decomposition(ddp.decomposed_program, mean=False),
    F.DdpMean: dp.Decomposition(ddp.decomposed_program, mean=True),
    "reduction": Gathering(),
    # A derivative's way to tell members apart (the order statistics'); a client does
    # not know its position among the replies, and a derivative program is not one
    # round (it has a second exchange).
    F.MemberIndex: F.Unsupported(
        "a client does not know its position among the clients that reply: "
        "fed.member_index belongs to derivative programs, which run on the reference "
        "and XLA backends"
    ),
}
OP_RULES = F.resolve(_OWN_RULES)
# fed op name -> intrinsic URI, for every reduction the split lowers.
INTRINSICS = {cls.name: r.intrinsic for cls, r in OP_RULES.items() if isinstance(r, Aggregate)}


def rule_of(op: Op):
    """``op``'s entry in :data:`OP_RULES` (None for an op that is no fed op)."""
    return OP_RULES.get(F.ops().get(op.name))


@dataclasses.dataclass
class Split:
    """A round and its five parts (each a self-contained, checked fcir Module)."""

    round: Module
    parts: dict[str, Module]
    client_member: Module  # client_work's region as a module: what one client runs
    server_args: list[int]  # round argument leaves that form S, in S's order
    client_args: list[int]  # round argument leaves that form D, in D's order
    aggregations: list[Aggregation]
    privacy: dict | None = None  # the DP parameters (fcir.privacy.round_cost), if any


def split(module: Module) -> Split:
    """Splits ``module`` (one round) into its five parts; ExportError if it cannot.
    DP aggregates are decomposed first (``dp.decompose``)."""
    privacy = dp.manifest_entry(module)
    checks.check_structure(module)  # on the user's ops, so errors name them
    module = dp.decompose(module, OP_RULES)
    out = _Splitter(module).run()
    out.privacy = privacy
    return out


def _is_client(t) -> bool:
    return isinstance(t, PlacedType) and t.placement != SERVER


class _Splitter:
    def __init__(self, module: Module):
        self.m = module
        self.main = module.main
        self.ops = self.main.body.ops
        self.params = self.main.body.params
        self.names = value_numbering(self.main)
        self.index: dict[Value, int] = {}
        for i, op in enumerate(self.ops):
            for v in op.results:
                self.index[v] = i
        self.rules = [rule_of(op) for op in self.ops]
        self.kind: dict[Value, str] = {}
        self.origin: dict[Value, int] = {}  # a P value -> index of a reduction it depends on
        self.clients = module.placements[0][0] if module.placements else "clients"

    # -- diagnostics ----------------------------------------------------------------------

    def where(self, v: Value) -> str:
        if v in self.index:
            return self.op_where(self.index[v])
        return f"argument %{self.names[v]}"

    def op_where(self, i: int) -> str:
        """Op ``i``, named as the user wrote it: an op of the DP decomposition is named
        by the user's DP op it came from (``dp.user_op``)."""
        user = dp.user_op(self.m, i)
        if user is None:
            return checks.op_where(self.m, (i,), self.ops[i], self.names)
        module, j = user
        op = module.main.body.ops[j]
        where = checks.op_where(module, (j,), op, value_numbering(module.main))
        if op.name != self.ops[i].name:
            where += f", at its {self.ops[i].name} in production"
        return where

    def fail(self, where: str, reason: str, detail: str):
        return checks.fail(self.m, where, reason, detail)

    def check_dtype(self, v: Value, role: str) -> None:
        why = unsupported_dtype(tensor(v.type).dtype)
        if why is not None:
            raise self.fail(
                self.where(v),
                checks.UNSUPPORTED_DTYPE,
                f"{v.type} crosses a part boundary ({role}); {why}",
            )

    def name(self, v: Value) -> str:
        return f"v{self.names[v]}"

    # -- classification -------------------------------------------------------------------

    def classify(self) -> None:
        for v in self.params:
            self.kind[v] = "C" if _is_client(v.type) else "S"
        for i, op in enumerate(self.ops):
            kinds = [self.kind[v] for v in op.operands]
            rule = self.rules[i]
            if isinstance(rule, F.Unsupported):
                raise self.fail(self.op_where(i), "no production lowering", rule.reason)
            if isinstance(rule, Broadcasting):
                if kinds[0] == "P":
                    src = self.origin[op.operands[0]]
                    raise self.fail(
                        self.op_where(i),
                        checks.SECOND_EXCHANGE,
                        f"it broadcasts a value computed from the aggregate "
                        f"{self.op_where(src)}, which needs a second broadcast/aggregate "
                        "exchange (as reverse-mode AD through a round does); a "
                        "DistributeAggregateForm round has one: split the program into "
                        "several rounds",
                    )
                out = "C"
            elif isinstance(rule, ClientWork):
                out = "C"
            elif isinstance(rule, Aggregate):
                out = "P"
                for v in op.results:
                    self.origin[v] = i
            elif any(_is_client(v.type) for v in op.results):
                for v, k in zip(op.operands, kinds):
                    if k not in ("C", "K"):
                        raise self.fail(
                            self.op_where(i),
                            checks.UNBROADCAST_FLOW,
                            f"operand %{self.names[v]} ({v.type}) reaches per-client code "
                            f"without {F.Broadcast.name}",
                        )
                out = "C"
            elif "C" in kinds:
                v = op.operands[kinds.index("C")]
                raise self.fail(
                    self.op_where(i),
                    checks.PER_MEMBER_READ,
                    f"it reads the client value %{self.names[v]} ({v.type}) at the server",
                )
            elif all(k == "K" for k in kinds):
                out = "K"
            elif "P" in kinds:
                out = "P"
                src = next(v for v, k in zip(op.operands, kinds) if k == "P")
                for v in op.results:
                    self.origin[v] = self.origin[src]
            else:
                out = "S"
            for v in op.results:
                self.kind[v] = out
        for v in self.main.body.results:
            if self.kind[v] == "C":
                raise self.fail(
                    self.where(v),
                    checks.CLIENT_RESULT,
                    f"%{self.names[v]} has type {v.type}; a round returns server "
                    "values only: aggregate it first",
                )

    def needed(self, roots, stop) -> tuple[set[int], list[Value]]:
        """Ops needed for ``roots`` (indices) and the boundary values reached (arguments
        and values where ``stop`` holds), in first-reached order."""
        ops: set[int] = set()
        boundary: list[Value] = []
        seen: set[Value] = set()
        stack = list(reversed(roots))
        while stack:
            v = stack.pop()
            if v in seen:
                continue
            seen.add(v)
            if v not in self.index or stop(v):
                boundary.append(v)
                continue
            i = self.index[v]
            if i not in ops:
                ops.add(i)
                stack.extend(reversed(self.ops[i].operands))
        return ops, boundary

    # -- the split ------------------------------------------------------------------------

    def run(self) -> Split:
        self.classify()
        broadcasts = [i for i, r in enumerate(self.rules) if isinstance(r, Broadcasting)]
        reductions = [i for i, r in enumerate(self.rules) if isinstance(r, Aggregate)]
        for v in self.params:
            self.check_dtype(v, "round argument")
        for v in self.main.body.results:
            self.check_dtype(v, "round result")
        for i in broadcasts:
            self.check_dtype(self.ops[i].operands[0], "broadcast")
        for i in reductions:
            for v in (*self.ops[i].operands, *self.ops[i].results):
                self.check_dtype(v, "aggregation")

        prepare_ops, _ = self.needed([self.ops[i].operands[0] for i in broadcasts], lambda v: False)
        client_roots = [v for i in reductions for v in self.ops[i].operands]
        client_ops, _ = self.needed(
            client_roots, lambda v: isinstance(self.rules[self.index[v]], Broadcasting)
        )

        def result_stop(v):
            i = self.index[v]
            return (i in prepare_ops and self.kind[v] != "K") or isinstance(
                self.rules[i], Aggregate
            )

        result_ops, result_inputs = self.needed(self.main.body.results, result_stop)
        temporary = sorted({self.name(v): v for v in result_inputs if self.kind[v] == "S"}.items())
        for _, v in temporary:
            self.check_dtype(v, "temporary state")
        aggregated_needed = {v for v in result_inputs if self.kind[v] == "P"}

        structure = self.main.arg_structure or Structure(
            "tuple", tuple(Structure("leaf", leaf=i) for i in range(len(self.params)))
        )
        s_struct, s_leaves = prune(
            structure, {i for i, v in enumerate(self.params) if not _is_client(v.type)}
        )
        d_struct, d_leaves = prune(
            structure, {i for i, v in enumerate(self.params) if _is_client(v.type)}
        )
        bnames = [self.name(self.ops[i].results[0]) for i in broadcasts]
        order = sorted(range(len(bnames)), key=lambda k: bnames[k])
        broadcasts = [broadcasts[k] for k in order]
        bnames = [bnames[k] for k in order]

        parts: dict[str, Module] = {}
        parts["server_prepare"] = self.prepare(
            prepare_ops, s_struct, s_leaves, broadcasts, bnames, temporary
        )
        parts["server_to_client_broadcast"] = self.broadcast(broadcasts, bnames)
        member, work, lowered = self.client_work(
            client_ops, d_struct, d_leaves, broadcasts, bnames, reductions
        )
        parts["client_work"] = work
        parts["client_to_server_aggregation"], aggregations = self.aggregation(
            temporary, member, lowered
        )
        parts["server_result"] = self.result(
            result_ops, temporary, parts, lowered, aggregated_needed
        )
        return Split(self.m, parts, member, s_leaves, d_leaves, aggregations)

    def module(self, part: str, region: Region, args: Structure, results: Structure) -> Module:
        return Module(
            f"{self.m.name}_{part}", list(self.m.placements), [Func("main", region, args, results)]
        )

    def prepare(self, op_ids, s_struct, s_leaves, broadcasts, bnames, temporary) -> Module:
        params = [Value(self.params[i].type) for i in s_leaves]
        env = dict(zip((self.params[i] for i in s_leaves), params))
        region = Region(params, [], [], "main")
        for i in sorted(op_ids):
            region.ops.append(clone_op(self.ops[i], env))
        region.results = [env[self.ops[i].operands[0]] for i in broadcasts]
        region.results += [env[v] for _, v in temporary]
        results = Structure("tuple", (named(bnames), named([n for n, _ in temporary], len(bnames))))
        return self.module("server_prepare", region, s_struct, results)

    def broadcast(self, broadcasts, bnames) -> Module:
        params = [Value(self.ops[i].operands[0].type) for i in broadcasts]
        region = Region(params, [], [], "main")
        for i, p in zip(broadcasts, params):
            op = self.rules[i](p, self.ops[i].results[0].type, self.clients)
            region.ops.append(op)
            region.results.append(op.results[0])
        return self.module(
            "server_to_client_broadcast",
            region,
            Structure("tuple", (named(bnames),)),
            named(bnames),
        )

    def client_work(self, op_ids, d_struct, d_leaves, broadcasts, bnames, reductions):
        d_round = [self.params[i] for i in d_leaves]
        b_round = [self.ops[i].results[0] for i in broadcasts]
        fused = Region([Value(member_type(v.type)) for v in d_round + b_round], [], [], "member")
        env = dict(zip(d_round + b_round, fused.params))
        for i in sorted(op_ids):
            op = self.ops[i]
            if isinstance(self.rules[i], ClientWork):
                self.rules[i](op, env, fused)
            elif op.name.removeprefix("jax.") in LAYOUT:
                # A layout op over the member axis (capture under jax.set_mesh): one
                # client's value has no member axis to lay out, so it passes through.
                env.update(zip(op.results, (env[v] for v in op.operands)))
            else:  # per-member elementwise op, or a constant it uses
                fused.ops.append(clone_op(op, env, member_type))
        outputs: dict[str, Value] = {}
        lowered = []
        for i in reductions:
            lowered.append(self.rules[i](self, i, fused, env, outputs))
        anames = sorted(outputs)
        fused.results = [outputs[n] for n in anames]
        args = Structure("tuple", (d_struct, shift(named(bnames), len(d_leaves))))
        member = self.module("client_work_member", fused, args, named(anames))

        params = [Value(v.type) for v in d_round]
        params += [Value(PlacedType(member_type(v.type), self.clients, True)) for v in b_round]
        region = Region(params, [], [], "main")
        if anames:
            wrap = OP_RULES[F.Map].wrap(params, clone_region(fused), self.clients)
            region.ops.append(wrap)
            region.results = list(wrap.results)
        work = self.module("client_work", region, args, named(anames))
        return member, work, lowered

    def aggregation(self, temporary, member: Module, lowered):
        tparams = [Value(v.type) for _, v in temporary]
        anames = [n for n, _ in _names_of(member.main.result_structure)]
        aparams = [Value(PlacedType(y.type, self.clients)) for y in member.main.body.results]
        by_name = dict(zip(anames, aparams))
        region = Region(tparams + aparams, [], [], "main")
        aggregations, outputs = [], {}
        for plan in lowered:
            for agg in plan.aggregations:
                operands = [by_name[n] for n in agg.inputs]
                first = tensor(operands[0].type)
                rule = OP_RULES[F.ops()[agg.fed_op]]
                dtype = rule.result_dtype(first)
                shape = rule.result_shape(agg, first, self.m.cardinality(self.clients))
                out = Value(PlacedType(TensorType(dtype, shape), SERVER, True))
                attrs = {"bitwidth": agg.bitwidth} if agg.bitwidth is not None else {}
                attrs.update(agg.attrs)
                region.ops.append(Op(agg.fed_op, operands, [out], attrs))
                outputs[agg.output] = out
                aggregations.append(agg)
        onames = sorted(outputs)
        region.results = [outputs[n] for n in onames]
        args = Structure("tuple", (named([n for n, _ in temporary]), named(anames, len(temporary))))
        return self.module(
            "client_to_server_aggregation", region, args, named(onames)
        ), aggregations

    def result(self, op_ids, temporary, parts, lowered, needed) -> Module:
        agg = parts["client_to_server_aggregation"].main
        tparams = [Value(v.type) for _, v in temporary]
        onames = [n for n, _ in _names_of(agg.result_structure)]
        oparams = [Value(v.type) for v in agg.body.results]
        region = Region(tparams + oparams, [], [], "main")
        env = dict(zip((v for _, v in temporary), tparams))
        by_name = dict(zip(onames, oparams))
        for plan in lowered:
            if plan.result in needed:
                env[plan.result] = plan.finish(region, [by_name[n] for n in plan.outputs])
        for i in sorted(op_ids):
            region.ops.append(clone_op(self.ops[i], env))
        region.results = [env[v] for v in self.main.body.results]
        args = Structure("tuple", (named([n for n, _ in temporary]), named(onames, len(temporary))))
        results = self.main.result_structure or Structure(
            "tuple", tuple(Structure("leaf", leaf=i) for i in range(len(region.results)))
        )
        return self.module("server_result", region, args, results)


def _names_of(s: Structure) -> list[tuple[str, int]]:
    return [(n, c.leaf) for n, c in zip(s.names, s.children)]


def part_interface(plan) -> dict[str, tuple[list, list]]:
    """Each part's (params, results) in a bundle as (group, name) pairs, in leaf order."""
    sp = plan.split

    def names(structure) -> list[str]:
        return list(structure.names)

    prepare = sp.parts["server_prepare"].main
    b, t = (names(c) for c in prepare.result_structure.children)
    a_in = names(sp.client_member.main.result_structure)
    a_out = names(sp.parts["client_to_server_aggregation"].main.result_structure)
    n_out = len(sp.parts["server_result"].main.body.results)

    def group(g, items):
        return [(g, str(x)) for x in items]

    return {
        "server_prepare": (
            group("arg", sp.server_args),
            group("broadcast_input", b) + group("temporary", t),
        ),
        "server_to_client_broadcast": (group("broadcast_input", b), group("broadcast_output", b)),
        "client_work": (
            group("arg", sp.client_args) + group("broadcast_output", b),
            group("client_output", a_in),
        ),
        "client_to_server_aggregation": (
            group("temporary", t) + group("client_output", a_in),
            group("aggregated", a_out),
        ),
        "server_result": (
            group("temporary", t) + group("aggregated", a_out),
            group("output", range(n_out)),
        ),
    }
