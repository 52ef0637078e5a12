"""The parser's one-line fast path (fcir.ir.text._FAST_OP) is invisible: on every golden,
on op lines split or joined in ways the canonical printer never writes, and on randomly
edited text, parsing with it gives the same module text, or the same error, as the token
parser alone. The goldens must also mostly take the fast path, or it buys nothing.
"""

from __future__ import annotations

import pathlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fcir
from fcir import gcpause
from fcir.errors import FcirError
from fcir.ir import text as fcir_text

GOLDEN_DIR = pathlib.Path(__file__).parents[1] / "golden"
GOLDENS = sorted(p.stem for p in GOLDEN_DIR.glob("*.fcir"))


def outcome(text: str, fast: bool) -> str:
    """The full text of the parsed module, or the error's type and message."""
    try:
        with gcpause.tenured():
            module = fcir_text._Parser(text, fast=fast).module()
    except FcirError as e:
        return f"{type(e).__name__}: {e}"
    return module.to_text(full_constants=True)


def assert_same(text: str) -> str:
    fast, slow = outcome(text, True), outcome(text, False)
    assert fast == slow, text
    return fast


class CountingParser(fcir_text._Parser):
    def __init__(self, text: str):
        super().__init__(text)
        self.fast_ops = 0

    def fast_op(self):
        op = super().fast_op()
        self.fast_ops += op is not None
        return op


@pytest.mark.parametrize("name", GOLDENS)
def test_goldens_parse_the_same_with_and_without_the_fast_path(name):
    text = (GOLDEN_DIR / f"{name}.fcir").read_text()
    assert assert_same(text) == fcir.parse(text).to_text(full_constants=True)
    parser = CountingParser(text)
    assert parser.module().to_text() == text
    op_lines = sum(1 for line in text.splitlines() if " = " in line or "fed." in line)
    assert parser.fast_ops >= 0.5 * op_lines, (parser.fast_ops, op_lines)


HEADER = "fcir.module @m ir_version=1 placements=[clients:2]\n"
HEAD = HEADER + "func @main(%0: f32[2]@server) -> (f32[2]@server) {\n"
RET = "  return %0\n}\n"

