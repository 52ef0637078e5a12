"""The ``fcir.v1.Module`` protobuf: ``Module.deserialize(m.serialize())`` prints the same
text and runs to the same values; the reader turns any malformed input into an FcirError
(ParseError, or VersionError for a newer ``ir_version``), never a protobuf DecodeError,
KeyError, IndexError or ValueError.
"""

from __future__ import annotations

import collections
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fcir.interpreters import reference
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fcir
from fcir._proto import module_pb2 as pb
from fcir.errors import FcirError, ParseError, VersionError
from fcir.frontend import pytrees
from fcir.ir import serialize

N = 2
Batch = collections.namedtuple("Batch", ["x", "y"])


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Params:
    w: jax.Array
    b: jax.Array


TABLE = np.arange(40, dtype=np.float32).reshape(5, 8)  # printed as sha256 unless asked


@fcir.program(placements={"clients": N})
def train_round(params, batch, key):
    def local(p, b, k):
        noise = jax.random.normal(k, p.w.shape) * 0.01
        pred = b.x @ (p.w + noise) + p.b
        loss = jnp.mean((pred - b.y) ** 2)
        w = jax.lax.cond(loss > 1.0, lambda: p.w * 0.9, lambda: p.w)
        return Params(w, p.b), loss, (loss > 0.5).astype(jnp.int32)

    p, loss, big = fcir.map_fn(local, (fcir.broadcast(params), batch, fcir.broadcast(key)))
    return {
        "params": fcir.reduce_mean(p),
        "loss": fcir.reduce_max(loss),
        "big": fcir.secure_sum(big, bitwidth=8),
        "table": jnp.asarray(TABLE) * 2.0,
    }


def train_args():
    params = Params(np.full((3, 1), 0.5, np.float32), np.zeros((1,), np.float32))
    x = np.linspace(-1, 1, N * 4 * 3, dtype=np.float32).reshape(N, 4, 3)
    y = np.linspace(0, 2, N * 4, dtype=np.float32).reshape(N, 4, 1)
    return params, Batch(x, y), jax.random.key(0)


@fcir.program(placements={"silos": 2, "clients": 2})
def hierarchical(model, data):
    def silo(m, d):
        return fcir.reduce_mean(fcir.map_fn(lambda a, b: a * b.sum(), (fcir.broadcast(m), d)))

    return fcir.reduce_sum(fcir.map_fn(silo, (fcir.broadcast(model), data)))


def hier_args():
    return np.ones(2, np.float32), np.arange(12, dtype=np.float32).reshape(2, 2, 3)


@functools.cache
def modules() -> dict[str, fcir.Module]:
    return {
        "train_round": fcir.capture(train_round, *train_args()),
        "hierarchical": fcir.capture(hierarchical, *hier_args()),
        "keys": fcir.capture(
            lambda k, kr: (jax.random.split(k, 3), jax.random.bits(kr, (2,))),
            jax.random.key(1),
            jax.random.key(2, impl="rbg"),
        ),
    }


@functools.cache
def valid_bytes() -> bytes:
    return modules()["train_round"].serialize()


# --- round trips --------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["train_round", "hierarchical", "keys"])
def test_binary_round_trip_prints_the_same_text(name):
    m = modules()[name]
    data = m.serialize()
    assert isinstance(data, bytes) and data == m.serialize()
    back = fcir.Module.deserialize(data)
    assert back.to_text() == m.to_text()
    assert back.to_text(full_constants=True) == m.to_text(full_constants=True)
    assert back.serialize() == data
    # text -> Module -> bytes gives the same bytes as the captured module
    assert fcir.parse(m.to_text(full_constants=True)).serialize() == data
    assert fcir.Module.deserialize(bytearray(data)).to_text() == m.to_text()
    assert fcir.Module.deserialize(memoryview(data)).to_text() == m.to_text()


def test_binary_round_trip_runs_to_the_same_values(monkeypatch):
    m = modules()["train_round"]
    back = fcir.Module.deserialize(m.serialize())
    args = train_args()
    # In the capturing process the program's own classes come back (fcir.frontend.pytrees) ...
    assert isinstance(reference.run(back, *args)["params"], Params)
    # ... in another process, which never captured it, the dataclass comes back as its
    # named fields (the IR never imports Python types).
    monkeypatch.setattr(pytrees, "_BY_STRUCTURE", {})
    got = reference.run(back, *args)
    want = jax.jit(train_round)(*args)
    assert set(got) == set(want)
    assert sorted(got["params"]) == ["b", "w"]
    pairs = [
        (got["params"]["w"], want["params"].w),
        (got["params"]["b"], want["params"].b),
        *[(got[k], want[k]) for k in ("loss", "big", "table")],
    ]
    for a, b in pairs:
        a, b = np.asarray(a), np.asarray(b)
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_allclose(a, b, rtol=1e-5)
    text = m.to_text()
    assert "Params" in text and "Batch" in text


