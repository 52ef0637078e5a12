"""Canonical text: printer and parser.

One op per line; value names ``%N`` assigned by the printer in reading order;
attributes sorted by key; regions indented; floats printed exactly (round-trip repr);
constants with more than ``INLINE_LIMIT`` elements elided to type + sha256 prefix
unless ``full_constants``; a header line with ``ir_version``; no source locations
unless asked. Grammar (informal)::

    module    := 'fcir.module' '@'NAME 'ir_version='INT 'placements=[' (NAME':'INT),* ']' func*
    func      := 'func' '@'NAME '(' param,* ')' '->' '(' type,* ')' '{' struct* op* 'return' vals '}'
    struct    := '.args' structure | '.results' structure
    op        := (result,+ '=')? OPNAME vals? attrdict? loc? regions?
    result    := VALUE ':' type
    regions   := '{' region '}' (',' '{' region '}')*
    region    := '^'LABEL '(' param,* ')' ':' op* 'yield' vals
    attrdict  := '{' (KEY '=' attr),* '}'
    attr      := INT | FLOAT | STRING | 'true' | 'false' | 'none' | DTYPE | '[' attr,* ']'
               | '#'TYPE'.'MEMBER | '#'TYPE'<' (KEY '=' attr),* '>' | '^'INT (':open')?
               | 'dense<' type ':' ('[' scalar,* ']' | 'hex' STRING | 'sha256' STRING) '>'
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import re

import numpy as np

from fcir import attrs as A
from fcir.errors import ParseError
from fcir.ir import IR_VERSION, Func, Module, Op, Region, Value, check_structure, value_numbering
from fcir.types import SERVER, PlacedType, Structure, TensorType, Type

INLINE_LIMIT = 16
_DIGEST_CHARS = 16
_MAX_NESTING = 100  # types, attributes, structures and regions; deeper input is rejected
_INT64 = 1 << 63


# --- printing -------------------------------------------------------------------------------


def format_type(t: Type) -> str:
    return str(t)


def _format_float(x: float) -> str:
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return repr(float(x))


def format_attr(a, full_constants: bool = False) -> str:
    if a is None:
        return "none"
    if isinstance(a, bool):
        return "true" if a else "false"
    if isinstance(a, int):
        return str(a)
    if isinstance(a, float):
        return _format_float(a)
    if isinstance(a, str):
        return json.dumps(a)
    if isinstance(a, tuple):
        return "[" + ", ".join(format_attr(x, full_constants) for x in a) + "]"
    if isinstance(a, A.DType):
        return a.name
    if isinstance(a, A.Enum):
        return f"#{a.type_name}.{a.member}"
    if isinstance(a, A.Record):
        body = ", ".join(f"{k}={format_attr(v, full_constants)}" for k, v in a.fields)
        return f"#{a.type_name}<{body}>"
    if isinstance(a, A.RegionRef):
        return f"^{a.index}" + ("" if a.closed else ":open")
    if isinstance(a, A.Tensor):
        return _format_tensor(a, full_constants)
    raise TypeError(f"not an attribute: {a!r}")


def _format_tensor(t: A.Tensor, full: bool) -> str:
    head = f"dense<{TensorType(t.dtype, t.shape)}: "
    if t.data is None:
        return head + f'sha256"{t.digest[:_DIGEST_CHARS]}">'
    inline = t.size <= INLINE_LIMIT and not t.dtype.startswith(("key<", "c"))
    if inline:
        arr = t.numpy().reshape(-1)
        if t.dtype == "bool":
            vals = ["true" if v else "false" for v in arr]
        elif t.dtype[0] in "iu":  # also int4/uint4, which numpy does not call integer
            vals = [str(int(v)) for v in arr]
        else:
            vals = [_format_float(float(v)) for v in arr]
        if not t.shape:
            return head + vals[0] + ">"
        return head + "[" + ", ".join(vals) + "]>"
    if full:
        return head + f'hex"{t.data.hex()}">'
    return head + f'sha256"{t.digest[:_DIGEST_CHARS]}">'


def format_structure(s: Structure) -> str:
    if s.kind == "tuple" and len(s.children) == 1:
        return f"({format_structure(s.children[0])},)"
    if s.kind in ("leaf", "none", "tuple", "list"):
        if s.kind == "tuple":
            return "(" + ", ".join(format_structure(c) for c in s.children) + ")"
        if s.kind == "list":
            return "[" + ", ".join(format_structure(c) for c in s.children) + "]"
        return str(s)
    body = ", ".join(f"{json.dumps(n)}: {format_structure(c)}" for n, c in zip(s.names, s.children))
    if s.kind == "dict":
        return "{" + body + "}"
    return f"{s.kind} {json.dumps(s.type_name)} {{{body}}}"


class _Printer:
    def __init__(self, module: Module, full_constants: bool, locations: bool):
        self.module = module
        self.full = full_constants
        self.locations = locations
        self.lines: list[str] = []

    def name(self, v: Value) -> str:
        return f"%{self.names[v]}"

    def run(self) -> str:
        m = self.module
        places = ", ".join(f"{p}:{n}" for p, n in m.placements)
        self.lines.append(
            f"fcir.module @{m.name} ir_version={m.ir_version} placements=[{places}]"
            + (" private" if m.private else "")
        )
        for f in m.funcs:
            self.func(f)
        return "\n".join(self.lines) + "\n"

    def func(self, f: Func) -> None:
        self.names = value_numbering(f)
        params = ", ".join(f"{self.name(v)}: {v.type}" for v in f.body.params)
        results = ", ".join(str(v.type) for v in f.body.results)
        self.lines.append(f"func @{f.name}({params}) -> ({results}) {{")
        if f.arg_structure is not None:
            self.lines.append(f"  .args {format_structure(f.arg_structure)}")
        if f.result_structure is not None:
            self.lines.append(f"  .results {format_structure(f.result_structure)}")
        for op in f.body.ops:
            self.op(op, 1)
        self.lines.append("  return " + ", ".join(self.name(v) for v in f.body.results))
        self.lines.append("}")

    def op(self, op: Op, depth: int) -> None:
        ind = "  " * depth
        parts = []
        if op.results:
            parts.append(", ".join(f"{self.name(v)}: {v.type}" for v in op.results) + " =")
        parts.append(op.name)
        if op.operands:
            parts.append(", ".join(self.name(v) for v in op.operands))
        if op.attrs:
            body = ", ".join(
                f"{k}={format_attr(op.attrs[k], self.full)}" for k in sorted(op.attrs)
            )
            parts.append("{" + body + "}")
        if self.locations and op.location:
            parts.append(f"loc({json.dumps(op.location)})")
        line = ind + " ".join(parts)
        if not op.regions:
            self.lines.append(line)
            return
        self.lines.append(line + " {")
        for i, r in enumerate(op.regions):
            params = ", ".join(f"{self.name(v)}: {v.type}" for v in r.params)
            self.lines.append(f"{ind}  ^{r.label}({params}):")
            for sub in r.ops:
                self.op(sub, depth + 2)
            self.lines.append(f"{ind}    yield " + ", ".join(self.name(v) for v in r.results))
            self.lines.append(ind + ("}, {" if i + 1 < len(op.regions) else "}"))


@contextlib.contextmanager
def _gc_paused():
    """Pauses the cyclic garbage collector: printing and parsing make many objects and
    no cycles, and the collector's passes over them made large modules superlinear."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def print_module(module: Module, *, full_constants: bool = False, locations: bool = False) -> str:
    with _gc_paused():
        return _Printer(module, full_constants, locations).run()


