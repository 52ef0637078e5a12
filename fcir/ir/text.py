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

import json
import math
import re

import numpy as np

from fcir import gcpause
from fcir.errors import ParseError, VersionError
from fcir.ir import attrs as A
from fcir.ir.nodes import (
    CODECS,
    IR_VERSION,
    Func,
    Module,
    Op,
    Region,
    Value,
    check_names,
    check_structure,
    is_name,
    value_numbering,
    walk,
)
from fcir.ir.types import SERVER, PlacedType, Structure, TensorType, Type, dtype_from_name

INLINE_LIMIT = 16
_DIGEST_CHARS = 16
_MAX_NESTING = 100  # types, attributes, structures and regions; deeper input is rejected
_INT64 = 1 << 63
_MAX_INT_DIGITS = 40  # a 64-bit integer has at most 20 digits; leave room for leading zeros


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
        check_names(m)
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


def print_module(module: Module, *, full_constants: bool = False, locations: bool = False) -> str:
    with gcpause.paused():
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


# A token is a plain tuple (kind, text, offset).
_Tok = tuple

# The fast path: one match reads a whole op line of the canonical shape,
#   %7: f32[8], %8: {f32[8]}@clients = jax.add %5, %6 {key=value, ...}
# with no regions, no location and no comment. Its types and attribute dicts repeat a lot,
# so each distinct one is parsed once, by the token parser (so errors and corner cases are
# the token parser's), and looked up afterwards. Anything the pattern does not cover, or
# that looks wrong, falls back to the token parser, which then reports the error.
_FAST_TYPE = r"\{?(?:key<\w+>|[A-Za-z_]\w*)\[[0-9,]*\]\}?(?:@[A-Za-z_]\w*!?)?"
_FAST_RESULT = re.compile(rf"(%\d+): ({_FAST_TYPE})")
_FAST_OP = re.compile(
    # Possessive quantifiers (*+, ++): a line that does not match fails without
    # backtracking, and runs of plain characters are taken in one step.
    r"[ \t\r\n]*+"
    # groups: 1 first result, 2 its type, 3 more results, 4 op name, 5 operands, 6 attrs
    rf"(?:(%\d+): ({_FAST_TYPE})((?:, %\d+: {_FAST_TYPE})*+) = )?"
    r"([A-Za-z_][\w.]*+(?:-\w[\w.]*+)*+)"
    r"(?: (%\d+(?:, %\d+)*+))?"
    r'(?: (\{[A-Za-z_](?:[^{}"\n]++|"(?:[^"\\\n]++|\\.)*+")*+\}))?'
    # The op ends at the line's end, and what follows starts the next op (or return,
    # yield): not a region, attribute dict or location continuing it on the next line.
    r"[ \t\r]*+\n[ \t\r\n]*+(?=%|[A-Za-z_])(?!loc[ \t\r\n]*\()"
)
# Cached types and attribute dicts were read with this many nesting levels to spare, so
# the fast path runs only where that many are left under _MAX_NESTING.
_FAST_NESTING = 10
_CACHE_LIMIT = 1000  # longer attribute dicts (big hex constants) are not kept as keys
_MISS = object()  # cached: the token parser rejected this text, so always fall back


def _line_col(text: str, pos: int) -> tuple[int, int]:
    line = text.count("\n", 0, pos) + 1
    return line, pos - (text.rfind("\n", 0, pos) + 1) + 1


