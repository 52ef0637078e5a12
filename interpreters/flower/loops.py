"""A whole training program -> a Flower app that runs one Flower round per iteration.

A program whose main runs its rounds in a server loop (``lax.scan``, ``fori_loop``, or
``while_loop`` around broadcasts and aggregations: the FAX pattern) is split in three:

- ``pre``: the server code before the loop, from the program's server arguments to the
  loop's server operands (consts, initial carry, scanned-over ``xs``);
- ``round``: the loop body as a round of its own (its parameters: the loop's consts,
  carry and one slice of each ``xs``; its results: the new carry and one slice of each
  ``ys``), exported like any round (several exchanges become phases);
- ``post``: the server code after the loop, from the program's server arguments and
  the loop's results to the program's results;

and for a ``while_loop`` the condition, ``cond``, from its consts and the carry to a
server ``bool[]``, evaluated at the server before each round. The ServerApp runs
``pre``, then one round per iteration (the carry stays at the server, checkpointed each
round), stacks the ``ys`` as ``lax.scan`` does, and runs ``post``: its output file holds
exactly the program's results. The client data are the program's client arguments,
passed to the loop unchanged (consts of the loop), or the initial value of a carry
placed at the clients: per-client state, which the round computes in one exchange's
client work (a client output the plan marks as ``state``), each node keeps on disk
(app/client_app.py) and the server never sees (app/program.py: which round's state
each node enters a round with).
"""

from __future__ import annotations

import dataclasses

from fcir import fed as F
from fcir.errors import ExportError
from fcir.ir import Func, Module, Op, Region, Value
from fcir.ir.control_flow import bindings
from fcir.ir.types import SERVER, PlacedType, Structure, runtime_type

from ..production import lowering
from ..production.rewrite import clone_op
from .phases import levels

LOOPS = ("jax.scan", "jax.while")
# The reduction that marks a client carry's new value in the round (its result unused):
# the identity on the client side for every dtype but bool (sent as int32).
STATE_MARK = F.Max.name


def _is_client(t) -> bool:
    return isinstance(t, PlacedType) and t.placement != SERVER


def _has_fed(region: Region) -> bool:
    for op in region.ops:
        if op.name in F.ops() or any(_has_fed(r) for r in op.regions):
            return True
    return False


@dataclasses.dataclass
class LoopSplit:
    kind: str  # "scan" or "while"
    op_attrs: dict
    pre: Module
    round: Module
    post: Module
    cond: Module | None
    roles: list[tuple[str, int]]  # per loop operand: ("const"|"carry"|"xs"|"cond", k)
    client_operands: list[int]  # loop operand -> which program client leaf (by position)
    n_carry: int
    body: object  # fcir.ir.control_flow.Binding of the body
    cond_binding: object  # ... of a while loop's condition (None for a scan)
    operands: list  # the loop's operand values (to tell server from client ones)
    client_carry: list[int]  # body parameters of the carries placed at the clients (state)
    state_marks: list  # (body result index, the round's fed.max result marking it)


def find_loop(module: Module) -> int | None:
    """Index of main's top-level loop whose regions hold federated ops, if any."""
    hits = [
        i
        for i, op in enumerate(module.main.body.ops)
        if op.regions and any(_has_fed(r) for r in op.regions)
    ]
    if not hits:
        return None
    ops = module.main.body.ops
    if len(hits) > 1 or ops[hits[0]].name not in LOOPS:
        op = ops[hits[0]]
        raise ExportError(
            f"export --target flower: @{module.name}'s federated code sits in {op.name} "
            f"(op {hits[0]} of main){' and more' if len(hits) > 1 else ''}: a program exports "
            "as rounds when its main runs them in one server lax.scan, fori_loop or "
            "while_loop"
        )
    return hits[0]


def _module(
    name: str, placements, params: list[Value], ops, results, env, private: bool = False
) -> Module:
    region = Region(params, [], [], "main")
    for op in ops:
        region.ops.append(clone_op(op, env))
    region.results = [env[v] for v in results]
    n, m = len(params), len(results)
    args = Structure("tuple", tuple(Structure("leaf", leaf=i) for i in range(n)))
    res = Structure("tuple", tuple(Structure("leaf", leaf=i) for i in range(m)))
    return Module(name, list(placements), [Func("main", region, args, res)], private=private)


