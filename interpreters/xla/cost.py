"""What one round of a program costs: XLA's cost analysis and a per-placement report.

``cost_report(exe)`` (``exe.cost()``) returns a JSON-serializable dict:

- ``flops``, ``bytes_accessed``, ``transcendentals``: XLA's cost analysis of the
  compiled executable (``Compiled.cost_analysis()``); on a mesh that is the SPMD
  partitioned program, i.e. per device (``xla_scope``). ``xla`` holds every number
  XLA reported and ``hlo_flops`` the flops of the HLO before XLA's optimizations.
- ``server.flops``: the server's own work (local ops at the top level, the
  aggregations), from the cost analysis of ``main`` lowered alone with every
  ``fed.map`` replaced by zeros of its result types.
- ``placements``: one entry per placement, outermost first, with ``members`` (how
  many members it has in all, e.g. silos × clients per silo), ``flops_per_member``
  (each ``fed.map`` region at that placement lowered alone with ``jax.jit`` for one
  member, nested maps replaced by zeros, times how often it runs per round),
  ``bytes_broadcast_per_member`` (bytes each member receives by ``fed.broadcast``),
  ``bytes_aggregated_per_member`` (bytes each member contributes to reductions) and
  the totals over all members. Bytes come from the IR types of the federated ops'
  operands and results (dtype size × elements), so they are exact for any program.

A round is one call of ``main``. A federated op inside a ``scan`` counts ``length``
times; inside a ``while`` loop once (the trip count is not static) and inside a
``cond`` once per branch, each with a note in ``notes``. Region flops are from the
HLO before optimization, so ``flops_accounted`` (server + members × per member)
compares with ``hlo_flops``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from fcir.control_flow import scan_length
from fcir.interpreter import Interpreter, impl
from fcir.ir import Module, Op, Region
from fcir.privacy import format_round_cost, round_cost
from fcir.traffic import call_unit, transfers
from fcir.types import runtime_type

__all__ = ["cost_report", "format_cost"]



def cost_report(exe, *args) -> dict:
    """The report described in the module docstring, for ``args`` (or the executable's
    abstract parameter specs)."""
    module = exe.module
    xla = _cost_dict(exe.compiled(*args).cost_analysis())
    hlo = _cost_dict(exe.lower(*args).cost_analysis())
    devices = 1 if exe.mesh is None else int(exe.mesh.devices.size)

    levels = _levels(module)
    notes: list[str] = []
    maps: list[tuple[str, Region, float]] = []
    for t in transfers(module):  # bytes and op counts come from fcir.traffic
        level = levels[t.placement]
        if t.kind == "broadcast":
            level.bytes_broadcast_per_member += t.repeats * t.bytes_per_member
            level.broadcasts += 1
        else:
            level.bytes_aggregated_per_member += t.repeats * t.bytes_per_member
            level.aggregations += 1
    _visit(module, module.main.body, 1.0, 1.0, levels, maps, notes)
    flops = _Flops(module)
    once: dict[str, float] = dict.fromkeys(levels, 0.0)
    for placement, region, times, times_once in maps:
        levels[placement].flops_per_member += times * flops.own(region)
        once[placement] += times_once * flops.own(region, loops_once=True)
    server_flops = flops.own(module.main.body)
    per_call = server_flops + sum(lv.members * lv.flops_per_member for lv in levels.values())
    # XLA's cost analysis counts a loop body once, whatever its trip count: the same count
    # of our parts is what compares with hlo_flops.
    accounted = flops.own(module.main.body, loops_once=True) + sum(
        lv.members * once[name] for name, lv in levels.items()
    )

    report = {
        "module": module.name,
        "devices": devices,
        "mesh": None if exe.mesh is None else {str(k): int(v) for k, v in exe.mesh.shape.items()},
        "xla_scope": "program" if devices == 1 else "per_device",
        "flops": xla.get("flops", 0.0),
        "bytes_accessed": xla.get("bytes accessed", 0.0),
        "transcendentals": xla.get("transcendentals", 0.0),
        "hlo_flops": hlo.get("flops", 0.0),
        "xla": xla,
        "server": {"flops": server_flops},
        "placements": [lv.as_dict() for lv in levels.values()],
        "flops_accounted": accounted,
        "flops_per_call": per_call,
        "unit": call_unit(module),
        "notes": notes,
    }
    if getattr(exe, "streaming", None) is not None:  # xla.compile(..., clients_per_step=)
        report["streaming"] = {**exe.streaming, "memory": memory_stats(exe.compiled(*args))}
    privacy = round_cost(module)
    if privacy is not None:  # a module with DP aggregates: see fcir.privacy
        report["privacy"] = privacy
    return report


def predicted_peak(compiled) -> int:
    """Bytes XLA's memory analysis says the program holds at its peak, per device."""
    m = compiled.memory_analysis()
    return int(
        m.argument_size_in_bytes
        + m.output_size_in_bytes
        + m.temp_size_in_bytes
        - m.alias_size_in_bytes
    )


