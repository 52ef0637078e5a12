"""Which rounds export: every reason a round is rejected, as an ExportError naming the op.

A round exports when it is straight-line federated code at the server over one client
placement: at most one broadcast stage before at most one aggregation stage (one
exchange), no client-to-client communication, no per-member reads, and only tensors
that federated_language can type crossing a part boundary. The split pass
(``split.py``) finds the exchange-count and boundary-dtype problems while it assigns
ops to parts; the structural ones are found here first.
"""

from __future__ import annotations

from fcir import fed as F
from fcir.checker.check import verify
from fcir.errors import ExportError
from fcir.ir import Module, Op, describe, value_numbering, walk
from fcir.ir.attrs import Record
from fcir.ir.control_flow import is_placed

# Reasons, quoted in messages and named in tests.
HIERARCHICAL = "hierarchical placements"
CONTROL_FLOW = "federated op under control flow"
CLIENT_TO_CLIENT = "client-to-client communication"
PER_MEMBER_READ = "per-member read"
UNBROADCAST_FLOW = f"server value used at the clients without {F.Broadcast.name}"
SECOND_EXCHANGE = "more than one broadcast/aggregate exchange"
UNSUPPORTED_DTYPE = "unsupported dtype"
CLIENT_RESULT = "round result placed at the clients"
ILL_TYPED = "ill-typed round"
HOST_PRINT = "host print"
MULTI_DEVICE = "layout over several devices"

# Ops that call back into the Python host that runs them: a production runtime has none.
_HOST_OPS = frozenset({"jax.debug_print"})


def fail(module: Module, where: str, reason: str, detail: str) -> ExportError:
    """The one-line error for ``reason`` at ``where``."""
    return ExportError(f"@{module.name} is not exportable: {where}: {reason}: {detail}")


def check_structure(module: Module) -> None:
    """Raises ExportError for hierarchies, federated control flow, and whatever the
    checker reports (client-to-client collectives, per-member reads, type errors)."""
    main = module.main
    names = value_numbering(main)
    ops_by_path = {}
    for path, op in walk(main.body):
        ops_by_path[path] = op
        if op.name in _HOST_OPS:
            raise fail(
                module, describe(module, path, op, names), HOST_PRINT,
                "a production round runs without a Python host to print to; remove "
                "jax.debug.print before exporting (reference and xla run it)",
            )
        devices = _mesh_devices(op.attrs.values())
        if devices > 1:
            raise fail(
                module, describe(module, path, op, names), MULTI_DEVICE,
                f"{op.name} spans a mesh of {devices} devices, and each part of a "
                "production round runs on one device (a client's phone, a server task), "
                "where a bundle exported with it cannot run. Write the round without it "
                "(lay the round out over devices with xla.compile(module, mesh=mesh)) and "
                "capture again; reference.run and xla.compile run the module as it is",
            )
        if op.name not in F.ops() or len(path) == 1:
            continue
        parent = ops_by_path[path[:-2]]
        where = describe(module, path, op, names)
        if F.ops().get(parent.name) is F.Map:
            placement = parent.operands[0].type.placement if parent.operands else "?"
            raise fail(
                module,
                where,
                HIERARCHICAL,
                f"it runs inside a {F.Map.name} over '{placement}'; federated_language knows only "
                "the server and one level of clients: export each level as its own round",
            )
        raise fail(
            module,
            where,
            CONTROL_FLOW,
            f"it sits in a region of {parent.name}; a production round is straight-line "
            "federated code: unroll the loop or export one round per iteration",
        )
    for path, op in walk(main.body):
        # Server control flow that only passes client values along (no fed op inside):
        # still not one straight-line exchange.
        if len(path) == 1 and op.regions and op.name.startswith("jax.") and any(
            is_placed(v.type) for v in [*op.operands, *op.results]
        ):
            raise fail(
                module,
                describe(module, path, op, names),
                CONTROL_FLOW,
                f"{op.name} carries values placed at the clients through its regions; a "
                "production round is straight-line federated code: decide at the server "
                "before the round, or export one round per branch",
            )
    diags = verify(module)
    if diags:
        first = next((d for d in diags if d.placement), diags[0])
        reason = ILL_TYPED
        if first.code == "local/C3":
            reason = CLIENT_TO_CLIENT
        elif first.code == "local/C1":
            reason = PER_MEMBER_READ if "reads a value" in first.message else UNBROADCAST_FLOW
        more = f" (and {len(diags) - 1} more problem(s); run fcir check)" if len(diags) > 1 else ""
        raise fail(module, first.where, reason, first.message.replace("\n", " ") + more)


def _mesh_devices(attrs) -> int:
    """The most devices a concrete mesh among ``attrs`` spans (a shard_map's ``mesh``, a
    sharding constraint's NamedSharding), 1 if none: what ``jax.export`` would fix as the
    exported function's device count. Abstract meshes (a context mesh) name no devices."""
    most = 1
    for a in attrs:
        if isinstance(a, tuple):
            most = max(most, _mesh_devices(a))
        elif isinstance(a, Record):
            if a.type_name == "Mesh":
                size = 1
                for s in a.get("axis_sizes", ()):
                    size *= int(s)
                most = max(most, size)
            most = max(most, _mesh_devices(v for _, v in a.fields))
    return most


def op_where(module: Module, path: tuple, op: Op, names: dict) -> str:
    return describe(module, path, op, names)