def split_loop(module: Module, at: int) -> LoopSplit:
    main = module.main
    ops = main.body.ops
    loop = ops[at]
    kind = loop.name.removeprefix("jax.")
    params = main.body.params
    where = f"export --target flower: @{module.name}"
    before, after = ops[:at], ops[at + 1 :]
    _check_server_code_around(where, before, after, main.body.results)
    binds = bindings(kind, loop.attrs, len(loop.operands), len(loop.results), len(loop.regions))
    body, cond, roles, nk = _roles(kind, loop, binds)
    client_params = [v for v in params if _is_client(v.type)]
    client_operands, client_carry = _client_operands(where, loop, roles, body, client_params)
    # pre: program server args -> the loop's server operands.
    server_params = [v for v in params if not _is_client(v.type)]
    env: dict = {}
    pre_params = [Value(v.type) for v in server_params]
    env.update(zip(server_params, pre_params))
    server_operands = [v for v in loop.operands if not _is_client(v.type)]
    pre = _module(f"{module.name}_pre", module.placements, pre_params, before, server_operands, env)
    rnd, state_marks = _round_module(module, where, loop, body, client_carry)
    cond_module = None if cond is None else _cond_module(module, where, loop, cond)
    # post: program server args + the loop's server results -> the program's results
    # (the server code before the loop runs again there when the code after it reads
    # it). The clients' final state stays at the clients.
    env = {}
    server_loop_results = [v for v in loop.results if not _is_client(v.type)]
    post_params = [Value(v.type) for v in server_params + server_loop_results]
    env.update(zip(server_params + server_loop_results, post_params))
    post = _module(
        f"{module.name}_post",
        module.placements,
        post_params,
        before + after,
        main.body.results,
        env,
    )
    return LoopSplit(
        kind,
        dict(loop.attrs),
        pre,
        rnd,
        post,
        cond_module,
        roles,
        client_operands,
        nk,
        body,
        cond,
        list(loop.operands),
        client_carry,
        state_marks,
    )


def _check_server_code_around(where: str, before: list, after: list, results: list) -> None:
    """Only server code runs before and after the loop of rounds, and the program's
    results live at the server."""
    for op in before:
        if op.name in F.ops() or any(_is_client(v.type) for v in op.operands + op.results):
            raise ExportError(
                f"{where}: {op.name} before the loop touches client values; only server code "
                "may run before the rounds (the client data go into the loop as they are)"
            )
    for op in after:
        if op.name in F.ops() or any(_is_client(v.type) for v in op.operands):
            raise ExportError(
                f"{where}: {op.name} after the loop is federated or reads client values; only "
                "server code may run after the rounds"
            )
    if any(_is_client(v.type) for v in results):
        raise ExportError(f"{where}: a result is placed at the clients; results live at the server")


def _roles(kind: str, loop: Op, binds) -> tuple:
    """(body binding, condition binding or None, each loop operand's (role, index), the
    number of carries) of a scan or while loop."""
    if kind == "scan":
        (body,) = binds
        nc = int(loop.attrs["num_consts"])
        nk = int(loop.attrs["num_carry"])
        roles = [("const", i) for i in range(nc)] + [("carry", k) for k in range(nk)]
        roles += [("xs", j) for j in range(len(loop.operands) - nc - nk)]
        return body, None, roles, nk
    cond, body = binds
    cn, bn = int(loop.attrs["cond_nconsts"]), int(loop.attrs["body_nconsts"])
    nk = len(loop.operands) - cn - bn
    roles = [("cond", i) for i in range(cn)] + [("const", i) for i in range(bn)]
    roles += [("carry", k) for k in range(nk)]
    return body, cond, roles, nk


