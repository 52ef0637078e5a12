"""Names and numbers in IR text: module, func and placement names are ASCII identifiers
everywhere (capture, text, protobuf); hostile integers and tokens in text are
ParseErrors; a bad scan length is an FcirError in every reader of the module."""

from __future__ import annotations

import re

import jax.numpy as jnp
import pytest
from hostile_ir import FUZZ, SUM
from hypothesis import example, given
from hypothesis import strategies as st

import fcir
from fcir import cli
from fcir._proto import module_pb2 as pb
from fcir.checker.check import verify
from fcir.errors import FcirError, IRTypeError, ParseError, PlacementError
from fcir.frontend.capture import _name_of
from fcir.ir import is_name
from fcir.report import dot, traffic

# --- shared ------------------------------------------------------------------------------


def _round_trips(m: fcir.Module) -> None:
    text = m.to_text()
    assert fcir.parse(text).to_text() == text
    assert fcir.Module.deserialize(m.serialize()).to_text() == text


@fcir.program(placements={"clients": 3})
def _inner(v):
    return fcir.reduce_sum(fcir.broadcast(v))


@fcir.program(placements={"clients": 3})
def _same(x):
    return _inner(fcir.reduce_mean(x))


# --- names print and parse -----------------------------------------------------


def test_module_names_that_would_not_parse_are_refused_at_capture():
    x = jnp.ones((3, 4))
    for name in ["my round", "héllo", "x\nfcir.module @y ir_version=1 placements=[clients:5]"]:
        with pytest.raises(IRTypeError, match="ASCII identifier"):
            fcir.capture(_same, x[:, :2], name=name)


def test_a_function_name_is_made_a_name():
    def médian_round(x):
        return fcir.reduce_mean(x)

    m = fcir.capture(fcir.program(placements={"clients": 3})(médian_round), jnp.ones((3, 2)))
    assert m.name == "m_dian_round"
    _round_trips(m)


def test_newline_in_a_name_cannot_inject_placements():
    m = fcir.parse(SUM)
    m.name = "x ir_version=1 placements=[clients:5]\nfunc"
    with pytest.raises(IRTypeError, match="module name"):
        m.to_text()
    with pytest.raises(IRTypeError, match="module name"):
        m.serialize()
    assert [d.code for d in verify(m)] == ["module/C5"]


def test_non_ascii_names_are_parse_errors_in_text_and_protobuf():
    with pytest.raises(ParseError, match="ASCII identifier"):
        fcir.parse(SUM.replace("@p ", "@pé "))
    with pytest.raises(ParseError, match="ASCII identifier"):
        fcir.parse(SUM.replace("clients", "clientsé"))
    msg = pb.Module()
    msg.ParseFromString(fcir.parse(SUM).serialize())
    msg.name = "pé"
    with pytest.raises(ParseError, match="not an identifier"):
        fcir.Module.deserialize(msg.SerializeToString())


@FUZZ
@given(st.text(max_size=12))
def test_any_module_name_round_trips_or_is_refused(name):
    m = fcir.parse(SUM)
    m.name = name
    if is_name(name):
        _round_trips(m)
        assert fcir.parse(m.to_text()).name == name
        assert fcir.Module.deserialize(m.serialize()).name == name
    else:
        with pytest.raises(IRTypeError):
            m.to_text()
        with pytest.raises(IRTypeError):
            m.serialize()
        assert "module/C5" in [d.code for d in verify(m)]


@FUZZ
@given(st.text(max_size=12))
@example("nan")  # lexed as numbers elsewhere (a float attribute's value)
@example("inf")
def test_any_placement_name_round_trips_or_is_refused(name):
    try:
        fcir.program(placements={name: 2})
    except PlacementError:
        assert not is_name(name) or name == "server"
        return
    text = SUM.replace("clients", name)
    assert fcir.parse(text).to_text() == fcir.parse(fcir.parse(text).to_text()).to_text()


@FUZZ
@given(st.text(max_size=12))
def test_any_function_name_becomes_a_name(name):
    def f():
        pass

    f.__name__ = name
    assert is_name(_name_of(f))


# --- hostile integers in text are ParseErrors ---------------------------------

BIG = "9" * 5000


@pytest.mark.parametrize(
    "old,new",
    [
        ("axes=[0]", f"axes=[{BIG}]"),
        ("out_sharding=none", f"out_sharding={BIG}"),
        ("clients:3", f"clients:{BIG}"),
        ("f32[4]}", f"f32[{BIG}]}}"),
        ("out_sharding=none", f"out_sharding=dense<i64[]: {BIG}>"),
        ("out_sharding=none", "out_sharding=^²"),
        ("ir_version=1", f"ir_version={BIG}"),
        ("-> (f32[]@server) {", "-> (f32[]@server) {\n  .args ($" + BIG + ",)"),
    ],
    ids=["list", "attribute", "cardinality", "dimension", "dense", "region_ref", "version",
         "leaf"],
)
def test_hostile_integer_is_a_parse_error(old, new):
    assert old in SUM
    with pytest.raises(ParseError) as info:
        fcir.parse(SUM.replace(old, new, 1))
    assert len(str(info.value)) < 300  # the 5000 digits are not echoed back


_HOSTILE = [BIG, "^²", "^٣", "$٣", "$" + BIG, "%" + BIG, "@héllo", "héllo", "f32[99999999999]",
            "1" + "0" * 400, "1e-400", "+5", "-0", "dense<i8[]: 300>", "dense<bool[1]: [2]>",
            "\u2028", "\x00", "\ufeff", "[", "]", "{", "}", ",", "=", ":", "none", "^0",
            "1e309", "-1e309", "1e3", "2.5", "-0.0", "1e-400"]
