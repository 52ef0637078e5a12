"""Pictures of a federated program: its dataflow graph in Graphviz ``dot``, or SVG.

``to_dot(module)`` draws one cluster per placement (``server``, then the declared
placements outermost first). What is drawn, so that a transformer round stays a
handful of boxes:

* the arguments and results of ``main``, one box per top-level argument or result
  (a parameter pytree is one box, with its leaf count and bytes);
* a run of consecutive local (``jax.*``) ops at one placement is one box with its op
  count and most frequent ops;
* a run of consecutive ``fed.broadcast`` (or of the same reduction) is one box in the
  placement that receives the values;
* a ``fed.map`` whose body does not communicate is one box in the members' cluster,
  with the op count of the member computation; a ``fed.map`` whose body communicates
  (a silo that broadcasts to its clients) is drawn open, its body in the silos'
  cluster. Control flow that contains federated ops is drawn open the same way;
* an edge that crosses into another placement is communication, labelled with the
  bytes per member and per round (``fcir.report.traffic.transfers``). Other edges are local
  dataflow, unlabelled.

``to_svg(module)`` runs Graphviz's ``dot`` program on that text.
"""

from __future__ import annotations

import collections
import re
import shutil
import subprocess

from fcir import fed as F
from fcir.errors import FcirError
from fcir.ir import Module, Op, Region, Value, expect_module, walk
from fcir.ir.types import SERVER, PlacedType, Structure
from fcir.report.traffic import REDUCTIONS, Transfer, call_unit, format_bytes, nbytes, transfers

__all__ = ["to_dot", "to_svg"]

_FILL = ("#eeeeee", "#ddeeff", "#e2f4e2", "#fff2d9", "#f4e2f4")  # server, then by depth
_BROADCAST_COLOR = "#1f5fa8"
_AGGREGATE_COLOR = "#b0302a"
_SUMMARY_KINDS = 3  # op names shown in a box
_NOTABLE = frozenset(
    f"jax.{n}" for n in ("scan", "while", "cond", "dot_general", "conv_general_dilated")
)


def to_dot(module: Module) -> str:
    """The dataflow graph of ``module`` in Graphviz ``dot`` syntax (deterministic)."""
    expect_module(module, "fcir.report.dot.to_dot")
    return _Drawing(module).draw()


