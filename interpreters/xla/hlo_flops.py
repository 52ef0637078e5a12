"""FLOPs of an HLO module, counted from its text, the same on every platform.

XLA's own analysis of a module before its optimizations (JAX's
``Lowered.cost_analysis()``) runs on the CPU backend only: on a TPU or GPU, JAX returns
None for it. :func:`count` reads the HLO text JAX hands to XLA (``lowered.as_text("hlo")``,
identical for every backend) and applies the rules of XLA's ``HloCostAnalysis``:

- elementwise ops (arithmetic, compare, select, clamp, convert, ...): one flop per output
  element; ``exponential``, ``log``, ``tanh``, ``sqrt``, ``power``, the trigonometric
  ones and the other transcendental ones count as *transcendentals* instead, as XLA
  counts them;
- ``dot``: 2 × output elements × contracted elements (a multiply-add is two flops);
- ``convolution``: 2 × input features per group × output features × batch per group ×
  the kernel positions that land inside the (padded, dilated) input;
- ``reduce``, ``reduce-window``, ``scatter``, ``map``, ``select-and-scatter``: the
  reducer's flops once per application; ``sort``: n⌈log₂ n⌉; ``all-reduce``: one flop
  per output element; ``fft``, ``cholesky``, ``triangular-solve``: XLA's estimates;
- ``call``, ``fusion``: the called computation; ``conditional``: its costliest branch;
- ``while``: its body and condition, once (``loops_once``, XLA's count) and ``trip
  count`` times (``flops``), where the trip count can be read off the loop: a counter
  that starts at a constant, steps by a constant and is compared with a constant (what
  ``lax.scan`` and ``fori_loop`` lower to). A loop whose trip count depends on data
  counts once in both, and is counted in ``unknown_trip_counts``.

Where it differs from XLA's analysis: XLA counts a ``custom-call`` as -1 flops (unknown),
this counter as 0 (``custom_calls`` says how many there were), and XLA adds its counts
up in float32, so its totals above 2**24 are rounded.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re

__all__ = ["HloCount", "count"]

TRANSCENDENTAL = frozenset(
    "acosh erf exponential log logistic power sqrt cbrt rsqrt tanh sine cosine "
    "exponential-minus-one log-plus-one atan2 tan".split()
)
ELEMENTWISE = TRANSCENDENTAL | frozenset(
    "abs ceil count-leading-zeros floor imag is-finite not negate popcnt real "
    "round-nearest-afz round-nearest-even sign add complex divide maximum minimum "
    "multiply remainder subtract and or xor shift-left shift-right-arithmetic "
    "shift-right-logical compare clamp select convert bitcast-convert reduce-precision "
    "stochastic-convert".split()
)


@dataclasses.dataclass(frozen=True)
class HloCount:
    """What :func:`count` found. ``flops`` and ``transcendentals`` count every iteration
    of a loop whose trip count is known; ``*_loops_once`` each loop body once, as XLA's
    cost analysis does."""

    flops: float
    flops_loops_once: float
    transcendentals: float
    transcendentals_loops_once: float
    unknown_trip_counts: int  # while loops whose trip count depends on data: counted once
    custom_calls: int  # counted as 0 flops (XLA: -1 each)


@dataclasses.dataclass(frozen=True)
class _Instr:
    name: str
    shape: str
    opcode: str
    operands: tuple[str, ...]
    attrs: str


@dataclasses.dataclass
class _Cost:
    flops: float = 0.0
    once: float = 0.0
    trans: float = 0.0
    trans_once: float = 0.0
    unknown: int = 0
    custom: int = 0

    def add(self, other: _Cost, times: float = 1.0, times_once: float | None = None) -> None:
        once = times if times_once is None else times_once
        self.flops += times * other.flops
        self.once += once * other.once
        self.trans += times * other.trans
        self.trans_once += once * other.trans_once
        self.unknown += other.unknown
        self.custom += other.custom

    def elementwise(self, n: float, transcendental: bool) -> None:
        if transcendental:
            self.trans += n
            self.trans_once += n
        else:
            self.flops += n
            self.once += n


def count(hlo_text: str) -> HloCount:
    """The flops of the module ``hlo_text`` (HLO text, ``Lowered.as_text("hlo")`` or a
    compiled module's ``as_text()``), from its entry computation."""
    module = _Module(hlo_text)
    c = module.cost(module.entry)
    return HloCount(c.flops, c.once, c.trans, c.trans_once, c.unknown, c.custom)


# -- parsing --------------------------------------------------------------------------

_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*(\(.*\))?\s*(->.*)?\{\s*$")
_ARRAY = re.compile(r"([a-z]+[0-9]*)\[([^\]]*)\]")


def _closing(text: str, start: int) -> int:
    """The index just past the bracket that closes the one at ``text[start]``."""
    pairs = {"(": ")", "[": "]", "{": "}"}
    stack = []
    for i in range(start, len(text)):
        ch = text[i]
        if ch in pairs:
            stack.append(pairs[ch])
        elif stack and ch == stack[-1]:
            stack.pop()
            if not stack:
                return i + 1
    return len(text)


def _split_top(text: str) -> list[str]:
    """``text`` split at its commas outside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def _instruction(line: str) -> _Instr | None:
    line = line.strip()
    if line.startswith("ROOT "):
        line = line[5:]
    name, eq, rest = line.partition(" = ")
    if not eq:
        return None
    rest = rest.lstrip()
    end = _closing(rest, 0) if rest.startswith("(") else rest.find(" ")
    if end < 0:
        return None
    shape, rest = rest[:end], rest[end:].lstrip()
    paren = rest.find("(")
    if paren < 0:
        return None
    opcode = rest[:paren].strip()
    close = _closing(rest, paren)
    operands = tuple(p.split()[-1].lstrip("%") for p in _split_top(rest[paren + 1 : close - 1]))
    return _Instr(name.strip().lstrip("%"), shape, opcode, operands, rest[close:])


def _arrays(shape: str) -> list[list[int]]:
    """The dimensions of each array in ``shape`` (one for an array, several for a
    tuple); ``<=n`` (a dynamic dimension) counts as its bound ``n``."""
    out = []
    for m in _ARRAY.finditer(shape):
        if m.group(1) == "token":
            continue
        dims = [d.strip().lstrip("<=") for d in m.group(2).split(",") if d.strip()]
        out.append([int(d) for d in dims if d.isdigit()])
    return out


def _elements(shape: str, first_only: bool = False) -> int:
    arrays = _arrays(shape)
    if first_only:
        arrays = arrays[:1]
    return sum(math.prod(a) for a in arrays)


def _attr(attrs: str, key: str) -> str | None:
    """The value of ``key=`` in an instruction's attributes (a ``{...}`` group whole)."""
    m = re.search(rf"(?:^|[\s,]){re.escape(key)}=", attrs)
    if m is None:
        return None
    start = m.end()
    if start < len(attrs) and attrs[start] == "{":
        return attrs[start + 1 : _closing(attrs, start) - 1]
    end = start
    while end < len(attrs) and attrs[end] not in ", ":
        end += 1
    return attrs[start:end]


def _ints(text: str | None) -> list[int]:
    return [int(x) for x in re.findall(r"-?\d+", text or "")]


class _Module:
    def __init__(self, text: str):
        self.computations: dict[str, list[_Instr]] = {}
        self.entry = ""
        current: list[_Instr] | None = None
        for line in text.splitlines():
            stripped = line.strip()
            if current is None:
                m = _HEADER.match(stripped)
                if m and not stripped.startswith("HloModule"):
                    current = self.computations.setdefault(m.group(2), [])
                    if m.group(1):
                        self.entry = m.group(2)
                continue
            if stripped == "}":
                current = None
                continue
            instr = _instruction(stripped)
            if instr is not None:
                current.append(instr)
        if not self.entry and self.computations:
            self.entry = list(self.computations)[-1]  # XLA prints the entry last
        self.shapes = {i.name: i.shape for instrs in self.computations.values() for i in instrs}
        self.by_name = {i.name: i for instrs in self.computations.values() for i in instrs}

    @functools.cache  # noqa: B019  (one _Module per count(): freed with it)
    def cost(self, computation: str) -> _Cost:
        total = _Cost()
        for instr in self.computations.get(computation, ()):
            self._instruction_cost(instr, total)
        return total

    def _sub(self, attrs: str, key: str) -> _Cost:
        name = _attr(attrs, key)
        return self.cost(name.lstrip("%")) if name else _Cost()

    def _instruction_cost(self, i: _Instr, total: _Cost) -> None:  # noqa: C901
        op = i.opcode
        if op in ELEMENTWISE:
            total.elementwise(_elements(i.shape), op in TRANSCENDENTAL)
        elif op == "fma":  # a multiply and an add (JAX 0.12.1's fmuladd lowers to it)
            total.elementwise(2 * _elements(i.shape), False)
        elif op == "dot":
            lhs = _arrays(self.shapes.get(i.operands[0], ""))
            dims = lhs[0] if lhs else []
            width = math.prod(dims[d] for d in _ints(_attr(i.attrs, "lhs_contracting_dims")))
            total.elementwise(2 * _elements(i.shape) * width, False)
        elif op == "convolution":
            total.elementwise(self._convolution(i), False)
        elif op in ("reduce", "scatter", "map"):
            if op == "reduce":
                n = _elements(self.shapes.get(i.operands[0], ""), True) - _elements(i.shape, True)
            elif op == "scatter":  # operands..., indices, updates...: the first update
                n = _elements(self.shapes.get(i.operands[(len(i.operands) + 1) // 2], ""))
            else:
                n = _elements(i.shape, True)
            total.add(self._sub(i.attrs, "to_apply"), n)
        elif op == "reduce-window":
            total.add(self._sub(i.attrs, "to_apply"), self._reduce_window_count(i))
        elif op == "select-and-scatter":
            source = _elements(self.shapes.get(i.operands[1], ""))
            window = math.prod(self._window(i.attrs)["size"] or [1])
            total.add(self._sub(i.attrs, "select"), source * (window - 1))
            total.add(self._sub(i.attrs, "scatter"), source)
        elif op == "sort":
            n = _elements(self.shapes.get(i.operands[0], ""))
            total.elementwise(n * math.ceil(math.log2(n)) if n > 1 else 0, False)
        elif op in ("all-reduce", "all-reduce-start"):
            total.elementwise(_elements(i.shape), False)
        elif op in ("rng", "rng-bit-generator"):
            total.elementwise(_elements(i.shape), True)
        elif op in ("call", "async-start"):
            total.add(
                self._sub(i.attrs, "to_apply")
                if "to_apply=" in i.attrs
                else self._sub(i.attrs, "calls")
            )
        elif op == "fusion":
            total.add(self._sub(i.attrs, "calls"))
        elif op == "conditional":
            total.add(self._conditional(i))
        elif op == "while":
            self._while(i, total)
        elif op == "custom-call":
            total.custom += 1
        elif op in ("fft", "cholesky", "triangular-solve"):
            total.elementwise(self._linear_algebra(i), False)

    # -- loops and branches -----------------------------------------------------------

    def _while(self, i: _Instr, total: _Cost) -> None:
        body = self._sub(i.attrs, "body")
        cond = self._sub(i.attrs, "condition")
        trips = self._trip_count(i)
        one = _Cost()
        one.add(body)
        one.add(cond)
        if trips is None:
            one.unknown += 1
            trips = 1
        total.add(one, trips, 1.0)

    def _conditional(self, i: _Instr) -> _Cost:
        names = _attr(i.attrs, "branch_computations")
        branches = (
            [n.strip().lstrip("%") for n in names.split(",")]
            if names
            else [
                (_attr(i.attrs, k) or "").lstrip("%")
                for k in ("true_computation", "false_computation")
            ]
        )
        costs = [self.cost(b) for b in branches if b]
        out = _Cost()
        for field in ("flops", "once", "trans", "trans_once"):
            setattr(out, field, max((getattr(c, field) for c in costs), default=0.0))
        out.unknown = sum(c.unknown for c in costs)
        out.custom = sum(c.custom for c in costs)
        return out

    def _trip_count(self, i: _Instr) -> int | None:
        """The trip count of the while loop ``i``: XLA's ``known_trip_count`` where the
        module states it, else read off a counter ``c`` in the loop's tuple that the
        condition compares (``c < n``, ``n > c``, ``c <= n``) with a constant or a
        loop-invariant element set from one, that starts at a constant and that the body
        steps by a constant; None when the loop is not of that form."""
        known = re.search(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)', i.attrs)
        if known:
            return int(known.group(1))
        cond = self.computations.get((_attr(i.attrs, "condition") or "").lstrip("%"), [])
        body = self.computations.get((_attr(i.attrs, "body") or "").lstrip("%"), [])
        init = self.by_name.get(i.operands[0]) if i.operands else None
        if not cond or not body or init is None or init.opcode != "tuple":
            return None
        root = cond[-1]
        if root.opcode != "compare" or len(root.operands) != 2:
            return None
        direction = _attr(root.attrs, "direction")
        a, b = root.operands
        if direction == "GT":
            a, b, direction = b, a, "LT"
        elif direction == "GE":
            a, b, direction = b, a, "LE"
        if direction not in ("LT", "LE"):
            return None
        counter = self._tuple_index(a)
        limit = self._invariant(b, init, body)
        start = None if counter is None else self._constant(init.operands[counter])
        step = None if counter is None else self._step(body, counter)
        if None in (counter, limit, start, step) or step <= 0:
            return None
        span = limit - start + (1 if direction == "LE" else 0)
        return max(0, -(-span // step))

    def _tuple_index(self, name: str) -> int | None:
        instr = self.by_name.get(name)
        if instr is None or instr.opcode != "get-tuple-element":
            return None
        source = self.by_name.get(instr.operands[0])
        if source is None or source.opcode != "parameter":
            return None
        index = _ints(_attr(instr.attrs, "index"))
        return index[0] if index else None

    def _constant(self, name: str) -> int | None:
        instr = self.by_name.get(name)
        while instr is not None and instr.opcode in ("copy", "convert", "reshape"):
            instr = self.by_name.get(instr.operands[0]) if instr.operands else None
        if instr is None or instr.opcode != "constant" or _arrays(instr.shape) != [[]]:
            return None
        value = instr.operands[0] if instr.operands else ""
        return int(value) if re.fullmatch(r"-?\d+", value) else None

    def _invariant(self, name: str, init: _Instr, body: list[_Instr]) -> int | None:
        """The value of ``name`` in the condition: a constant, or a tuple element that
        starts as a constant and that the body passes on unchanged."""
        value = self._constant(name)
        if value is not None:
            return value
        index = self._tuple_index(name)
        if index is None or index >= len(init.operands) or body[-1].opcode != "tuple":
            return None
        if self._tuple_index(body[-1].operands[index]) != index:
            return None
        return self._constant(init.operands[index])

    def _step(self, body: list[_Instr], index: int) -> int | None:
        root = body[-1]
        if root.opcode != "tuple" or index >= len(root.operands):
            return None
        update = self.by_name.get(root.operands[index])
        if update is None or update.opcode != "add" or len(update.operands) != 2:
            return None
        x, y = update.operands
        if self._tuple_index(x) == index:
            return self._constant(y)
        if self._tuple_index(y) == index:
            return self._constant(x)
        return None

    # -- windows ---------------------------------------------------------------------

    @staticmethod
    def _window(attrs: str) -> dict[str, list]:
        """``window={size=3x3 stride=2x2 pad=1_1x0_1 lhs_dilate=.. rhs_dilate=..}`` as
        lists per spatial dimension (empty where absent)."""
        text = _attr(attrs, "window") or ""
        fields = dict(part.split("=", 1) for part in text.split() if "=" in part)

        def ints(key, default):
            value = fields.get(key)
            return [int(x) for x in value.split("x")] if value else default

        size = ints("size", [])
        n = len(size)
        pads = [
            tuple(int(p) for p in pair.split("_"))
            for pair in fields.get("pad", "").split("x")
            if pair
        ] or [(0, 0)] * n
        return {
            "size": size,
            "stride": ints("stride", [1] * n),
            "pad": pads,
            "lhs_dilate": ints("lhs_dilate", [1] * n),
            "rhs_dilate": ints("rhs_dilate", [1] * n),
        }

    def _reduce_window_count(self, i: _Instr) -> int:
        """Reducer applications: window size - 1 per output element; a window that
        spans a whole padded dimension (a reduce and broadcast back, as ``cumsum``
        lowers) counts as XLA counts it."""
        w = self._window(i.attrs)
        window = math.prod(w["size"] or [1])
        out_arrays = _arrays(i.shape)
        out = math.prod(out_arrays[0]) if out_arrays else 0
        count = (window - 1) * out
        reducing = [s for s in w["size"] if s != 1]
        padded = [p for p in w["pad"] if p != (0, 0)]
        if len(reducing) == 1 and len(padded) == 1 and len(out_arrays) == 1:
            for d, (s, (lo, hi)) in enumerate(zip(w["size"], w["pad"])):
                if s != 1 and lo and lo == hi and s == 2 * lo + 1:
                    if lo == out_arrays[0][d] - 1:
                        span = out_arrays[0][d]
                        count = out // span + (span - 1)
        return count

    def _convolution(self, i: _Instr) -> int:
        lhs = (_arrays(self.shapes.get(i.operands[0], "")) or [[]])[0]
        rhs = (_arrays(self.shapes.get(i.operands[1], "")) or [[]])[0]
        out = (_arrays(i.shape) or [[]])[0]
        labels = _attr(i.attrs, "dim_labels") or ""
        lhs_l, _, rest = labels.partition("_")
        rhs_l, _, out_l = rest.partition("->")
        if not (lhs_l and rhs_l and out_l):
            return 0
        w = self._window(i.attrs)
        spatial = [c for c in lhs_l if c.isdigit()]
        positions = 1
        for k, digit in enumerate(sorted(spatial)):
            in_n = lhs[lhs_l.index(digit)]
            kernel_n = rhs[rhs_l.index(digit)]
            out_n = out[out_l.index(digit)]
            positions *= _valid_positions(
                in_n, kernel_n, out_n, w["stride"][k], w["pad"][k],
                w["lhs_dilate"][k], w["rhs_dilate"][k],
            )  # fmt: skip
        features = _ints(_attr(i.attrs, "feature_group_count")) or [1]
        batches = _ints(_attr(i.attrs, "batch_group_count")) or [1]
        in_features = lhs[lhs_l.index("f")] // features[0]
        out_features = out[out_l.index("f")]
        batch = lhs[lhs_l.index("b")] // batches[0]
        return 2 * in_features * out_features * batch * positions

    def _linear_algebra(self, i: _Instr) -> float:
        a = (_arrays(self.shapes.get(i.operands[0], "")) or [[]])[0]
        if i.opcode == "fft":
            logs = math.prod(int(math.log2(n)) for n in _ints(_attr(i.attrs, "fft_length")))
            return 2 * 4 * logs * math.prod(a)
        if i.opcode == "cholesky":
            return (a[-1] * math.prod(a)) // 3 if a else 0
        b = (_arrays(self.shapes.get(i.operands[1], "")) or [[]])[0]
        return 2 * (a[-1] if a else 0) * math.prod(b)


def _valid_positions(in_n, kernel_n, out_n, stride, pad, lhs_dilate, rhs_dilate) -> int:
    """(kernel position, output position) pairs of one spatial dimension whose input
    element exists: not in the padding, not a hole of the input's dilation."""
    lo = pad[0]
    count = 0
    for k in range(kernel_n):
        for o in range(out_n):
            x = o * stride - lo + k * rhs_dilate
            if x < 0 or x % lhs_dilate:
                continue
            if x // lhs_dilate < in_n:
                count += 1
    return count
