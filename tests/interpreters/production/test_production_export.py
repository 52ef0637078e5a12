"""production.export: the Computation on the wire, the bundle, and running a bundle."""

from __future__ import annotations

import hashlib
import json
import pathlib
import shutil

import jax
import numpy as np
import pytest
from fcir.interpreters import production
from fcir.interpreters.production import computation as C
from fcir.interpreters.production import wire_types as W
from productionlib import cases
from productionlib.evaluate import evaluate

import fcir
from fcir._proto import computation_pb2 as pb

PART_FILES = ("fcir", "pb", "stablehlo", "hlo")


# --- the bundle runs to the reference values ----------------------------------------------


@pytest.mark.parametrize("name", cases.ALL)
def test_bundle_runs_to_reference_values(name):
    _, args = cases.fn_and_args(name)
    got = production.run_bundle(cases.bundle(name), *args)
    module = cases.captured(name)
    if cases.low_precision(module):
        # Compiled bf16 code may keep f32 inside a fusion where the eager reference rounds
        # after every op: match jax.jit exactly, the reference to bf16 precision.
        fn, _ = cases.fn_and_args(name)
        cases.assert_close(got, jax.jit(fn)(*args), name=name)
        cases.assert_close(got, cases.expected(name), name=name, rtol=2e-2, atol=1e-3)
    else:
        cases.assert_close(got, cases.expected(name), name=name)