class _Parser:
    def __init__(self, text: str, fast: bool = True):
        self.text = text
        # Tokens are read a line at a time, on demand: the fast path reads most lines
        # straight from the text and never tokenizes them.
        self.toks: list[_Tok] = []
        self.i = 0  # index of the current token in toks
        self.pos = 0  # text offset where the next line to tokenize starts
        self.depth = 0
        self.fast = fast
        self.types: dict[str, object] = {}  # type text -> Type, or _MISS
        self.attr_dicts: dict[str, object] = {}  # '{k=v, ...}' -> dict, or _MISS
        self.lines: dict[int, int] | None = None  # id(op) -> line of its name (parse_located)

    def enter(self) -> None:
        """Counts one level of nesting; without a bound, deep input is a RecursionError."""
        self.depth += 1
        if self.depth > _MAX_NESTING:
            raise self.error(f"nested more than {_MAX_NESTING} levels deep")

    # -- token helpers --
    def lex_line(self) -> None:
        """Appends the tokens of the next line that has any (or the eof token).

        No token spans a newline (strings and comments stop at one), so lines can be
        tokenized one by one, starting from any token's start."""
        toks, text = self.toks, self.text
        n = len(toks)
        while len(toks) == n:
            pos = self.pos
            if pos >= len(text):
                toks.append(("eof", "", len(text)))
                return
            end = text.find("\n", pos) + 1 or len(text)
            for m in _TOKEN.finditer(text, pos, end):
                kind = m.lastgroup
                if kind == "ws":
                    continue
                if kind == "bad":
                    line, col = _line_col(text, m.start())
                    raise ParseError(
                        f"line {line}, column {col}: unexpected character {m.group()!r}"
                    )
                toks.append((kind, m.group(), m.start()))
            self.pos = end

    @property
    def tok(self) -> _Tok:
        if self.i == len(self.toks):
            self.lex_line()
        return self.toks[self.i]

    def peek(self, k: int = 1) -> _Tok:
        toks = self.toks
        while self.i + k >= len(toks) and (not toks or toks[-1][0] != "eof"):
            self.lex_line()
        return toks[min(self.i + k, len(toks) - 1)]

    def error(self, msg: str, tok: _Tok | None = None) -> ParseError:
        tok = tok or self.tok
        got = tok[1] or "end of input"
        if len(got) > 60:  # a 5000-digit number or a long string: its start says enough
            got = got[:57] + "..."
        line, col = _line_col(self.text, tok[2])
        return ParseError(f"line {line}, column {col}: {msg} (found {got!r})")

    def next(self) -> _Tok:
        t = self.tok
        if t[0] != "eof":
            self.i += 1
        return t

    def accept(self, text: str) -> bool:
        t = self.tok
        if t[1] == text and t[0] != "string":
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
        return self.to_int(t[1], t)

    def to_int(self, text: str, tok: _Tok) -> int:
        """``int(text)`` for a run of digits, refusing more than any 64-bit value has:
        Python itself refuses strings of over 4300 digits with a ValueError."""
        digits = text.lstrip("+-")
        if len(digits) > _MAX_INT_DIGITS or not digits.isdecimal():
            raise self.error("integer out of range (every integer in the IR fits 64 bits)", tok)
        return int(text)

    def identifier(self, kind: str, what: str, ir_name: bool = False) -> str:
        """A name token that must also be a Python identifier (as the protobuf reader
        requires), without its ``@`` sigil; module, func and placement names
        (``ir_name``) must be ASCII identifiers (``fcir.ir.is_name``). ``inf`` and
        ``nan`` lex as numbers (a float attribute's value); where a name is expected they
        are names (a placement may be called ``nan``)."""
        t = self.tok
        if kind == "ident" and t[0] == "number" and t[1] in ("inf", "nan"):
            t = ("ident", t[1], t[2])
            self.next()
        else:
            t = self.expect_kind(kind, what)
        name = t[1][1:] if kind == "sym" else t[1]
        if not (is_name(name) if ir_name else name.isidentifier()):
            raise self.error(
                f"expected {what} that is {'an ASCII' if ir_name else 'an'} identifier", t
            )
        return name

    # -- module --
    def module(self) -> Module:
        self.expect("fcir.module")
        name = self.identifier("sym", "@module_name", ir_name=True)
        self.expect("ir_version")
        self.expect("=")
        version = self.integer()
        if version > IR_VERSION:

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
            p = self.identifier("ident", "a placement name", ir_name=True)
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
        if not any(f.name == "main" for f in funcs):  # as a serialized module must
            raise self.error(f"module @{name} has no func @main")
        return Module(name, placements, funcs, version, private=private)

    def func(self) -> Func:
        self.expect("func")
        name = self.identifier("sym", "@func_name", ir_name=True)
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
        ops = self.ops("return")
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
            return Structure("leaf", leaf=self.to_int(t[1][1:], t))
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
    def ops(self, end: str) -> list[Op]:
        """The ops of a func or region body, up to its ``end`` keyword."""
        ops = []
        fast = self.fast_op
        while True:
            op = fast()
            if op is None:
                t = self.tok
                if t[1] == end:
                    return ops
                if t[0] == "eof":
                    raise self.error(f"expected {end!r}")
                op = self.op()
            ops.append(op)

    def fast_op(self) -> Op | None:
        """The op at the current token if it has the canonical one-line shape and is
        well formed (see _FAST_OP), else None, having consumed nothing."""
        if not self.fast or self.depth > _MAX_NESTING - _FAST_NESTING:
            return None
        text, toks, env = self.text, self.toks, self.env
        m = _FAST_OP.match(text, toks[self.i][2] if self.i < len(toks) else self.pos)
        if m is None:
            return None
        first, first_type, more, name, args, attrs = m.groups()
        if "." not in name:
            return None
        if first is not None:
            types = self.types
            if not more:  # the common case: one result
                pending = ((first, types.get(first_type) or self.learn_types(m, first_type)),)
            else:
                pending = [
                    (n, types.get(t) or self.learn_types(m, t))
                    for n, t in _FAST_RESULT.findall(text, m.start(1), m.end(3))
                ]
                if len({n for n, _ in pending}) < len(pending):
                    return None
            for n, t in pending:
                if t is _MISS or n in env:
                    return None
        if args is not None:
            try:
                operands = [env[a] for a in args.split(", ")]
            except KeyError:
                return None
        elif attrs is None and text[m.end()] == "%":
            return None  # the next line's %N would be read as this op's operand
        else:
            operands = []
        if attrs is not None:
            cached = self.attr_dicts.get(attrs)
            if cached is None:
                cached = self.sub_parse(m.start(6), m.end(6), self.attr_dict)
                if len(attrs) <= _CACHE_LIMIT:
                    self.attr_dicts[attrs] = cached
            if cached is _MISS:
                return None
            attrs = dict(cached)  # the values are immutable and shared; the dict is not
        else:
            attrs = {}
        results = []
        if first is not None:
            for n, t in pending:
                v = env[n] = Value(t)
                results.append(v)
        self.toks, self.i, self.pos = [], 0, m.end()
        op = Op(name, operands, results, attrs, [], "")
        if self.lines is not None:
            self.lines[id(op)] = _line_col(text, m.start(4))[0]
        return op

    def learn_types(self, m: re.Match, type_text: str):
        """Parses and caches ``type_text``, a result type of the op line ``m``."""
        for r in _FAST_RESULT.finditer(self.text, m.start(1), m.end(3)):
            if r.group(2) == type_text:
                t = self.types[type_text] = self.sub_parse(r.start(2), r.end(2), self.type)
                return t
        raise AssertionError("unreachable: the type is on the line")

    def sub_parse(self, start: int, end: int, parse):
        """``parse()`` run by the token parser on text[start:end], with _FAST_NESTING
        levels of nesting allowed; _MISS if it fails or reads a different extent. The
        parser's position is left as it was."""
        saved = self.toks, self.i, self.pos, self.depth
        self.toks, self.i, self.pos = [], 0, start
        self.depth = _MAX_NESTING - _FAST_NESTING
        try:
            value = parse()
            last = self.toks[self.i - 1]
            if last[2] + len(last[1]) != end:
                value = _MISS
        except Exception:  # noqa: BLE001  (the token parser will report it in context)
            value = _MISS
        finally:
            self.toks, self.i, self.pos, self.depth = saved
        return value

    def attr_dict(self) -> dict:
        self.expect("{")
        attrs = {}
        while not self.accept("}"):
            if attrs:
                self.expect(",")
            key = self.identifier("ident", "an attribute name")
            if key in attrs:
                raise self.error(f"attribute {key} repeated")
            self.expect("=")
            attrs[key] = self.attr()
        return attrs

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
        # An op without operands may be followed by the next op's "%N: type =": newlines
        # are plain whitespace, so a value followed by ':' is a definition, not an operand.
        no_operands = self.tok[0] == "value" and self.peek()[1] == ":"
        operands = [] if no_operands else self.uses()
        attrs = {}
        if self.tok[1] == "{" and self.peek()[0] != "region":
            attrs = self.attr_dict()
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
        op = Op(name_tok[1], operands, results, attrs, regions, location)
        if self.lines is not None:
            self.lines[id(op)] = _line_col(self.text, name_tok[2])[0]
        return op

    def region(self) -> Region:
        label = self.expect_kind("region", "^label")[1][1:]
        self.expect("(")
        params = self.params(")")
        self.expect(":")
        ops = self.ops("yield")
        self.expect("yield")
        return Region(params, ops, self.uses(), label)

    # -- attributes --
    def attr(self):
        t = self.tok
        if t[0] == "number":
            self.next()
            if re.fullmatch(r"[-+]?\d+", t[1]):
                v = self.to_int(t[1], t)
                if not -_INT64 <= v < _INT64:
                    raise self.error("integer attributes must fit in 64 bits", t)
                return v
            return float(t[1])
        if t[0] == "string":
            return self.string()
        if t[0] == "region":
            self.next()
            if not (t[1][1:].isascii() and t[1][1:].isdigit()) or self.to_int(
                t[1][1:], t
            ) >= 1 << 32:
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
                return self.to_int(t[1], t)
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
    with gcpause.tenured():
        return _Parser(text).module()


CODECS["print"] = print_module  # Module.to_text
def parse_located(text: str, filename: str) -> Module:
    """``parse``, with each op's location set to ``filename:line`` of its line in
    ``text`` (after the location the text gives it, if any): the checker's messages for a
    hand-edited IR file then name the line to fix (``fcir check r.fcir``)."""
    if not isinstance(text, str):
        raise ParseError(f"fcir.parse expects text (str), got {type(text).__name__}")
    parser = _Parser(text)
    parser.lines = {}
    with gcpause.tenured():
        module = parser.module()
    for func in module.funcs:
        for _, op in walk(func.body):
            line = parser.lines.get(id(op))
            if line is not None:
                here = f"{filename}:{line}"
                op.location = f"{here} (captured at {op.location})" if op.location else here
    return module