def to_svg(module: Module, *, timeout: float = 60.0) -> str:
    """The graph rendered to SVG by Graphviz's ``dot`` program (it must be installed)."""
    exe = shutil.which("dot")
    if exe is None:
        raise FcirError(
            "--format svg needs Graphviz's `dot` program, which is not installed: install "
            "graphviz (apt-get install graphviz, brew install graphviz, conda install "
            "graphviz), or use --format dot and render the text elsewhere"
        )
    try:
        done = subprocess.run(
            [exe, "-Tsvg"],
            input=to_dot(module),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise FcirError(f"running Graphviz `dot` failed: {e}") from None
    if done.returncode != 0:
        raise FcirError(f"Graphviz `dot` failed (exit {done.returncode}): {done.stderr.strip()}")
    return done.stdout


# --- building the graph ------------------------------------------------------------------


class _Node:
    __slots__ = ("context", "id", "kind", "label", "ops", "placement")

    def __init__(self, id: str, placement: str, kind: str, label: str, context: str):
        self.id, self.placement, self.kind = id, placement, kind
        self.label, self.context = label, context
        self.ops: list[Op] = []


class _Edge:
    """Dataflow between two boxes; communication if values cross a placement on it."""

    __slots__ = ("bytes", "kind", "members", "per_member", "repeats")

    def __init__(self):
        self.kind: str | None = None
        self.bytes = self.per_member = self.members = self.repeats = 0

    def add(self, t: Transfer, operand: int) -> None:
        size = t.operand_bytes[operand]
        self.kind, self.members, self.repeats = t.kind, t.members, t.repeats
        self.per_member += size
        self.bytes += size * t.members * t.repeats

    def attributes(self) -> str:
        if self.kind is None:
            return ""
        color = _BROADCAST_COLOR if self.kind == "broadcast" else _AGGREGATE_COLOR
        times = f" x {self.repeats} times" if self.repeats > 1 else ""
        # Per round is one run of the op; in a loop of rounds the call runs it repeats times.
        per_round = self.per_member * self.members
        label = f"{format_bytes(per_round)}/round\n{self.members} x {format_bytes(self.per_member)}"
        who = "receives" if self.kind == "broadcast" else "sends"
        tooltip = (
            f"{self.kind}: {format_bytes(per_round)} per round; each of {self.members} "
            f"members {who} {format_bytes(self.per_member)}{times}"
            + (f"; {format_bytes(self.bytes)} per call" if self.repeats > 1 else "")
        )
        return (
            f' [class="{self.kind}", color="{color}", fontcolor="{color}", penwidth=2.2, '
            f"minlen=2, label={_quote(label + times)}, tooltip={_quote(tooltip)}]"
        )


class _Drawing:
    def __init__(self, module: Module):
        self.module = module
        self.nodes: list[_Node] = []
        self.edges: dict[tuple[str, str], _Edge] = {}
        self.sources: dict[Value, list[_Node]] = {}
        self.traffic: dict[int, Transfer] = {id(t.op): t for t in transfers(module)}
        self.federated: dict[int, bool] = {}

    # -- nodes and edges --

    def node(self, placement: str, kind: str, label: str = "", context: str = "") -> _Node:
        n = _Node(f"n{len(self.nodes)}", placement, kind, label, context)
        self.nodes.append(n)
        return n

    def use(self, value: Value, dst: _Node, transfer: Transfer | None = None, i: int = 0):
        for src in self.sources.get(value, ()):
            if src is dst:
                continue
            edge = self.edges.setdefault((src.id, dst.id), _Edge())
            if transfer is not None and src.placement != dst.placement:
                edge.add(transfer, i)

    def define(self, values, node: _Node) -> None:
        for v in values:
            self.sources[v] = [node]

    # -- traversal --

    def draw(self) -> str:
        func = self.module.main
        self.arguments(func.body.params, func.arg_structure)
        self.region(func.body, SERVER, "")
        self.results(func.body.results, func.result_structure)
        return self.render()

    def arguments(self, params: list[Value], structure: Structure | None) -> None:
        for label, leaves in _groups(structure, len(params), "arg"):
            by_place: dict[str, list[Value]] = {}
            for i in leaves:
                by_place.setdefault(_innermost(params[i].type), []).append(params[i])
            for place, values in by_place.items():
                n = self.node(place, "io", _io_label(self.module, label, values))
                self.define(values, n)

    def results(self, results: list[Value], structure: Structure | None) -> None:
        for label, leaves in _groups(structure, len(results), "result"):
            values = [results[i] for i in leaves]
            n = self.node(SERVER, "io", _io_label(self.module, label, values))
            for v in values:
                self.use(v, n)

    def region(self, region: Region, placement: str, context: str) -> None:
        """Draws the ops of ``region``, which runs at ``placement``."""
        run: _Node | None = None  # the box of the current run of local or federated ops
        for op in region.ops:
            kind = self.kind_of(op)
            if run is None or run.kind != kind or kind in ("map", "open"):
                run = None
            if kind == "open":
                self.open(op, placement, context)
                continue
            if kind == "map":
                run = self.node(op.operands[0].type.placement, "map", _map_label(op, context))
            elif run is None:
                where = op.attrs["to"] if F.op_class(op) is F.Broadcast else placement
                run = self.node(where, kind, context=context)
            run.ops.append(op)
            t = self.traffic.get(id(op))
            for i, v in enumerate(op.operands):
                self.use(v, run, t, i)
            self.define(op.results, run)

    def kind_of(self, op: Op) -> str:
        if F.op_class(op) is F.Broadcast:
            return f"broadcast:{op.attrs['to']}"
        if op.name in REDUCTIONS:
            bits = op.attrs.get("bitwidth")
            return f"{op.name}:{op.operands[0].type.placement}:{bits}"
        if F.op_class(op) is F.Map:
            return "open" if self.communicates(op) else "map"
        if op.regions and self.communicates(op):
            return "open"
        return "local"

    def communicates(self, op: Op) -> bool:
        key = id(op)
        if key not in self.federated:
            self.federated[key] = any(
                F.op_class(o) is F.Broadcast or o.name in REDUCTIONS
                for r in op.regions
                for _, o in walk(r)
            )
        return self.federated[key]

    def open(self, op: Op, placement: str, context: str) -> None:
        """Draws the regions of ``op`` in place: region parameters take their values
        from the op's last operands, the op's results from the regions' yields."""
        if F.op_class(op) is F.Map:
            inner, inner_context = op.operands[0].type.placement, context
        else:
            inner = placement
            name = op.name.removeprefix("jax.")
            times = f" x{op.attrs['length']}" if name == "scan" and "length" in op.attrs else ""
            inner_context = f"{context} > {name}{times}" if context else f"{name}{times}"
        produced: dict[int, list[_Node]] = collections.defaultdict(list)
        for r in op.regions:
            skip = len(op.operands) - len(r.params)
            for p, v in zip(r.params, op.operands[max(skip, 0) :]):
                self.sources[p] = list(self.sources.get(v, ()))
            self.region(r, inner, inner_context)
            if len(r.results) == len(op.results):
                for i, v in enumerate(r.results):
                    for n in self.sources.get(v, ()):
                        if n not in produced[i]:
                            produced[i].append(n)
        for i, v in enumerate(op.results):
            self.sources[v] = produced[i]

    # -- text --

    def render(self) -> str:
        m = self.module
        places = [SERVER, *(p for p, _ in m.placements)]
        total = sum(t.bytes for t in self.traffic.values())
        title = f"@{m.name}: {' > '.join(_place_title(m, p) for p in places)}"
        title += f"; {format_bytes(total)} communicated per {call_unit(m)}"
        lines = [
            f"digraph {_quote('fcir_' + m.name)} {{",
            f"  label={_quote(title)};",
            "  labelloc=t; fontname=Helvetica; fontsize=16; rankdir=TB; newrank=true;",
            "  nodesep=0.5; ranksep=0.4;",
            (
                '  node [fontname=Helvetica, fontsize=11, shape=box, style="rounded,filled", '
                'fillcolor=white, color="#555555"];'
            ),
            '  edge [fontname=Helvetica, fontsize=10, color="#555555"];',
        ]
        for depth, place in enumerate(places):
            fill = _FILL[min(depth, len(_FILL) - 1)]
            lines.append(f"  subgraph {_id('cluster_' + place)} {{")
            lines.append(f"    label={_quote(_place_title(m, place))};")
            lines.append(f'    style="rounded,filled"; fillcolor="{fill}"; color="#999999";')
            lines.append("    fontsize=14;")
            members = [n for n in self.nodes if n.placement == place]
            for n in members:
                label = n.label or _run_label(n)
                lines.append(f"    {n.id} [{_node_style(n)}label={_quote(label)}];")
            if not members:
                lines.append(
                    f"    {_id('empty_' + place)} "
                    '[shape=plaintext, style="", label="(nothing runs here)"];'
                )
            lines.append("  }")
        for (src, dst), edge in self.edges.items():
            lines.append(f"  {src} -> {dst}{edge.attributes()};")
        lines.append("}")
        return "\n".join(lines) + "\n"


# --- labels ------------------------------------------------------------------------------


def _groups(structure: Structure | None, count: int, word: str):
    """(label, leaf indices) per top-level argument or result."""
    if structure is None:
        return [(f"{word} {i}", [i]) for i in range(count)]
    if structure.kind in ("tuple", "list"):
        return [(f"{word} {i}" + _keys(c), c.leaves()) for i, c in enumerate(structure.children)]
    return [(word + _keys(structure), structure.leaves())]


def _keys(s: Structure) -> str:
    if not s.names:
        return ""
    shown = ", ".join(s.names[:4]) + (", ..." if len(s.names) > 4 else "")
    return " {" + shown + "}"


def _innermost(t) -> str:
    while isinstance(t, PlacedType) and isinstance(t.member, PlacedType):
        t = t.member
    return t.placement if isinstance(t, PlacedType) else SERVER


def _io_label(module: Module, label: str, values: list[Value]) -> str:
    if len(values) == 1:
        return f"{label}\n{values[0].type}"
    size = sum(nbytes(module, v.type) for v in values)
    return f"{label}\n{len(values)} arrays, {format_bytes(size)}"


def _count(ops) -> tuple[int, str]:
    """(op count, "most frequent op names") of ``ops`` and everything nested in them."""
    names: collections.Counter = collections.Counter()
    for op in ops:
        names[op.name] += 1
        for r in op.regions:
            for _, o in walk(r):
                names[o.name] += 1
    total = sum(names.values())
    names.pop("fcir.constant", None)
    # Loops and contractions say most about a computation, then the most frequent ops.
    top = sorted(names.items(), key=lambda kv: (kv[0] not in _NOTABLE, -kv[1], kv[0]))
    top = top[:_SUMMARY_KINDS]
    text = ", ".join(_short(k) + (f" x{v}" if v > 1 else "") for k, v in top)
    if len(names) > _SUMMARY_KINDS:
        text += ", ..."
    return total, text


def _short(name: str) -> str:
    return name.removeprefix("jax.")


def _map_label(op: Op, context: str) -> str:
    total, kinds = _count(op.regions[0].ops)
    return f"{op.name}: member computation\n{total} ops: {kinds}{_within(context)}"


def _run_label(n: _Node) -> str:
    context = n.context
    first = n.ops[0]
    count = len(n.ops)
    if n.kind == "local":
        total, kinds = _count(n.ops)
        return f"{total} local op{'s' if total != 1 else ''}\n{kinds}{_within(context)}"
    name = first.name
    if F.op_class(first) is F.SecureSum:
        name += f" ({first.attrs['bitwidth']} bits)"
    return f"{name}" + (f" x{count}" if count > 1 else "") + _within(context)


def _within(context: str) -> str:
    return f"\n(in {context})" if context else ""


def _node_style(n: _Node) -> str:
    if n.kind == "io":
        return 'shape=box, style="filled", fillcolor="#ffffff", peripheries=2, '
    if n.kind == "map":
        return 'shape=box3d, style="filled", fillcolor="#ffffff", '
    if n.kind.startswith("broadcast"):
        return f'shape=invhouse, style="filled", color="{_BROADCAST_COLOR}", '
    if n.kind.startswith("fed."):
        return f'shape=house, style="filled", color="{_AGGREGATE_COLOR}", '
    return ""


def _place_title(module: Module, place: str) -> str:
    if place == SERVER:
        return SERVER
    n = module.cardinality(place)
    names = [p for p, _ in module.placements]
    i = names.index(place)
    if i == 0:
        return f"{place} ({n})"
    total = 1
    for _, k in module.placements[: i + 1]:
        total *= k
    parent = names[i - 1]
    one = parent.removesuffix("s")
    return f"{place} ({n} per {one}, {total} in all)"


def _id(name: str) -> str:
    """A dot identifier: bare when it is one, else quoted (parsed IR may name a
    placement ``a.b`` or ``a-b``)."""
    return name if re.fullmatch(r"[A-Za-z_]\w*", name) else _quote(name)


def _quote(text: str) -> str:
    """A dot string: backslashes and quotes escaped, newlines as centered line breaks."""
    body = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{body}"'
