"""A round with several broadcast/aggregate exchanges -> one single-exchange round per
exchange (a phase), each split by the production export.

An aggregate that is broadcast again (a mean, then a variance around the broadcast
mean) makes a second exchange, which no DistributeAggregateForm holds. Every value gets
a *level*: how many exchanges it waits for (a reduction's result is one more than its
operands; any other op takes the highest of its operands). A DP aggregate
(``fed.dp_sum`` / ``fed.dp_mean``) is a reduction too: it stays whole in its phase,
whose production split decomposes it (clip at the clients, sum, noise at the server). Phase k computes the
reductions of level k; it takes the round's arguments plus the results of the
reductions of lower levels (*carried* from earlier phases, as server arguments) and
returns its own reductions' results, the last phase the round's results.

Client values a later phase needs are recomputed there from the node's data and the
broadcasts, which the server sends again: a phase's client work is self-contained,
so a ClientApp (a fresh process per message) needs no state from an earlier message.
"""

from __future__ import annotations

import dataclasses

from fcir import fed as F
from fcir.errors import ExportError
from fcir.ir import Func, Module, Region, Value
from fcir.ir.types import Structure

from ..production import splitting
from ..production.rewrite import clone_op, named
from .app import runtime


class AppAggregate:
    """A reduction the ServerApp computes over the replies with the server's function of
    the intrinsic the production split lowered it to (``app/runtime.py`` ``AGGREGATES``:
    production's table of intrinsics, which the app carries)."""

    def __call__(self, agg: splitting.Aggregation) -> dict:
        """The server's side of ``agg`` in the app's plan.json."""
        if agg.intrinsic not in runtime.AGGREGATES:
            raise ExportError(
                f"export --target flower: {agg.fed_op} lowers to {agg.intrinsic}, which the "
                f"ServerApp does not compute (app/runtime.py AGGREGATES: "
                f"{', '.join(sorted(runtime.AGGREGATES))})"
            )
        return {"aggregate": agg.intrinsic}


class SecAggPlus(AppAggregate):
    """``fed.secure_sum``: summed over 16-bit chunks by SecAgg+ (``app/secagg.py``) when
    the run config turns it on, else like any other intrinsic."""


class GatheredAggregate:
    """A reduction with no intrinsic (``federated_aggregate``: the order statistics)
    travels with the source of its op's ``server_aggregate``, which the ServerApp runs
    over every reply: the app needs no entry per op. Not secure: the server sees every
    node's value (docs/flower.md)."""

    def __call__(self, agg: splitting.Aggregation) -> dict:
        source = F.ops()[agg.fed_op].server_aggregate_source()
        if source is None:
            raise ExportError(
                f"export --target flower: {agg.fed_op} has no server_aggregate: the "
                "ServerApp cannot compute it over the replies (docs/adding_an_op.md)"
            )
        return {"server_aggregate": source}


# What the Flower runtime does with each fed op, keyed by op class (tests/
# test_op_coverage.py reads this table). A phase is split by the production export, so
# the ops that shape the exchange, and the DP aggregates it decomposes into plain ops
# (clip / encode at the nodes, a sum or a secure sum, noise or decoding in the phase's
# server_result), are production's rules; the ServerApp's aggregate of each reduction
# that reaches it is this table's.
_OWN_RULES: dict[type[F.FedOp] | str, object] = {
    F.Broadcast: splitting.OP_RULES[F.Broadcast],  # sent with the phase's message
    F.Map: splitting.OP_RULES[F.Map],  # client_work, run by each ClientApp
    # Every op production lowers to an intrinsic a server can compute over the replies.
    **{
        c: AppAggregate()
        for c, rule in splitting.OP_RULES.items()
        if isinstance(rule, splitting.Aggregate) and rule.intrinsic in runtime.AGGREGATES
    },
    F.SecureSum: SecAggPlus(),
    **{c: splitting.OP_RULES[c] for c in (F.DpSum, F.DpMean, F.DdpSum, F.DdpMean)},
    "reduction": GatheredAggregate(),
    F.MemberIndex: splitting.OP_RULES[F.MemberIndex],  # production's refusal
}
RULES = F.resolve(_OWN_RULES)


def server_aggregate(agg: splitting.Aggregation) -> dict:
    """What plan.json says the ServerApp computes for ``agg`` (an aggregation of a
    phase's production split), from the entry of its op in :data:`RULES`."""
    return RULES[F.ops()[agg.fed_op]](agg)


# The ops that end an exchange: the reductions and the DP aggregates.
REDUCTIONS = F.of_kind("reduction", "dp", "ddp")


@dataclasses.dataclass
class Phase:
    module: Module
    carried_in: list[str]  # names of the carried values this phase takes (after the args)
    carried_out: list[str]  # names of the values it returns (empty for the last phase)


def levels(module: Module) -> dict[Value, int]:
    main = module.main
    level = {v: 0 for v in main.body.params}
    for op in main.body.ops:
        lv = max((level[v] for v in op.operands), default=0)
        if op.name in REDUCTIONS:
            lv += 1
        for r in op.results:
            level[r] = lv
    return level


def split_phases(module: Module) -> list[Phase]:
    """The phases of ``module``; one phase (the module itself) for a single exchange."""
    main = module.main
    ops = main.body.ops
    level = levels(module)
    reductions = [op for op in ops if op.name in REDUCTIONS]
    last = max((level[op.results[0]] for op in reductions), default=0)
    if last <= 1:
        return [Phase(module, [], [])]
    index = {v: i for i, op in enumerate(ops) for v in op.results}
    names: dict[Value, str] = {}
    for op in reductions:
        for v in op.results:
            names[v] = f"c{len(names):04d}"
    phases = []
    for k in range(1, last + 1):
        carried = [v for v in names if level[v] < k]
        outputs = [v for v in names if level[v] == k] if k < last else list(main.body.results)
        stop = set(carried) | set(main.body.params)
        needed: set[int] = set()
        stack = list(outputs)
        while stack:
            v = stack.pop()
            if v in stop or v not in index or index[v] in needed:
                continue
            needed.add(index[v])
            stack.extend(ops[index[v]].operands)
        params = [Value(v.type) for v in main.body.params]
        cparams = [Value(v.type) for v in carried]
        env = dict(zip(main.body.params, params)) | dict(zip(carried, cparams))
        region = Region(params + cparams, [], [], "main")
        for i in sorted(needed):
            region.ops.append(clone_op(ops[i], env))
        region.results = [env[v] for v in outputs]
        n = len(params)
        args = main.arg_structure or Structure(
            "tuple", tuple(Structure("leaf", leaf=i) for i in range(n))
        )
        if carried:
            args = Structure("tuple", (args, named([names[v] for v in carried], n)))
        if k < last:
            results = named([names[v] for v in outputs])
        else:
            results = main.result_structure
        func = Func("main", region, args, results)
        phase_module = Module(f"{module.name}_phase{k}", list(module.placements), [func])
        phases.append(
            Phase(
                phase_module,
                [names[v] for v in carried],
                [names[v] for v in outputs] if k < last else [],
            )
        )
    return phases