def test_locations_survive_the_binary_form():
    m = fcir.capture(hierarchical, *hier_args(), locations=True)
    located = m.to_text(locations=True)
    assert "loc(" in located
    assert fcir.Module.deserialize(m.serialize()).to_text(locations=True) == located


def test_elided_constants_cannot_be_serialized():
    text = modules()["train_round"].to_text()
    assert 'sha256"' in text
    with pytest.raises(ParseError, match="full_constants=True"):
        fcir.parse(text).serialize()


# --- versions -----------------------------------------------------------------------------


def test_newer_binary_version_is_a_version_error():
    msg = serialize.to_proto(modules()["hierarchical"])
    msg.ir_version = fcir.IR_VERSION + 1
    with pytest.raises(VersionError) as info:
        fcir.Module.deserialize(msg.SerializeToString())
    text = str(info.value)
    assert f"ir_version={fcir.IR_VERSION + 1}" in text
    assert f"this fcir reads ir_version <= {fcir.IR_VERSION}" in text


def test_newer_text_version_is_a_version_error():
    text = modules()["hierarchical"].to_text()
    newer = text.replace(f"ir_version={fcir.IR_VERSION}", f"ir_version={fcir.IR_VERSION + 1}", 1)
    with pytest.raises(VersionError) as info:
        fcir.parse(newer)
    assert f"this fcir reads ir_version <= {fcir.IR_VERSION}" in str(info.value)
    # Even when the rest would not parse: the version is checked first.
    with pytest.raises(VersionError):
        fcir.parse(f"fcir.module @m ir_version={fcir.IR_VERSION + 7} garbage")


def test_version_error_is_an_fcir_error():
    assert issubclass(VersionError, FcirError)


def test_missing_version_is_a_parse_error():
    msg = serialize.to_proto(modules()["hierarchical"])
    msg.ir_version = 0
    with pytest.raises(ParseError, match="no ir_version"):
        fcir.Module.deserialize(msg.SerializeToString())


# --- malformed messages -------------------------------------------------------------------


def _proto() -> pb.Module:
    return serialize.to_proto(modules()["train_round"])


def _map_op(msg: pb.Module) -> pb.Op:
    return next(op for op in msg.funcs[0].body.ops if op.name == "fed.map")


def _first_local(msg: pb.Module) -> pb.Op:
    return next(op for op in _map_op(msg).regions[0].ops if op.name.startswith("jax."))


def _set(path_fn, field, value):
    def mutate(msg):
        setattr(path_fn(msg), field, value)

    return mutate


def _structure_leaf(msg, i):
    return msg.funcs[0].arg_structure.children[0].children[i]