def test_bundle_files_and_manifest(tmp_path):
    plan = cases.plan("own:fedavg_pytree")
    out = plan.write(tmp_path / "b")
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["format"] == "fcir.production.bundle"
    assert manifest["round"] == "fedavg_pytree"
    assert manifest["placements"] == [["clients", 4]]
    for key in ("fcir", "fcir_ir_version", "jax", "jaxlib", "protobuf", "computation_schema"):
        assert manifest["versions"][key]
    listed = set(manifest["files"])
    on_disk = {str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()}
    assert on_disk == listed | {"manifest.json"}
    for rel, entry in manifest["files"].items():
        data = (out / rel).read_bytes()
        assert entry == {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    assert {"round.computation.pb", "round.fcir", "round.pb"} <= listed
    for part in production.PARTS:
        spec = manifest["parts"][part]
        assert set(spec["files"]) == set(PART_FILES)
        assert set(spec["files"].values()) <= listed
        assert spec["signature"] == plan.signature(part)
        assert "cpu" in spec["platforms"]
    assert (out / "round.computation.pb").read_bytes() == plan.to_computation_bytes()
    # The IR in the bundle is the round, constants included.
    assert fcir.parse((out / "round.fcir").read_text()).to_text() == plan.round.to_text()
    assert (
        fcir.Module.deserialize((out / "round.pb").read_bytes()).to_text() == plan.round.to_text()
    )


def test_bundles_are_reproducible(tmp_path):
    """Same round, same bytes: no machine paths, call stacks or counters inside."""
    module = cases.captured("corpus:minmax_agg")
    a = production.export(module).write(tmp_path / "a")
    b = production.export(fcir.parse(module.to_text(full_constants=True))).write(tmp_path / "b")
    assert (a / "manifest.json").read_text() == (b / "manifest.json").read_text()
    for path in a.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            assert data == (b / path.relative_to(a)).read_bytes(), path
            assert str(tmp_path).encode() not in data and b"/tests/" not in data, path


def test_bundle_parts_are_the_parts(tmp_path):
    plan = cases.plan("corpus:fedavg_mlp")
    out = plan.write(tmp_path / "b")
    for name, part in plan.parts.items():
        assert (out / f"parts/{name}.fcir").read_text() == part.to_text(full_constants=True)
        assert (out / f"parts/{name}.hlo.pb").read_bytes() == plan.hlo_modules()[name]
        exported = jax.export.deserialize(bytearray((out / f"parts/{name}.stablehlo").read_bytes()))
        code = plan.code(name).main.body
        assert len(exported.in_avals) == len(code.params)
        assert len(exported.out_avals) == len(code.results)
    # client work's artifacts are member-level: one client's data, no client axis.
    member = jax.export.deserialize(bytearray((out / "parts/client_work.stablehlo").read_bytes()))
    assert member.in_avals[0].shape == (3, 4, 8)  # x of one client: [steps, batch, d_in]


def test_corrupt_or_foreign_bundles_are_bundle_errors(tmp_path):
    src = pathlib.Path(cases.bundle("corpus:temperature_sensors"))
    _, args = cases.fn_and_args("corpus:temperature_sensors")
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    with open(bad / "parts/client_work.stablehlo", "ab") as f:
        f.write(b"tampered")
    with pytest.raises(production.BundleError, match="sha256"):
        production.run_bundle(bad, *args)
    with pytest.raises(production.BundleError, match="no manifest"):
        production.run_bundle(tmp_path, *args)
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(production.BundleError, match="unreadable manifest"):
        production.run_bundle(tmp_path, *args)
    with pytest.raises(production.BundleError, match="takes 2 argument leaves, got 1"):
        production.run_bundle(src, args[0])
    with pytest.raises(production.BundleError, match=r"needs an array of f32\[8,16\]"):
        production.run_bundle(src, args[0], np.zeros((8, 15), np.float32))
    assert issubclass(production.BundleError, fcir.FcirError)


def test_aggregate_with_must_be_known():
    with pytest.raises(fcir.ExportError, match="aggregate_with='tree'"):
        production.export(cases.captured("own:minmax"), aggregate_with="tree")


# --- the Computation on the wire ------------------------------------------------------------


def _intrinsics(name, mode="intrinsics"):
    c = pb.Computation.FromString(cases.plan(name, mode).to_computation_bytes())
    return c, C.intrinsic_uses(c)


def test_computation_decodes_to_the_round_lambda():
    c, uses = _intrinsics("corpus:temperature_sensors")
    assert c.WhichOneof("computation") == "lambda"
    assert W.format_type(c.type) == "(<float32@SERVER,{float32[16]}@CLIENTS> -> float32@SERVER)"
    lam = getattr(c, "lambda")
    assert lam.parameter_name == "arg"
    assert lam.result.WhichOneof("computation") == "block"
    assert [loc.name for loc in lam.result.block.local] == [
        "server_state",
        "prepared",
        "broadcast_input",
        "temporary",
        "broadcast_output",
        "client_input",
        "client_output",
        "value_v11",
        "aggregate_v11",
        "aggregated",
        "result_input",
        "result",
    ]
    first = {}
    for uri, t in uses:
        first.setdefault(uri, t)
    assert first["federated_broadcast"] == "(<v2=float32>@SERVER -> <v2=float32>@CLIENTS)"
    assert first["federated_mean"] == "({float32}@CLIENTS -> float32@SERVER)"
    assert first["federated_map"] == (
        "(<(<<float32[16]>,<v2=float32>> -> <v11=float32>),{<<float32[16]>,<v2=float32>>}"
        "@CLIENTS> -> {<v11=float32>}@CLIENTS)"
    )
    for node in C.walk(c):
        assert node.HasField("type"), node.WhichOneof("computation")


def test_xla_pieces_are_hlo_modules_with_bindings():
    c, _ = _intrinsics("own:fedavg_pytree")
    pieces = [n for n in C.walk(c) if n.WhichOneof("computation") == "xla"]
    assert len(pieces) == 3  # server_prepare, client_work, server_result
    for piece in pieces:
        assert piece.xla.hlo_module.type_url == "type.googleapis.com/xla.HloModuleProto"
        assert piece.xla.HasField("parameter") and piece.xla.HasField("result")
    prepare = pieces[0]
    # <params> with params = <dense=<bias, kernel>, scale=<gain, offset>>: leaves 0..3
    assert W.format_type(prepare.type.function.parameter) == (
        "<<dense=<bias=float32[2],kernel=float32[3,2]>,scale=<gain=float32,offset=float32[2]>>>"
    )
    indices = [b.tensor.index for b in _tensor_bindings(prepare.xla.parameter)]
    assert indices == [0, 1, 2, 3]


def _tensor_bindings(b):
    if b.WhichOneof("binding") == "tensor":
        return [b]
    return [t for e in b.struct.element for t in _tensor_bindings(e)]


def test_binding_maps_declared_order_to_flattened_order():
    """A struct whose declared element order differs from JAX's sorted flattening (a
    custom pytree node keeps its field order) binds each element to its own leaf."""
    from fcir.ir.types import Structure, TensorType

    s = Structure(
        "custom", (Structure("leaf", leaf=1), Structure("leaf", leaf=0)), ("zeta", "alpha"), "Pair"
    )
    leaves = [TensorType("f32", (2,)), TensorType("i32", ())]
    piece = C.xla(b"", s, leaves, s, leaves)
    assert W.format_type(piece.type) == (
        "(<zeta=int32,alpha=float32[2]> -> <zeta=int32,alpha=float32[2]>)"
    )
    assert [b.tensor.index for b in _tensor_bindings(piece.xla.parameter)] == [1, 0]
    index0 = pb.Computation.FromString(piece.SerializeToString())
    assert index0.xla.parameter.struct.element[1].tensor.WhichOneof("binding") == "index"


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("corpus:secure_histogram", {"federated_secure_sum_bitwidth", "federated_sum"}),
        ("corpus:minmax_agg", {"federated_min", "federated_max"}),
        ("corpus:fedavg_weighted", {"federated_weighted_mean"}),
        ("own:weighted", {"federated_weighted_mean", "federated_sum"}),
        ("corpus:int_mean", {"federated_mean"}),
    ],
)
def test_reductions_map_to_their_intrinsics(name, expected):
    _, uses = _intrinsics(name)
    reductions = {u for u, _ in uses} - {
        "federated_apply",
        "federated_map",
        "federated_broadcast",
        "federated_zip_at_server",
        "federated_zip_at_clients",
        "federated_value_at_server",
    }
    assert reductions == expected


