"""The Computation bytes against the real federated_language package.

federated_language 0.5.4 installs beside fcir (both on protobuf 6.x; it is in the
``test`` extra), so it is imported in-process. Its protos live in their own package
(``federated_language.proto``), ours in ``fcir.compat.federated_language``: the two descriptor pools
never clash, and ``fl_check`` reads the bytes with federated_language's classes only.
"""

from __future__ import annotations

from fcir.interpreters.production import computation as C
from fcir.interpreters.production import wire_types as W
from productionlib import cases, fl_check

from fcir._proto import computation_pb2 as pb

ROUNDS = [
    ("corpus:temperature_sensors", "intrinsics"),
    ("corpus:fedavg_mlp", "intrinsics"),
    ("corpus:fedavg_mlp", "federated_aggregate"),
    ("corpus:secure_histogram", "intrinsics"),
    ("corpus:minmax_agg", "intrinsics"),
    ("corpus:int_mean", "federated_aggregate"),
    ("corpus:fedavg_weighted", "intrinsics"),
    ("corpus:fedadam", "intrinsics"),
    ("own:weighted", "intrinsics"),
    ("own:weighted", "federated_aggregate"),
    ("own:fedavg_pytree", "intrinsics"),
    ("own:secure", "federated_aggregate"),
    ("own:minmax", "intrinsics"),
    ("own:server_side", "intrinsics"),
    ("own:server_only", "intrinsics"),
    ("own:robust", "intrinsics"),
]


def test_federated_language_builds_and_type_checks_every_round():
    for name, mode in ROUNDS:
        got = fl_check.summarize(cases.plan(name, mode).to_computation_bytes())
        ours = pb.Computation.FromString(cases.plan(name, mode).to_computation_bytes())
        assert got["kind"] == "Lambda", name
        assert got["reserialized_equal"], name
        # Types print the same in federated_language's notation and ours.
        assert got["type"] == W.format_type(ours.type), name
        assert got["intrinsics"] == [list(u) for u in C.intrinsic_uses(ours)], name
        uris = {u for u, _ in got["intrinsics"]}
        # Order statistics (own:robust) gather every value with federated_aggregate.
        assert ("federated_aggregate" in uris) == (
            (mode == "federated_aggregate" and name != "own:minmax") or name == "own:robust"
        ), name
        for piece in got["xla"]:
            assert piece["type_url"] == "type.googleapis.com/xla.HloModuleProto"
            assert piece["has_result_binding"]
            assert piece["has_parameter_binding"] == (not piece["type"].startswith("( ->")), piece[
                "type"
            ]


def test_compat_schema_matches_federated_language_field_for_field():
    theirs = fl_check.descriptors()
    ours = {}

    def visit(desc, prefix):
        name = prefix + desc.name
        for f in desc.fields:
            ours[f"{name}.{f.number}"] = [f.name, f.type, f.containing_oneof is not None]
        for nested in desc.nested_types:
            visit(nested, name + ".")

    for desc in pb.DESCRIPTOR.message_types_by_name.values():
        visit(desc, "")
    theirs = {k: [v[0], v[1], v[3]] for k, v in theirs.items()}
    # Every message federated_language has, we have, with the same fields.
    assert {k: ours.get(k) for k in theirs} == theirs