def _client_operands(where: str, loop: Op, roles: list, body, client_params: list):
    """(for each client operand of the loop, the program's client argument it is; the
    body parameters of the carries placed at the clients): every client argument goes
    into the loop once, unchanged, as a constant or a carry's initial value."""
    client_operands = []
    client_carry = []  # body parameters of the carries placed at the clients
    for i, v in enumerate(loop.operands):
        if not _is_client(v.type):
            continue
        if roles[i][0] not in ("const", "carry") or v not in client_params:
            raise ExportError(
                f"{where}: loop operand {i} ({v.type}, the loop's {roles[i][0]}) is a client "
                "value that is not one of the program's client arguments: pass client data "
                "into the loop unchanged (a constant of the loop), and start per-client state "
                "(a carry placed at the clients) from a client argument"
            )
        if roles[i][0] == "carry":  # the body's parameter for it
            client_carry.append(next(r for r, (j, _) in enumerate(body.params) if j == i))
        client_operands.append(client_params.index(v))
    if sorted(client_operands) != list(range(len(client_params))) or len(
        set(client_operands)
    ) != len(client_operands):
        raise ExportError(
            f"{where}: every client argument must go into the loop once, as a constant or "
            "as the initial value of a carry (the nodes hold the program's client arguments)"
        )
    return client_operands, client_carry


def _round_module(module: Module, where: str, loop: Op, body, client_carry: list):
    """The body region as a round, and its state marks. A carry placed at the clients
    (per-client state) is no result of the round, which returns server values only: each
    becomes the operand of a fed.max appended to the round (its result unused), so the
    split computes it in the client work of the exchange it waits for, as a client
    output; the plan marks those outputs as state, which the node keeps and never sends."""
    region = loop.regions[body.region]
    env: dict = {}
    rparams = [Value(v.type) for v in region.params]
    env.update(zip(region.params, rparams))
    state_results = [o for o, v in enumerate(region.results) if _is_client(v.type)]
    if state_results and module.private:
        raise ExportError(
            f"{where}: per-client state (a carry placed at the clients) in a private "
            "program is not exported to Flower: the app marks the state with a plain "
            "aggregation, which the privacy check of a private round refuses; keep the "
            "state at the server, or export without private=True"
        )
    for o in state_results:
        role, k = body.results[o]
        if role != "carry" or k not in client_carry:
            raise ExportError(
                f"{where}: the loop body's result {o} ({region.results[o].type}) is placed at "
                "the clients but is not a carry started from a client argument: results "
                "stacked by a scan live at the server (aggregate them first)"
            )
    server_results = [v for o, v in enumerate(region.results) if o not in state_results]
    rnd = _module(
        f"{module.name}_round",
        module.placements,
        rparams,
        region.ops,
        server_results,
        env,
        private=module.private,
    )
    state_marks = []
    for o in state_results:
        v = env[region.results[o]]
        out = Value(PlacedType(v.type.member, SERVER, True))
        rnd.main.body.ops.append(Op(STATE_MARK, [v], [out], {}))
        state_marks.append((o, out))
    rnd.main.arg_structure = Structure(
        "tuple", tuple(Structure("leaf", leaf=i) for i in range(len(rparams)))
    )
    return rnd, state_marks


def _cond_module(module: Module, where: str, loop: Op, cond) -> Module:
    """A while loop's condition as a server module of its server parameters."""
    cregion = loop.regions[cond.region]
    env: dict = {}
    # The per-client state (carries at the clients) is not the condition's to read.
    kept = [v for v in cregion.params if not _is_client(v.type)]
    cparams = [Value(v.type) for v in kept]
    env.update(zip(kept, cparams))
    reads_client = any(
        v in cregion.params and _is_client(v.type) for op in cregion.ops for v in op.operands
    ) or any(v in cregion.params and _is_client(v.type) for v in cregion.results)
    if _has_fed(cregion) or reads_client:
        raise ExportError(
            f"{where}: the while_loop's condition reads client values; it runs at the "
            "server between rounds"
        )
    return _module(
        f"{module.name}_cond", module.placements, cparams, cregion.ops, cregion.results, env
    )


def _part(artifact: str, params: list, results: list) -> dict:
    return {"artifact": artifact, "params": params, "results": results}