def test_intrinsic_types_are_concrete():
    _, uses = _intrinsics("corpus:secure_histogram")
    secure = [t for u, t in uses if u == "federated_secure_sum_bitwidth"]
    assert secure == ["(<{int32[8]}@CLIENTS,int32> -> int32[8]@SERVER)"]
    _, uses = _intrinsics("corpus:fedavg_weighted")
    wmean = [t for u, t in uses if u == "federated_weighted_mean"]
    assert wmean[0] == "(<{float32[8]}@CLIENTS,{float32}@CLIENTS> -> float32[8]@SERVER)"
    _, uses = _intrinsics("corpus:int_mean")
    assert ("federated_mean", "({float32[12]}@CLIENTS -> float32[12]@SERVER)") in uses
    # Full-width signed secure sums travel as their unsigned bits.
    _, uses = _intrinsics("own:secure")
    secure = [t for u, t in uses if u == "federated_secure_sum_bitwidth"]
    assert secure == [
        "(<{int32[3]}@CLIENTS,int32> -> int32[3]@SERVER)",
        "(<{uint32}@CLIENTS,int32> -> uint32@SERVER)",
        "(<{uint8[2]}@CLIENTS,int32> -> uint8[2]@SERVER)",
    ]


def test_federated_aggregate_option():
    c, uses = _intrinsics("own:weighted", "federated_aggregate")
    uris = [u for u, _ in uses]
    assert "federated_weighted_mean" not in uris and "federated_sum" not in uris
    aggregates = [t for u, t in uses if u == "federated_aggregate"]
    assert len(aggregates) == 4
    wmean = next(t for t in aggregates if "value=" in t)
    assert wmean == (
        "(<{<value=float32[6],weight=float32>}@CLIENTS,<total=float32[6],weight=float32>,"
        "(<<total=float32[6],weight=float32>,<value=float32[6],weight=float32>> -> "
        "<total=float32[6],weight=float32>),(<<total=float32[6],weight=float32>,"
        "<total=float32[6],weight=float32>> -> <total=float32[6],weight=float32>),"
        "(<total=float32[6],weight=float32> -> float32[6])> -> float32[6]@SERVER)"
    )
    # zero is a call of a no-argument Xla computation: no parameter binding.
    zeros = [
        n
        for n in C.walk(c)
        if n.WhichOneof("computation") == "xla" and not n.type.function.HasField("parameter")
    ]
    assert zeros and all(not z.xla.HasField("parameter") for z in zeros)
    _, uses = _intrinsics("corpus:secure_histogram", "federated_aggregate")
    assert "federated_secure_sum_bitwidth" in [u for u, _ in uses]  # stays itself


EVALUATED = [n for n in cases.ALL if n not in cases.SLOW]


@pytest.mark.parametrize("name", EVALUATED)
def test_computation_evaluates_to_reference_values(name):
    """Run the Computation bytes as a runtime would: intrinsics over a list of clients,
    Xla pieces compiled from their HLO through their bindings."""
    _, args = cases.fn_and_args(name)
    module = cases.captured(name)
    n = module.placements[0][1]
    got, calls = evaluate(
        cases.plan(name).to_computation_bytes(), jax.tree_util.tree_leaves(args), n
    )
    expected = jax.tree_util.tree_leaves(
        jax.jit(cases.fn_and_args(name)[0])(*args)
        if cases.low_precision(module)
        else cases.expected(name)
    )
    cases.assert_close(got, expected, name=name)
    assert "federated_map" in calls


@pytest.mark.parametrize(
    "name",
    [
        "own:weighted",
        "own:fedavg_pytree",
        "corpus:int_mean",
        "corpus:fedavg_weighted",
        "own:secure",
    ],
)
def test_federated_aggregate_computation_evaluates_to_reference_values(name):
    _, args = cases.fn_and_args(name)
    n = cases.captured(name).placements[0][1]
    got, calls = evaluate(
        cases.plan(name, "federated_aggregate").to_computation_bytes(),
        jax.tree_util.tree_leaves(args),
        n,
    )
    cases.assert_close(got, jax.tree_util.tree_leaves(cases.expected(name)), name=name)
    assert "federated_aggregate" in calls


def test_computation_bytes_are_deterministic():
    a = cases.plan("corpus:fedsgd_linreg").to_computation_bytes()
    b = production.export(cases.captured("corpus:fedsgd_linreg")).to_computation_bytes()
    assert a == b


def test_plan_describes_itself():
    plan = cases.plan("corpus:temperature_sensors")
    assert repr(plan).startswith("<production.Plan @temperature_sensors: (<float32@SERVER")
    assert plan.signature("client_work") == (
        "(<<{float32[16]}@CLIENTS>,<v2=float32@CLIENTS>> -> <v11={float32}@CLIENTS>)"
    )