MALFORMED = {
    "module name not an identifier": _set(lambda m: m, "name", "a b"),
    "func name not an identifier": _set(lambda m: m.funcs[0], "name", "ma in"),
    "no main": _set(lambda m: m.funcs[0], "name", "other"),
    "func repeated": lambda m: m.funcs.add().CopyFrom(m.funcs[0]),
    "placement named server": _set(lambda m: m.placements[0], "name", "server"),
    "placement zero": _set(lambda m: m.placements[0], "cardinality", 0),
    "placement repeated": lambda m: m.placements.add(name="clients", cardinality=2),
    "op name with space": _set(lambda m: m.funcs[0].body.ops[0], "name", "fed. broadcast"),
    "op name without namespace": _set(lambda m: m.funcs[0].body.ops[0], "name", "broadcast"),
    "region label with space": _set(lambda m: _map_op(m).regions[0], "label", "a b"),
    "operand undefined": lambda m: _map_op(m).operands.append(99999),
    "result redefined": lambda m: setattr(_map_op(m).results[0], "id", 0),
    "yield undefined": lambda m: _map_op(m).regions[0].results.append(88888),
    "value without type": lambda m: m.funcs[0].body.params[0].ClearField("type"),
    "unknown dtype": lambda m: setattr(
        m.funcs[0].body.params[0].type.placed.member.tensor, "dtype", "f7"
    ),
    "negative dimension": lambda m: (
        m.funcs[0].body.params[0].type.placed.member.tensor.shape.append(-3)
    ),
    "undeclared placement": lambda m: setattr(
        m.funcs[0].body.params[1].type.placed, "placement", "nowhere"
    ),
    "attribute key not identifier": lambda m: _first_local(m).attributes.add(key="a.b"),
    "attribute without value": lambda m: _first_local(m).attributes.add(key="zz"),
    "attribute repeated": lambda m: _first_local(m).attributes.append(
        _first_local(m).attributes[0]
    ),
    "dtype attribute unknown": lambda m: setattr(
        _first_local(m).attributes.add(key="zz").value, "dtype", "q8"
    ),
    "enum with bad names": lambda m: (
        _first_local(m)
        .attributes.add(key="zz")
        .value.enum.MergeFrom(pb.EnumValue(type_name="a b", member="c"))
    ),
    "record with bad field": lambda m: (
        _first_local(m)
        .attributes.add(key="zz")
        .value.record.MergeFrom(pb.Record(type_name="R", fields=[pb.NamedAttr(key="x y")]))
    ),
    "tensor wrong length": lambda m: (
        _first_local(m)
        .attributes.add(key="zz")
        .value.tensor.MergeFrom(pb.Tensor(dtype="f32", shape=[3], data=b"\0" * 11))
    ),
    "tensor huge shape": lambda m: (
        _first_local(m)
        .attributes.add(key="zz")
        .value.tensor.MergeFrom(pb.Tensor(dtype="f32", shape=[2**32, 2**32], data=b""))
    ),
    "tensor key odd bytes": lambda m: (
        _first_local(m)
        .attributes.add(key="zz")
        .value.tensor.MergeFrom(pb.Tensor(dtype="key<fry>", shape=[1], data=b"\1\2\3"))
    ),
    "tensor unknown key impl": lambda m: (
        _first_local(m)
        .attributes.add(key="zz")
        .value.tensor.MergeFrom(pb.Tensor(dtype="key<nope>", shape=[1], data=b"\0" * 8))
    ),
    "structure leaf out of range": lambda m: setattr(_structure_leaf(m, 0), "leaf", 99),
    "structure leaf repeated": lambda m: setattr(_structure_leaf(m, 1), "leaf", 0),
    "structure leaf missing": lambda m: m.funcs[0].arg_structure.children.pop(),
    "structure leaf with children": lambda m: _structure_leaf(m, 0).children.add(kind=1),
    "structure tuple with names": lambda m: m.funcs[0].arg_structure.names.append("x"),
    "structure dict names mismatch": lambda m: m.funcs[0].result_structure.names.pop(),
    "structure unknown kind": lambda m: setattr(m.funcs[0].arg_structure, "kind", 0),
    "result structure out of range": lambda m: setattr(
        m.funcs[0].result_structure.children[0], "leaf", 17
    ),
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_malformed_message_is_a_parse_error(name):
    msg = _proto()
    MALFORMED[name](msg)
    with pytest.raises(ParseError):
        fcir.Module.deserialize(msg.SerializeToString())


def test_structure_leaves_are_checked_in_text_too():
    text = modules()["hierarchical"].to_text()
    assert ".args ($0, $1)" in text
    for bad in ["($1, $1)", "($0, $2)", "($0,)", "($0, $1, $2)"]:
        with pytest.raises(ParseError, match="exactly once"):
            fcir.parse(text.replace(".args ($0, $1)", f".args {bad}"))


@pytest.mark.parametrize("value", ["text", None, 3, [1, 2]])
def test_deserialize_rejects_non_bytes(value):
    with pytest.raises(ParseError, match="expects bytes"):
        fcir.Module.deserialize(value)


def test_decode_error_is_a_parse_error():
    with pytest.raises(ParseError, match="not a serialized fcir.v1.Module"):
        fcir.Module.deserialize(b"\xff\xff\xff")


# --- property tests -------------------------------------------------------------------------

FUZZ = settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def deserialize_or_fcir_error(data: bytes):
    """The module, or None after an FcirError; any other exception fails the test. A
    module that loads also prints, re-parses and re-serializes consistently."""
    try:
        m = fcir.Module.deserialize(data)
    except FcirError:
        return None
    full = m.to_text(full_constants=True)
    assert fcir.parse(full).to_text(full_constants=True) == full
    assert fcir.Module.deserialize(m.serialize()).to_text(full_constants=True) == full
    return m


@FUZZ
@given(st.binary(max_size=400))
def test_random_bytes_raise_only_fcir_errors(data):
    deserialize_or_fcir_error(data)


@FUZZ
@given(st.integers(0, 10**9))
def test_truncated_bytes_raise_only_fcir_errors(cut):
    data = valid_bytes()
    deserialize_or_fcir_error(data[: cut % len(data)])


@FUZZ
@given(st.lists(st.tuples(st.integers(0, 10**9), st.integers(0, 7)), min_size=1, max_size=6))
def test_bit_flipped_bytes_raise_only_fcir_errors(flips):
    data = bytearray(valid_bytes())
    for pos, bit in flips:
        data[pos % len(data)] ^= 1 << bit
    deserialize_or_fcir_error(bytes(data))


@FUZZ
@given(st.data())
def test_spliced_bytes_raise_only_fcir_errors(data):
    raw = valid_bytes()
    i = data.draw(st.integers(0, len(raw)))
    j = data.draw(st.integers(0, len(raw)))
    k = data.draw(st.integers(0, 40))
    junk = data.draw(st.binary(max_size=8))
    deserialize_or_fcir_error(raw[:i] + junk + raw[j : j + k] + raw[i:])