def loop_plan(
    module: Module, at: int, build_round_plan, spec, paths, server_inputs=None
) -> tuple[dict, dict]:
    """plan.json and the artifacts of a program whose rounds run in the loop at op
    ``at`` of main (see the module doc). ``build_round_plan(round, server_inputs=)`` is
    writer.build_plan; ``server_inputs`` (the program's, for --device-runtime iree)
    become the first iteration's, which its device modules are verified on too."""
    ls = split_loop(module, at)
    firsts = None if server_inputs is None else first_round_inputs(ls, server_inputs)
    doc, artifacts = build_round_plan(ls.round, server_inputs=firsts)
    params = module.main.body.params
    server_leaves = [i for i, v in enumerate(params) if not _is_client(v.type)]
    server_ops = [i for i, v in enumerate(ls.operands) if not _is_client(v.type)]
    pre_of = {i: j for j, i in enumerate(server_ops)}  # loop operand -> pre result

    def rt(v):
        return runtime_type(v.type, module.cardinality)

    # Round parameter r is loop operand body.params[r] (a slice of it for scan xs).
    operand_of = [i for i, _ in ls.body.params]
    round_inputs = []
    for s in doc["server_inputs"]:
        r = s["leaf"]
        i = operand_of[r]
        role = ls.roles[i][0]
        source = ["xs" if role == "xs" else "pre", pre_of[i]]
        round_inputs.append({**s, "from": source, "role": role})
    by_leaf = {s["leaf"]: s for s in doc["client_inputs"]}
    client_inputs = []
    client_leaves = [i for i, v in enumerate(params) if _is_client(v.type)]
    for leaf in client_leaves:
        r = operand_of.index(ls.operands.index(params[leaf]))
        # "leaf": the program's argument leaf (what the node file holds, in order);
        # "round_leaf": the round parameter it feeds.
        client_inputs.append({**by_leaf[r], "leaf": leaf, "round_leaf": r})
    carry, results = _carry_and_results(ls)
    client_state = []
    for entry in client_inputs:
        if entry["round_leaf"] in ls.client_carry:
            entry["state"] = len(client_state)
            client_state.append(
                {k: entry[k] for k in ("leaf", "round_leaf", "type", "dtype", "shape")}
            )
    _mark_state_steps(doc, ls, where=f"export --target flower: @{module.name}")
    loop_results = module.main.body.ops[at].results
    cond = None if ls.cond is None else _cond_part(ls, pre_of)
    pre = _part(
        "loop.pre",
        [["arg", str(i)] for i in server_leaves],
        [["pre", str(j)] for j in range(len(server_ops))],
    )
    post = _part(
        "loop.post",
        [["arg", str(i)] for i in server_leaves]
        + [["loop", str(k)] for k, v in enumerate(loop_results) if not _is_client(v.type)],
        [["output", str(j)] for j in range(len(module.main.body.results))],
    )
    for name, m in (("loop.pre", ls.pre), ("loop.post", ls.post), ("loop.cond", ls.cond)):
        if m is not None:
            fn, specs = lowering.flat_function(m)
            artifacts[name] = lowering.stablehlo_artifact(fn, specs)[0]
    arg_paths = paths(module.main.arg_structure, len(params))
    results_v = module.main.body.results
    result_paths = paths(module.main.result_structure, len(results_v))
    structure = module.main.result_structure
    loop = {
        "kind": ls.kind,
        "length": int(ls.op_attrs.get("length", 0)) if ls.kind == "scan" else None,
        "reverse": bool(ls.op_attrs.get("reverse", False)),
        "round_inputs": round_inputs,
        "round_outputs": doc["outputs"],
        "carry": carry,
        "results": results,
        "result_specs": [spec(rt(v), k) for k, v in enumerate(loop_results)],
        "client_state": client_state,
        "pre": pre,
        "post": post,
        "cond": cond,
    }
    doc = {
        **doc,
        "round": module.name,
        "signature": f"{ls.kind} of rounds",
        "server_inputs": [spec(rt(params[i]), i, arg_paths.get(i)) for i in server_leaves],
        "client_inputs": client_inputs,
        "outputs": [spec(rt(v), i, result_paths.get(i)) for i, v in enumerate(results_v)],
        "output_order": structure.leaves()
        if structure is not None
        else list(range(len(results_v))),
        "loop": loop,
    }
    return doc, artifacts