def memory_stats(compiled) -> dict:
    """XLA's memory analysis of ``compiled``, per device, in bytes."""
    m = compiled.memory_analysis()
    return {
        "argument_bytes": int(m.argument_size_in_bytes),
        "output_bytes": int(m.output_size_in_bytes),
        "temp_bytes": int(m.temp_size_in_bytes),
        "alias_bytes": int(m.alias_size_in_bytes),
        "peak_bytes": predicted_peak(compiled),
    }


@dataclasses.dataclass
class _Level:
    name: str
    parent: str
    cardinality: int
    members: int
    flops_per_member: float = 0.0
    bytes_broadcast_per_member: float = 0.0
    bytes_aggregated_per_member: float = 0.0
    broadcasts: int = 0
    aggregations: int = 0
    maps: int = 0

    def as_dict(self) -> dict:
        return {
            "name": self.name,
            "parent": self.parent,
            "cardinality": self.cardinality,
            "members": self.members,
            "flops_per_member": self.flops_per_member,
            "flops": self.flops_per_member * self.members,
            "bytes_broadcast_per_member": self.bytes_broadcast_per_member,
            "bytes_broadcast": self.bytes_broadcast_per_member * self.members,
            "bytes_aggregated_per_member": self.bytes_aggregated_per_member,
            "bytes_aggregated": self.bytes_aggregated_per_member * self.members,
            "broadcast_ops": self.broadcasts,
            "aggregation_ops": self.aggregations,
            "map_ops": self.maps,
        }


def _levels(module: Module) -> dict[str, _Level]:
    levels: dict[str, _Level] = {}
    members, parent = 1, "server"
    for name, n in module.placements:
        members *= n
        levels[name] = _Level(name, parent, n, members)
        parent = name
    return levels


def _visit(module, region: Region, times: float, once: float, levels, maps, notes) -> None:
    """Lists the fed.map regions to cost, each with how often it runs per member of the
    placement running ``region`` (``times``; ``once``: each loop body counted once, as
    XLA counts), and notes on loops whose trip count is not static."""
    for op in region.ops:
        if op.name == "fed.map":
            placement = op.operands[0].type.placement
            levels[placement].maps += 1
            maps.append((placement, op.regions[0], times, once))
            _visit(module, op.regions[0], times, once, levels, maps, notes)
        elif op.regions and _has_federated(op):
            _visit_control_flow(module, op, times, once, levels, maps, notes)


def _visit_control_flow(module, op: Op, times: float, once: float, levels, maps,
                        notes) -> None:
    name = op.name.removeprefix("jax.")
    if name == "scan":
        times *= scan_length(op)
    elif name == "while":
        notes.append(f"{op.name}: federated ops in a while loop are counted once per call")
    elif name == "cond":
        notes.append(f"{op.name}: federated ops in every branch are counted")
    for sub in op.regions:
        _visit(module, sub, times, once, levels, maps, notes)


def _has_federated(op: Op) -> bool:
    return any(
        o.name.startswith("fed.") or (o.regions and _has_federated(o))
        for r in op.regions
        for o in r.ops
    )


class _OwnWork(Interpreter):
    """Runs a region without the work of its members: a ``fed.map`` yields zeros."""

    @impl("fed.map")
    def map(self, op: Op, *args):
        return [_zeros(runtime_type(r.type, self.module.cardinality)) for r in op.results]


def _zeros(t):
    dtype = t.np_dtype
    impl = getattr(dtype, "_impl", None)
    if impl is not None:  # a PRNG key array: zeros of its key data
        data = jnp.zeros((*t.shape, *impl.key_shape), jnp.uint32)
        return jax.random.wrap_key_data(data, impl=impl.name)
    return jnp.zeros(t.shape, dtype)


class _Flops:
    """Flops of one execution of a region (one member, or the server), not counting
    nested fed.map regions: XLA's cost analysis of the region lowered alone, which
    counts each loop body once, plus ``length - 1`` more runs of each ``jax.scan`` body
    (nested scans likewise). ``loops_once=True``: XLA's count alone."""

    def __init__(self, module: Module):
        self.module = module
        self.cache: dict[tuple[int, bool], float] = {}

    def own(self, region: Region, loops_once: bool = False) -> float:
        key = (id(region), loops_once)
        if key not in self.cache:
            flops = self.xla(region)
            if not loops_once:
                flops += self.more_iterations(region)
            self.cache[key] = flops
        return self.cache[key]

    def more_iterations(self, region: Region) -> float:
        extra = 0.0
        for op in region.ops:
            if op.name == "fed.map" or not op.regions:
                continue  # member regions are costed on their own
            if op.name == "jax.scan" and isinstance(op.attrs.get("length"), int):
                body = op.regions[0]
                length = op.attrs["length"]
                extra += (length - 1) * self.xla(body) + length * self.more_iterations(body)
            else:  # while (trip count unknown: once), cond, calls
                extra += sum(self.more_iterations(sub) for sub in op.regions)
        return extra

    def xla(self, region: Region) -> float:
        key = (id(region), None)
        if key not in self.cache:
            self.cache[key] = _xla_flops(self.module, region)
        return self.cache[key]