# --- parsing --------------------------------------------------------------------------------

_TOKEN = re.compile(
    r"""
    (?P<ws>[ \t\r\n]+|//[^\n]*)
  | (?P<string>"(?:[^"\\\n]|\\.)*")
  | (?P<value>%\d+)
  | (?P<leaf>\$\d+)
  | (?P<region>\^\w+)
  | (?P<hash>\#[A-Za-z_][\w.]*)
  | (?P<sym>@[A-Za-z_][\w]*)
  | (?P<number>[-+]?(?:\d+\.\d*(?:[eE][-+]?\d+)?|\d+[eE][-+]?\d+|\d+|inf\b|nan\b))
  | (?P<key>key<\w+>)
  | (?P<directive>\.(?:args|results)\b)
  | (?P<ident>[A-Za-z_][\w.]*(?:-\w[\w.]*)*)
  | (?P<arrow>->)
  | (?P<punct>[{}()\[\]<>,:=!])
  | (?P<bad>.)
  """,
    re.VERBOSE,
)


# A token is a plain tuple (kind, text, offset): the tokenizer makes 100k+ of them.
_Tok = tuple


def _tokenize(text: str) -> list[_Tok]:
    toks = []
    append = toks.append
    for m in _TOKEN.finditer(text):
        kind = m.lastgroup
        if kind == "ws":
            continue
        if kind == "bad":
            line, col = _line_col(text, m.start())
            raise ParseError(f"line {line}, column {col}: unexpected character {m.group()!r}")
        append((kind, m.group(), m.start()))
    append(("eof", "", len(text)))
    return toks


