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
from fcir.ir import Func, Module, Region, Value
from fcir.ir.types import Structure

from ..production.rewrite import clone_op, named

# What the Flower runtime does with each fed op (tests/test_op_coverage.py reads this
# table): a phase is split by the production export, the ServerApp aggregates the
# clients' replies with the bundle's intrinsics (app/runtime.py) and adds DP noise.
_OWN_RULES: dict[type[F.FedOp] | str, object] = {
    F.Broadcast: "sent with the phase's message to every node",
    F.Map: "client_work, run by each ClientApp",
    **{c: "aggregated by the ServerApp (app/runtime.py aggregate)"
       for c in (F.Sum, F.Mean, F.Min, F.Max, F.WeightedMean)},
    F.SecureSum: "SecAgg+ over 16-bit chunks (app/secagg.py)",
    F.DpSum: "clipped at the nodes, summed and noised by the ServerApp",
    F.DpMean: "clipped at the nodes, summed and noised by the ServerApp",
    # Decomposed by the production export (interpreters/production/ddp.py).
    F.DdpSum: "encoded and noised at the nodes, summed modulo 2**bits by SecAgg+ "
    "(app/secagg.py), decoded by the ServerApp",
    F.DdpMean: "encoded and noised at the nodes, summed modulo 2**bits by SecAgg+ "
    "(app/secagg.py), decoded and divided by the cardinality by the ServerApp",
    # Any other reduction (the order statistics) is aggregated by the ServerApp with
    # the op's own server_aggregate. Not secure: it sees every node's value
    # (docs/flower.md).
    "reduction": "aggregated by the ServerApp over every reply (app/runtime.py aggregate)",
}
RULES = F.resolve(_OWN_RULES)
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
        outputs = (
            [v for v in names if level[v] == k] if k < last else list(main.body.results)
        )
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