def _xla_flops(module: Module, region: Region) -> float:
    """XLA's flops for one execution of ``region`` lowered alone (fed.maps as zeros)."""
    interp = _OwnWork()
    interp.module = module
    specs = [
        jax.ShapeDtypeStruct(t.shape, t.np_dtype)
        for t in (runtime_type(v.type, module.cardinality) for v in region.params)
    ]

    def own(*leaves):
        return interp.run_region(region, leaves)

    return _cost_dict(jax.jit(own).lower(*specs).cost_analysis()).get("flops", 0.0)


def _cost_dict(analysis) -> dict:
    if isinstance(analysis, (list, tuple)):  # one dict per computation in older JAX
        analysis = analysis[0] if analysis else {}
    return {str(k): float(v) for k, v in sorted((analysis or {}).items())}


# --- the human table ---------------------------------------------------------------------


def _num(x: float) -> str:
    if x is None:
        return "-"
    if float(x).is_integer():
        return f"{int(x):,}"
    return f"{x:,.1f}"


def _bytes(x: float) -> str:
    if not x:
        return "0 B"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if x >= scale:
            return f"{x / scale:,.2f} {unit}"
    return f"{int(x):,} B"


def format_cost(cost: dict) -> str:
    """``cost`` (from ``exe.cost()``) as the table ``fcir compile --emit cost`` prints."""
    scope = (
        "one device"
        if cost.get("devices", 1) == 1
        else f"per device, SPMD over {cost['devices']} devices"
    )
    lines = [
        f"@{cost['module']}: XLA cost analysis ({scope})",
        f"  flops            {_num(cost['flops'])}",
        f"  transcendentals  {_num(cost['transcendentals'])}",
        f"  bytes accessed   {_bytes(cost['bytes_accessed'])}",
        "",
        f"per {cost.get('unit', 'round')}",
    ]
    header = (
        "placement",
        "members",
        "flops/member",
        "flops",
        "down/member",
        "down total",
        "up/member",
        "up total",
    )
    rows = [("server", "1", _num(cost["server"]["flops"]), _num(cost["server"]["flops"]))]
    rows[0] += ("-", "-", "-", "-")
    for lv in cost["placements"]:
        rows.append(
            (
                lv["name"],
                _num(lv["members"]),
                _num(lv["flops_per_member"]),
                _num(lv["flops"]),
                _bytes(lv["bytes_broadcast_per_member"]),
                _bytes(lv["bytes_broadcast"]),
                _bytes(lv["bytes_aggregated_per_member"]),
                _bytes(lv["bytes_aggregated"]),
            )
        )
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]
    for r in (header, *rows):
        cells = [r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:], widths[1:])]
        lines.append("  " + "  ".join(cells).rstrip())
    lines.append("  down: bytes received by fed.broadcast; up: bytes sent into aggregations")
    per_call = cost.get("flops_per_call", cost["flops_accounted"])
    if per_call == cost["flops_accounted"]:
        lines.append(
            f"  flops accounted for: {_num(cost['flops_accounted'])} of "
            f"{_num(cost['hlo_flops'])} in the unoptimized HLO"
        )
    else:  # loops: the table counts every iteration, XLA each loop body once
        lines.append(
            f"  flops accounted for: {_num(cost['flops_accounted'])} of "
            f"{_num(cost['hlo_flops'])} in the unoptimized HLO, both counting each loop "
            f"body once as XLA does; with every iteration (the table): {_num(per_call)}"
        )
    lines.extend(f"  note: {n}" for n in cost.get("notes", []))
    stream = cost.get("streaming")
    if stream:
        mem = stream["memory"]
        lines.append(
            f"streaming: {stream['clients_per_step']} members per step and device "
            f"({stream['mode']}); XLA predicts a peak of {_bytes(mem['peak_bytes'])} per "
            f"device ({_bytes(mem['temp_bytes'])} temporaries)"
            + (
                f", limit {_bytes(stream['memory_limit_bytes'])}"
                if "memory_limit_bytes" in stream
                else ""
            )
        )
    privacy = format_round_cost(cost.get("privacy"))
    if privacy:
        lines.extend(["", *privacy])
    return "\n".join(lines)