def _line_col(text: str, pos: int) -> tuple[int, int]:
    line = text.count("\n", 0, pos) + 1
    return line, pos - (text.rfind("\n", 0, pos) + 1) + 1


class _Parser:
    def __init__(self, text: str):
        self.text = text
        self.toks = _tokenize(text)
        self.i = 0
        self.depth = 0

    def enter(self) -> None:
        """Counts one level of nesting; without a bound, deep input is a RecursionError."""
        self.depth += 1
        if self.depth > _MAX_NESTING:
            raise self.error(f"nested more than {_MAX_NESTING} levels deep")

    # -- token helpers --
    @property
    def tok(self) -> _Tok:
        return self.toks[self.i]

    def peek(self, k: int = 1) -> _Tok:
        return self.toks[min(self.i + k, len(self.toks) - 1)]

    def error(self, msg: str, tok: _Tok | None = None) -> ParseError:
        tok = tok or self.tok
        got = tok[1] or "end of input"
        line, col = _line_col(self.text, tok[2])
        return ParseError(f"line {line}, column {col}: {msg} (found {got!r})")

    def next(self) -> _Tok:
        t = self.tok
        if t[0] != "eof":
            self.i += 1
        return t

    def accept(self, text: str) -> bool:
        if self.tok[1] == text and self.tok[0] != "string":
            self.i += 1
            return True
        return False

    def expect(self, text: str) -> _Tok:
        if self.tok[1] != text or self.tok[0] == "string":
            raise self.error(f"expected {text!r}")
        return self.next()

    def expect_kind(self, kind: str, what: str) -> _Tok:
        if self.tok[0] != kind:
            raise self.error(f"expected {what}")
        return self.next()

    def integer(self) -> int:
        t = self.expect_kind("number", "an integer")
        if not re.fullmatch(r"[-+]?\d+", t[1]):
            raise self.error("expected an integer", t)
        return int(t[1])

    def identifier(self, kind: str, what: str) -> str:
        """A name token that must also be a Python identifier (as the protobuf reader
        requires), without its ``@`` sigil."""
        t = self.expect_kind(kind, what)
        name = t[1][1:] if kind == "sym" else t[1]
        if not name.isidentifier():
            raise self.error(f"expected {what} that is an identifier", t)
        return name

    # -- module --
    def module(self) -> Module:
        self.expect("fcir.module")
        name = self.identifier("sym", "@module_name")
        self.expect("ir_version")
        self.expect("=")
        version = self.integer()
        if version > IR_VERSION:
            from fcir.errors import VersionError

            raise VersionError(
                f"module @{name} has ir_version={version}; this fcir reads ir_version "
                f"<= {IR_VERSION}: upgrade fcir"
            )
        if version < 1:
            raise self.error("ir_version must be >= 1")
        self.expect("placements")
        self.expect("=")
        self.expect("[")
        placements = []
        while not self.accept("]"):
            if placements:
                self.expect(",")
            p = self.identifier("ident", "a placement name")
            self.expect(":")
            n = self.integer()
            if not 1 <= n < _INT64:
                raise self.error(f"cardinality of '{p}' must be positive (and < 2**63)")
            if p in dict(placements) or p == SERVER:
                raise self.error(f"placement name '{p}' is reserved or repeated")
            placements.append((p, n))
        self.placements = dict(placements)
        private = self.accept("private")
        funcs = []
        while self.tok[0] != "eof":
            tok = self.peek()
            funcs.append(self.func())
            if any(f.name == funcs[-1].name for f in funcs[:-1]):
                raise self.error(f"func @{funcs[-1].name} is defined twice", tok)
        if not funcs:
            raise self.error("expected a func")
        return Module(name, placements, funcs, version, private=private)

    def func(self) -> Func:
        self.expect("func")
        name = self.identifier("sym", "@func_name")
        self.env: dict[str, Value] = {}
        self.expect("(")
        params = self.params(")")
        self.expect("->")
        self.expect("(")
        result_types = []
        while not self.accept(")"):
            if result_types:
                self.expect(",")
            result_types.append(self.type())
        self.expect("{")
        arg_s = res_s = None
        while self.tok[1] in (".args", ".results"):
            which = self.next()[1]
            tok = self.tok
            s = self.structure()
            if which == ".args":
                arg_s = s
                count = len(params)
            else:
                res_s = s
                count = len(result_types)
            try:
                check_structure(s, count, f"func @{name} {which}")
            except ParseError as e:
                raise self.error(str(e), tok) from None
        ops = []
        while self.tok[1] != "return":
            if self.tok[0] == "eof":
                raise self.error("expected 'return'")
            ops.append(self.op())
        self.expect("return")
        results = self.uses()
        self.expect("}")
        if [v.type for v in results] != result_types:
            raise self.error(f"func @{name}: returned values do not match its result types")
        return Func(name, Region(params, ops, results, "main"), arg_s, res_s)

    def params(self, close: str) -> list[Value]:
        params = []
        while not self.accept(close):
            if params:
                self.expect(",")
            params.append(self.define())
        return params

    def define(self) -> Value:
        t = self.expect_kind("value", "a %value")
        if t[1] in self.env:
            raise self.error(f"value {t[1]} is defined twice", t)
        self.expect(":")
        v = Value(self.type())
        self.env[t[1]] = v
        return v

    def uses(self) -> list[Value]:
        vals = []
        if self.tok[0] != "value":
            return vals
        while True:
            t = self.expect_kind("value", "a %value")
            if t[1] not in self.env:
                raise self.error(f"value {t[1]} is used before it is defined", t)
            vals.append(self.env[t[1]])
            if not self.accept(","):
                return vals

    # -- types --
    def type(self) -> Type:
        if self.accept("{"):
            self.enter()
            member = self.type()
            self.depth -= 1
            self.expect("}")
            self.expect_kind("sym", "@placement")
            p = self.toks[self.i - 1][1][1:]
            if p == SERVER:
                raise self.error("a server value is written T@server, not {T}@server")
            self.check_placement(p)
            return PlacedType(member, p, False)
        t = self.tensor_type()
        if self.tok[0] == "sym":
            p = self.next()[1][1:]
            if p == SERVER:
                return PlacedType(t, SERVER, True)
            self.check_placement(p)
            self.expect("!")
            return PlacedType(t, p, True)
        return t

    def check_placement(self, p: str) -> None:
        if p != SERVER and p not in self.placements:
            raise self.error(f"placement '{p}' is not declared in the module header")

    def tensor_type(self) -> TensorType:
        t = self.next()
        if t[0] not in ("ident", "key"):
            raise self.error("expected a type such as f32[16,1]", t)
        from fcir.types import dtype_from_name

        try:
            dtype_from_name(t[1])
        except ParseError as e:
            raise self.error(str(e), t) from None
        self.expect("[")
        dims = []
        while not self.accept("]"):
            if dims:
                self.expect(",")
            d = self.integer()
            if not 0 <= d < _INT64:
                raise self.error("dimensions must be non-negative (and < 2**63)")
            dims.append(d)
        return TensorType(t[1], tuple(dims))

    # -- structures --
    def structure(self) -> Structure:
        t = self.tok
        if t[0] == "leaf":
            self.next()
            return Structure("leaf", leaf=int(t[1][1:]))
        if self.accept("none"):
            return Structure("none")
        self.enter()
        s = self.structure_node(t)
        self.depth -= 1
        return s

    def structure_node(self, t: _Tok) -> Structure:
        if self.accept("("):
            kids = []
            while not self.accept(")"):
                kids.append(self.structure())
                if not self.accept(","):
                    self.expect(")")
                    break
            return Structure("tuple", tuple(kids))
        if self.accept("["):
            kids = []
            while not self.accept("]"):
                if kids:
                    self.expect(",")
                kids.append(self.structure())
            return Structure("list", tuple(kids))
        kind, type_name = "dict", ""
        if t[1] in ("namedtuple", "custom"):
            kind = self.next()[1]
            type_name = self.string()
        self.expect("{")
        names, kids = [], []
        while not self.accept("}"):
            if names:
                self.expect(",")
            names.append(self.string())
            self.expect(":")
            kids.append(self.structure())
        return Structure(kind, tuple(kids), tuple(names), type_name)

    def string(self) -> str:
        t = self.expect_kind("string", "a string")
        try:
            s = json.loads(t[1])
            s.encode("utf-8")  # no lone surrogates ("\ud800"): the protobuf form is UTF-8
        except ValueError:  # also UnicodeEncodeError
            raise self.error("malformed string", t) from None
        return s

    # -- ops --
    def op(self) -> Op:
        results = []
        if self.tok[0] == "value":
            pending = []
            while True:
                t = self.expect_kind("value", "a %value")
                self.expect(":")
                pending.append((t, self.type()))
                if not self.accept(","):
                    break
            self.expect("=")
        else:
            pending = []
        name_tok = self.expect_kind("ident", "an op name")
        if "." not in name_tok[1]:
            raise self.error("op names are namespaced, e.g. fed.map or jax.add", name_tok)
        operands = self.uses()
        attrs = {}
        if self.tok[1] == "{" and self.peek()[0] != "region":
            self.next()
            while not self.accept("}"):
                if attrs:
                    self.expect(",")
                key = self.identifier("ident", "an attribute name")
                if key in attrs:
                    raise self.error(f"attribute {key} repeated")
                self.expect("=")
                attrs[key] = self.attr()
        location = ""
        if self.tok[1] == "loc" and self.peek()[1] == "(":
            self.next()
            self.next()
            location = self.string()
            self.expect(")")
        # Results are defined after the op's operands are read but before its regions,
        # matching the printer's numbering (regions may not use them anyway).
        for t, ty in pending:
            if t[1] in self.env:
                raise self.error(f"value {t[1]} is defined twice", t)
            v = Value(ty)
            self.env[t[1]] = v
            results.append(v)
        regions = []
        if self.tok[1] == "{" and self.peek()[0] == "region":
            while True:
                self.expect("{")
                self.enter()
                regions.append(self.region())
                self.depth -= 1
                self.expect("}")
                if not (self.tok[1] == "," and self.peek()[1] == "{"):
                    break
                self.next()
        return Op(name_tok[1], operands, results, attrs, regions, location)

    def region(self) -> Region:
        label = self.expect_kind("region", "^label")[1][1:]
        self.expect("(")
        params = self.params(")")
        self.expect(":")
        ops = []
        while self.tok[1] != "yield":
            if self.tok[0] == "eof":
                raise self.error("expected 'yield'")
            ops.append(self.op())
        self.expect("yield")
        return Region(params, ops, self.uses(), label)

    # -- attributes --
    def attr(self):
        t = self.tok
        if t[0] == "number":
            self.next()
            if re.fullmatch(r"[-+]?\d+", t[1]):
                v = int(t[1])
                if not -_INT64 <= v < _INT64:
                    raise self.error("integer attributes must fit in 64 bits", t)
                return v
            return float(t[1])
        if t[0] == "string":
            return self.string()
        if t[0] == "region":
            self.next()
            if not t[1][1:].isdigit() or int(t[1][1:]) >= 1 << 32:
                raise self.error("expected a region reference ^N", t)
            closed = True
            if self.tok[1] == ":" and self.peek()[1] == "open":
                self.next()
                self.next()
                closed = False
            return A.RegionRef(int(t[1][1:]), closed)
        if self.accept("["):
            self.enter()
            items = []
            while not self.accept("]"):
                if items:
                    self.expect(",")
                items.append(self.attr())
            self.depth -= 1
            return tuple(items)
        if t[0] == "hash":
            self.next()
            name = t[1][1:]
            if self.accept("<"):
                self.enter()
                fields = []
                while not self.accept(">"):
                    if fields:
                        self.expect(",")
                    k = self.identifier("ident", "a field name")
                    self.expect("=")
                    fields.append((k, self.attr()))
                self.depth -= 1
                return A.Record(name, tuple(fields))
            type_name, dot, member = name.rpartition(".")
            if not dot:
                raise self.error("expected #Type.MEMBER or #Type<...>", t)
            return A.Enum(type_name, member)
        if t[0] == "ident" and t[1] == "dense" and self.peek()[1] == "<":
            return self.dense()
        if t[0] in ("ident", "key"):
            self.next()
            if t[1] == "true":
                return True
            if t[1] == "false":
                return False
            if t[1] == "none":
                return None
            from fcir.types import dtype_from_name

            try:
                dtype_from_name(t[1])
            except ParseError:
                raise self.error("expected an attribute value", t) from None
            return A.DType(t[1])
        raise self.error("expected an attribute value")

    def dense(self) -> A.Tensor:
        self.next()
        self.expect("<")
        tt = self.tensor_type()
        self.expect(":")
        size = math.prod(tt.shape)
        bare_scalar = not tt.shape and self.tok[0] == "number" or self.tok[1] in (
            "true", "false")
        if bare_scalar or self.accept("["):
            vals = []
            while not bare_scalar and not self.accept("]"):
                if vals:
                    self.expect(",")
                vals.append(self.scalar())
            if bare_scalar:
                vals.append(self.scalar())
            if len(vals) != size:
                raise self.error(f"dense<{tt}> needs {size} values, got {len(vals)}")
            from fcir.types import dtype_from_name

            dt = dtype_from_name(tt.dtype)
            if tt.dtype.startswith(("key<", "c")):
                raise self.error("key and complex constants are written as hex")
            floating = tt.dtype[0] not in "iu"
            if tt.dtype == "bool":
                ok = all(isinstance(v, bool) for v in vals)
            else:
                kinds = (int, float) if floating else int
                ok = all(isinstance(v, kinds) and not isinstance(v, bool) for v in vals)
            if not ok:
                raise self.error(f"dense<{tt}> values must be {tt.dtype} literals")
            try:
                with np.errstate(over="ignore"):  # 1e300 in f16 is inf, as in numpy
                    arr = np.array(vals, dtype=np.float64 if floating else object).astype(dt)
            except (OverflowError, ValueError, TypeError) as e:
                raise self.error(f"values do not fit {tt.dtype}: {e}") from None
            tensor = A.Tensor(tt.dtype, tt.shape, np.ascontiguousarray(arr).tobytes())
        else:
            kind = self.expect_kind("ident", "hex or sha256")[1]
            payload = self.string()
            if kind == "hex":
                try:
                    data = bytes.fromhex(payload)
                except ValueError:
                    raise self.error("malformed hex constant") from None
                tensor = A.Tensor(tt.dtype, tt.shape, data)
                try:
                    tensor.numpy()
                except ParseError as e:
                    raise self.error(str(e)) from None
            elif kind == "sha256":
                if not re.fullmatch(r"[0-9a-f]{1,64}", payload):
                    raise self.error("malformed sha256 prefix")
                tensor = A.Tensor(tt.dtype, tt.shape, None, payload)
            else:
                raise self.error("expected hex or sha256")
        self.expect(">")
        return tensor

    def scalar(self):
        t = self.next()
        if t[0] == "number":
            if re.fullmatch(r"[-+]?\d+", t[1]):
                return int(t[1])
            return float(t[1])
        if t[1] in ("true", "false"):
            return t[1] == "true"
        if t[1] in ("-inf",):
            return -math.inf
        raise self.error("expected a number", t)


def parse(text: str) -> Module:
    """Canonical text -> Module. Raises ParseError (or VersionError) with line/column."""
    if not isinstance(text, str):
        raise ParseError(f"fcir.parse expects text (str), got {type(text).__name__}")
    with _gc_paused():
        return _Parser(text).module()
