"""What one round of a program costs: flops counted from the HLO, and a per-placement report.

``cost_report(exe)`` (``exe.cost()``) returns a JSON-serializable dict:

- ``flops``, ``bytes_accessed``, ``transcendentals``: XLA's cost analysis of the
  compiled executable (``Compiled.cost_analysis()``, what the platform's compiler says
  of the optimized program); on a mesh that is the SPMD partitioned program, i.e. per
  device (``xla_scope``). ``xla`` holds every number XLA reported.
- ``hlo_flops``: the flops of the HLO before XLA's optimizations, each loop body once,
  counted by :mod:`.hlo_flops` from the HLO text (the rules of XLA's own analysis, which
  JAX runs on CPU only: counted so, the report is the same on every platform).
- ``server.flops``: the server's own work (local ops at the top level, the
  aggregations), counted from ``main`` lowered alone with every ``fed.map`` replaced by
  zeros of its result types.
- ``placements``: one entry per placement, outermost first, with ``members`` (how
  many members it has in all, e.g. silos × clients per silo), ``flops_per_member``
  (each ``fed.map`` region at that placement lowered alone with ``jax.jit`` for one
  member, nested maps replaced by zeros, times how often it runs per round),
  ``bytes_broadcast_per_member`` (bytes each member receives by ``fed.broadcast``),
  ``bytes_aggregated_per_member`` (bytes each member contributes to reductions) and
  the totals over all members. Bytes come from the IR types of the federated ops'
  operands and results (dtype size × elements), so they are exact for any program.
- ``flops_per_call``: the server's flops plus every member's, every loop iteration
  counted; with ``timing`` (below), ``flops_per_second``: ``flops_per_call`` over the
  median seconds of a timed call.

A round is one call of ``main``. A federated op inside a ``scan`` counts ``length``
times; inside a ``while`` loop once (the trip count is not static) and inside a
``cond`` once per branch, each with a note in ``notes``. Local loops count every
iteration where the HLO's loop has a static trip count (a ``scan``, a ``fori_loop``;
:mod:`.hlo_flops`), else once, with a note. ``flops_accounted`` (the server's, plus each
member region vmapped over its members as the program runs it, loop bodies once)
compares with ``hlo_flops``. ``flops_per_member`` is what one member computes alone: it
includes work no member's data reaches (a client's ``1 / batch_size``), which the
vmapped program does once for all members.

Timing: ``exe.timed(*args)`` calls the program, waits for its results and records the
wall seconds of the call (the first call of an argument signature is run once untimed
before, so that compiling is not timed); ``exe.cost(*args)`` for the same argument
types then adds ``timing`` (the calls timed, their median and fastest seconds) and
``flops_per_second``. An ordinary ``exe(*args)`` is never timed: it returns before the
device has finished, and blocking it would cost every caller the overlap.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from fcir import fed as F
from fcir.base_interpreter import Interpreter, impl
from fcir.ir import Module, Op, Region
from fcir.ir.control_flow import scan_length
from fcir.ir.types import runtime_type
from fcir.privacy import format_round_cost, round_cost
from fcir.report.traffic import call_unit, transfers

from . import hlo_flops

__all__ = ["cost_report", "format_cost"]


def cost_report(exe, *args) -> dict:
    """The report described in the module docstring, for ``args`` (or the executable's
    abstract parameter specs)."""
    module = exe.module
    xla = _cost_dict(exe.compiled(*args).cost_analysis())
    hlo = hlo_flops.count(exe.lower(*args).as_text("hlo"))
    devices = 1 if exe.mesh is None else int(exe.mesh.devices.size)

    levels = _levels(module)
    notes: list[str] = []
    maps: list[tuple[str, Region, float]] = []
    for t in transfers(module):  # bytes and op counts come from fcir.report.traffic
        level = levels[t.placement]
        if t.kind == "broadcast":
            level.bytes_broadcast_per_member += t.repeats * t.bytes_per_member
            level.broadcasts += 1
        else:
            level.bytes_aggregated_per_member += t.repeats * t.bytes_per_member
            level.aggregations += 1
    _visit(module, module.main.body, 1.0, 1.0, levels, maps, notes)
    flops = _Flops(module)
    for placement, region, times, _ in maps:
        levels[placement].flops_per_member += times * flops.own(region)
    server_flops = flops.own(module.main.body)
    per_call = server_flops + sum(lv.members * lv.flops_per_member for lv in levels.values())
    # XLA's cost analysis counts a loop body once, whatever its trip count: the same count
    # of our parts is what compares with hlo_flops. The program runs a fed.map's region
    # vmapped over all members, which computes work that no member's data reaches (1 / 8
    # in a client's loss) once, not once per member: the members' part is costed so.
    accounted = flops.own(module.main.body, loops_once=True) + sum(
        times_once * flops.vmapped(region, levels[placement].members)
        for placement, region, _, times_once in maps
    )

    report = {
        "module": module.name,
        "devices": devices,
        "mesh": None if exe.mesh is None else {str(k): int(v) for k, v in exe.mesh.shape.items()},
        "xla_scope": "program" if devices == 1 else "per_device",
        "flops": xla.get("flops", 0.0),
        "bytes_accessed": xla.get("bytes accessed", 0.0),
        "transcendentals": xla.get("transcendentals", 0.0),
        "hlo_flops": hlo.flops_loops_once,
        "xla": xla,
        "server": {"flops": server_flops},
        "placements": [lv.as_dict() for lv in levels.values()],
        "flops_accounted": accounted,
        "flops_per_call": per_call,
        "unit": call_unit(module),
        "notes": notes,
    }
    if hlo.unknown_trip_counts:
        notes.append(
            f"{hlo.unknown_trip_counts} while loop(s) whose trip count depends on the data "
            "are counted once per call"
        )
    timing = exe.timing(*args) if hasattr(exe, "timing") else None
    if timing is not None:
        report["timing"] = timing
        report["flops_per_second"] = per_call / timing["median_seconds"]
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
        if F.op_class(op) is F.Map:
            placement = op.operands[0].type.placement
            levels[placement].maps += 1
            maps.append((placement, op.regions[0], times, once))
            _visit(module, op.regions[0], times, once, levels, maps, notes)
        elif op.regions and _has_federated(op):
            _visit_control_flow(module, op, times, once, levels, maps, notes)


def _visit_control_flow(module, op: Op, times: float, once: float, levels, maps, notes) -> None:
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

    @impl(F.Map)
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
    nested fed.map regions: the HLO of the region lowered alone, counted by
    :mod:`.hlo_flops`, every iteration of its loops (``loops_once=True``: each loop
    body once, as XLA counts)."""

    def __init__(self, module: Module):
        self.module = module
        self.cache: dict[tuple[int, int | None], hlo_flops.HloCount] = {}

    def own(self, region: Region, loops_once: bool = False) -> float:
        counted = self._count(region, None)
        return counted.flops_loops_once if loops_once else counted.flops

    def vmapped(self, region: Region, members: int) -> float:
        """The count (loop bodies once) of a member region run for ``members`` members
        at once, as the program runs it: vmapped, so what no member's data reaches runs
        once."""
        return self._count(region, members).flops_loops_once

    def _count(self, region: Region, members: int | None) -> hlo_flops.HloCount:
        key = (id(region), members)
        if key not in self.cache:
            self.cache[key] = _region_flops(self.module, region, members)
        return self.cache[key]


def own_flops(module: Module, region: Region) -> float:
    """The flops of one execution of ``region`` (every iteration of its loops), its
    nested fed.map regions not counted: e.g. the server's own work in ``main``."""
    return _Flops(module).own(region)


def _region_flops(module: Module, region: Region, members: int | None) -> hlo_flops.HloCount:
    """The HLO count of one execution of ``region`` lowered alone (fed.maps as zeros), or
    with ``members``: of the region vmapped over that many members."""
    interp = _OwnWork()
    interp.module = module
    lead = () if members is None else (members,)
    specs = [
        jax.ShapeDtypeStruct((*lead, *t.shape), t.np_dtype)
        for t in (runtime_type(v.type, module.cardinality) for v in region.params)
    ]

    def own(*leaves):
        return interp.run_region(region, leaves)

    fn = own if members is None else jax.vmap(own, axis_size=members)
    return hlo_flops.count(jax.jit(fn).lower(*specs).as_text("hlo"))


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
    timing = cost.get("timing")
    if timing:
        lines.append(
            f"  timed: {timing['calls']} call(s), median {timing['median_seconds'] * 1e3:,.3f} ms"
            f": {cost['flops_per_second'] / 1e12:,.3f} TFLOP/s (flops per call / median)"
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