# Each is one op written in a way the printer never uses; the fast pattern must either
# read the op exactly as the token parser does or leave it to it.
SPLIT = {
    "attributes on the next line": "  %1: f32[2]@server = jax.neg %0\n  {x=1}\n",
    "operand on the next line": "  %1: f32[2]@server = jax.add %0\n  , %0\n",
    "next line's value read as an operand": "  %1: f32[2]@server = jax.iota\n  %2: f32[2]@server = jax.neg %0\n",
    "no operands then an op": "  %1: f32[2]@server = jax.iota\n  %2: f32[2]@server = jax.neg %1\n",
    "no operands, attributes then a value": "  %1: f32[2]@server = jax.iota {a=1}\n  %2: f32[2]@server = jax.neg %1\n",
    "location on the next line": '  %1: f32[2]@server = jax.neg %0\n  loc("x.py:1")\n',
    "location spaced": '  %1: f32[2]@server = jax.neg %0 loc ("x.py:1")\n',
    "op named loc.x": "  %1: f32[2]@server = jax.neg %0\n  %2: f32[2]@server = loc.x %1\n",
    "region on the next line": "  %1: f32[2]@server = jax.r %0 {a=^0}\n  {\n ^r0(%2: f32[2]):\n yield %2\n }\n",
    "comment after the op": "  %1: f32[2]@server = jax.neg %0 // note\n",
    "comment line": "  %1: f32[2]@server = jax.neg %0\n// note\n  %2: f32[2]@server = jax.neg %1\n",
    "carriage returns": "  %1: f32[2]@server = jax.neg %0\r\n  %2: f32[2]@server = jax.neg %1\r\n",
    "tabs": "\t%1: f32[2]@server = jax.neg %0 \t\n",
    "no space after the comma": "  %1: f32[2]@server = jax.add %0,%0\n",
    "one op on two lines at the equals": "  %1: f32[2]@server =\n jax.neg %0\n",
    "two ops on one line": "  %1: f32[2]@server = jax.neg %0 %2: f32[2]@server = jax.neg %1\n",
    "result defined twice in one op": "  %1: f32[2]@server, %1: f32[2]@server = jax.two %0\n",
    "result redefined": "  %1: f32[2]@server = jax.neg %0\n  %1: f32[2]@server = jax.neg %0\n",
    "result used as its own operand": "  %1: f32[2]@server = jax.neg %1\n",
    "bad type, then the same type": "  %1: f32[2]@nowhere! = jax.neg %0\n  %2: f32[2]@nowhere! = jax.neg %0\n",
    "unknown dtype twice": "  %1: q8[2] = jax.neg %0\n  %2: q8[2] = jax.neg %0\n",
    "bad attribute, then the same": "  %1: f32[2]@server = jax.neg %0 {a=1;}\n  %2: f32[2]@server = jax.neg %0 {a=1;}\n",
    "repeated attribute": "  %1: f32[2]@server = jax.neg %0 {a=1, a=1}\n",
    "attribute with braces in a string": '  %1: f32[2]@server = jax.neg %0 {a="}{", b=2}\n',
    "empty attributes": "  %1: f32[2]@server = jax.neg %0 {}\n",
    "op name without a dot": "  %1: f32[2]@server = neg %0\n",
    "op name with a dash": "  %1: f32[2]@server = jax.a-b %0\n",
    "placed type without the bang": "  %1: f32[2]@clients = jax.neg %0\n",
    "huge dimension": "  %1: f32[99999999999999999999]@server = jax.neg %0\n",
    "inf as a dtype": "  %1: inf[2]@server = jax.neg %0\n",
}


@pytest.mark.parametrize("name", sorted(SPLIT))
def test_unusual_layouts_parse_as_the_token_parser_reads_them(name):
    assert_same(HEAD + SPLIT[name] + RET)


@pytest.mark.parametrize("brackets", [3, 7])
def test_deeply_nested_regions_keep_the_nesting_limit(brackets):
    # A placed type and a nested list inside 95 nested regions: the fast path must not
    # accept a type or attribute that the token parser would reject at that depth.
    depth = fcir_text._MAX_NESTING - 5
    body = "".join(
        f"  %{1000 + k}: f32[2]@server = jax.a %0 {{\n ^r(%{2000 + k}: f32[2]):\n"
        for k in range(depth)
    )
    attr = "[" * brackets + "1" + "]" * brackets
    inner = f"  %3000: {{f32[2]}}@clients = jax.x %0 {{a={attr}}}\n"
    tail = "".join(f" yield %{2000 + k}\n }}\n" for k in reversed(range(depth)))
    out = assert_same(HEAD + body + inner + tail + RET)
    assert ("nested more than" in out) == (depth + 1 + brackets > fcir_text._MAX_NESTING)


EDITS = ["\n", " ", "\n  ", "", "\r\n", "//c\n", "{", "}", ",", "%1", "%9", "=", ":", "!",
         "@clients", "loc", "(", '"', "[", "]", "^0", "jax.x", "\t"]


@st.composite
def edited_golden(draw):
    name = draw(st.sampled_from(["fedavg_mlp", "int_mean", "secure_histogram", "minmax_agg"]))
    text = (GOLDEN_DIR / f"{name}.fcir").read_text()
    for _ in range(draw(st.integers(1, 3))):
        i = draw(st.integers(0, len(text)))
        cut = draw(st.integers(0, 3))
        text = text[:i] + draw(st.sampled_from(EDITS)) + text[i + cut :]
    return text


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(edited_golden())
def test_edited_text_parses_the_same_with_and_without_the_fast_path(text):
    assert_same(text)