def _carry_and_results(ls: LoopSplit) -> tuple[list, list]:
    """plan.json's ``carry`` (round output -> the round parameter it feeds next round)
    and ``results`` (what each loop result is: the server's carry, the clients' carry,
    or a round output stacked)."""
    # A carry at the clients (per-client state) is no round output: body result o is
    # round output out_of[o].
    marked = {o for o, _ in ls.state_marks}
    out_of = {o: n for n, o in enumerate(o for o in range(len(ls.body.results)) if o not in marked)}
    carry = []
    for o, (kind, k) in enumerate(ls.body.results):
        if kind == "carry" and o not in marked:
            carry.append([out_of[o], k])  # round output feeds round parameter k next round

    def kept(r):  # a loop result: the server's carry, or the clients' (never read)
        return ["client" if r in ls.client_carry else "carry", r]

    if ls.kind == "scan":
        nc = int(ls.op_attrs["num_consts"])
        results = [kept(nc + j) for j in range(ls.n_carry)]
        results += [
            ["stacked", out_of[o]]
            for o, (kind, _) in enumerate(ls.body.results)
            if kind == "stacked"
        ]
    else:
        bn = int(ls.op_attrs["body_nconsts"])
        results = [kept(bn + k) for k in range(ls.n_carry)]
    return carry, results


def _cond_part(ls: LoopSplit, pre_of: dict) -> dict:
    """plan.json's ``cond``: the condition's parameters are its consts (pre results),
    then the carry (the body's carry parameters, in order)."""
    bn = int(ls.op_attrs["body_nconsts"])
    cparams = []
    for i, _ in ls.cond_binding.params:
        if _is_client(ls.operands[i].type):
            continue  # per-client state: not a parameter of the condition
        role, k = ls.roles[i]
        cparams.append(["pre", str(pre_of[i])] if role == "cond" else ["round", str(bn + k)])
    return _part("loop.cond", cparams, [["cond", "0"]])


def _mark_state_steps(doc: dict, ls: LoopSplit, where: str) -> None:
    """Moves the fed.max marks of the per-client state (split_loop) out of the round's
    aggregations: the exchange that computes the state gets ``state``, one entry per
    client carry (``round_leaf``: the round parameter it feeds; ``output``: the client
    output that holds its new value; ``aggregated``, ``dtype``, ``shape``: the unused
    aggregate the server fills with zeros for the round's server parts)."""
    if not ls.state_marks:
        return
    level = levels(ls.round)
    at = {level[out] for _, out in ls.state_marks}
    if len(at) != 1:
        raise ExportError(
            f"{where}: the per-client state is computed in {len(at)} different exchanges of "
            "the round; compute every carry placed at the clients from what one exchange "
            "broadcasts"
        )
    exchanges = [s for s in doc["steps"] if s["kind"] == "exchange"]
    step = exchanges[at.pop() - 1]
    n = len(ls.state_marks)
    marks, rest = step["aggregations"][-n:], step["aggregations"][:-n]
    if len(marks) != n or any(a["fed_op"] != STATE_MARK for a in marks):
        raise ExportError(f"{where}: the per-client state did not lower to client outputs")
    by_name = {name: f"{group}/{name}" for group, name in step["client"]["results"]}
    entries = []
    for (o, out), agg in zip(ls.state_marks, marks):
        t = out.type.member
        dtype = "int32" if t.dtype == "bool" else t.np_dtype.name  # fed.max sends bools so
        entries.append(
            {
                "round_leaf": ls.body.results[o][1],  # the carry's round parameter
                "output": by_name[agg["inputs"][0]],
                "aggregated": agg["output"],
                "dtype": dtype,
                "shape": list(t.shape),
            }
        )
    step["aggregations"] = rest
    step["state"] = entries


def first_round_inputs(ls: LoopSplit, server_inputs) -> list | None:
    """The round's server inputs in the loop's first iteration: ``pre`` run (by XLA) on
    the program's server inputs, each scanned-over ``xs`` at the index that iteration
    reads (the last for a reverse scan); None when
    the inputs are not ``pre``'s (the writer then says what is wrong with them)."""
    import jax
    import numpy as np

    types = [runtime_type(v.type, ls.pre.cardinality) for v in ls.pre.main.body.params]
    xs = [np.asarray(x) for x in server_inputs]
    if len(xs) != len(types) or any(
        x.dtype.name != t.np_dtype.name or x.shape != tuple(t.shape) for x, t in zip(xs, types)
    ):
        return None
    fn, _ = lowering.flat_function(ls.pre)
    server_ops = [i for i, v in enumerate(ls.operands) if not _is_client(v.type)]
    value = dict(zip(server_ops, (np.asarray(y) for y in jax.jit(fn)(*xs))))
    first = -1 if ls.op_attrs.get("reverse") else 0
    return [value[i][first] if sliced else value[i] for i, sliced in ls.body.params if i in value]