_SUM_TOKENS = re.findall(r"\s+|[%$^#@]?[\w.<>-]+|.", SUM, re.DOTALL)


@FUZZ
@given(st.lists(st.tuples(st.integers(0, len(_SUM_TOKENS)), st.sampled_from(_HOSTILE)),
                min_size=1, max_size=3), st.booleans())
def test_text_with_hostile_tokens_raises_only_fcir_errors(edits, replace):
    tokens = list(_SUM_TOKENS)
    for i, tok in edits:
        if replace and i < len(tokens):
            tokens[i] = tok
        else:
            tokens.insert(i, tok)
    try:
        m = fcir.parse("".join(tokens))
    except FcirError:
        return
    try:
        fcir.check(m)
    except FcirError:
        return
    _round_trips(m)


# Control flow holds integer attributes (counts, lengths) that the checker and the
# interpreters read as ints: a float-ish token there (1e309 parses as inf) must be an
# FcirError, not an OverflowError or ValueError from int(inf).
FLOW = """\
fcir.module @p ir_version=1 placements=[clients:2]
func @main(%0: f32[3]@server, %1: {f32[3]}@clients, %2: i32[]@server) -> (f32[3]@server) {
  %3: f32[3]@server = jax.scan %1, %0 {jaxpr=^0, length=2, num_carry=1, num_consts=1, reverse=false, unroll=1} {
    ^r0(%4: {f32[3]}@clients, %5: f32[3]@server):
      %6: f32[3]@clients! = fed.broadcast %5 {to="clients"}
      %7: {f32[3]}@clients = fed.map %6, %4 {
        ^member(%8: f32[3], %9: f32[3]):
          %10: f32[3] = jax.sub %9, %8
          yield %10
      }
      %11: f32[3]@server = fed.mean %7
      yield %11
  }
  %12: i32[]@server = fcir.constant {value=dense<i32[]: 0>}
  %13: i32[]@server, %14: i32[]@server, %15: f32[3]@server = jax.while %12, %2, %3 {body_jaxpr=^0, body_nconsts=0, cond_jaxpr=^1, cond_nconsts=0} {
    ^r0(%16: i32[]@server, %17: i32[]@server, %18: f32[3]@server):
      %19: i32[]@server = fcir.constant {value=dense<i32[]: 1>}
      %20: i32[]@server = jax.add %16, %19
      %21: f32[3]@server = jax.mul %18, %18 {out_dtype=none}
      yield %20, %17, %21
  }, {
    ^r1(%22: i32[]@server, %23: i32[]@server, %24: f32[3]@server):
      %25: bool[]@server = jax.lt %22, %23
      yield %25
  }
  return %15
}
"""
_INT_ATTRS = [m.start(1) for m in re.finditer(r"[=\[ ](\d+)[,\]}]", FLOW)]
_FLOATISH = ["1e309", "-1e309", "1e3", "2.5", "-0.0", "1e-400", "nan", "inf", "-1", "1" * 30]


def test_flow_base_checks_and_has_integer_attributes_to_fuzz():
    fcir.check(fcir.parse(FLOW))
    assert len(_INT_ATTRS) >= 8


@FUZZ
@given(st.lists(st.tuples(st.sampled_from(_INT_ATTRS), st.sampled_from(_FLOATISH)),
                min_size=1, max_size=2, unique_by=lambda e: e[0]))
def test_float_tokens_for_integer_attributes_raise_only_fcir_errors(edits):
    text = FLOW
    for at, tok in sorted(edits, reverse=True):
        end = at + len(re.match(r"\d+", text[at:]).group())
        text = text[:at] + tok + text[end:]
    try:
        m = fcir.parse(text)
        fcir.check(m)
    except FcirError:
        return
    _round_trips(m)


def test_op_without_operands_before_a_definition_round_trips():
    # Found by test_serialize's bit-flip fuzz: "jax.reduce_sum" with no operands, then the
    # next line's "%3: ..." was read as its operand.
    m = fcir.parse(SUM.replace("return %2", "%3: f32[]@server = jax.neg %2\n  return %3")
                   .replace("%2: f32[]@server = jax.reduce_sum %1 {axes=[0], out_sharding=none}",
                            "%2: f32[]@server = jax.reduce_sum %1"))
    m.main.body.ops[1].operands = []
    text = m.to_text()
    assert "jax.reduce_sum\n" in text
    assert fcir.parse(text).to_text() == text


# --- readers of an unchecked module's scan length -------------


@pytest.mark.parametrize("length", ["1e309", "-3", "2.5"])
def test_a_bad_scan_length_is_an_fcir_error_in_show_dot_cost_and_export(tmp_path, capsys,
                                                                         length):

    path = tmp_path / "bad.fcir"
    path.write_text(FLOW.replace("length=2", f"length={length}"))
    out = tmp_path / "out"
    assert cli.main(["show", str(path)]) == 0  # shown, with why it is not costed
    for argv in (["show", str(path), "--format", "dot"],
                 ["compile", str(path), "--emit", "cost", "-o", str(out)],
                 ["export", "--target", "production", str(path), "-o", str(out)]):
        assert cli.main(argv) == 1, argv
        err = capsys.readouterr().err
        assert "length" in err and "run with --debug" not in err, err  # an FcirError
    module = fcir.parse(path.read_text())
    for fn in (traffic.communication_bytes, fcir.privacy.releases, dot.to_dot):
        with pytest.raises(fcir.FcirError, match="length"):
            fn(module)
