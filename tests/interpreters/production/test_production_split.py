"""The split pass: five self-contained, placement-checked parts that compose to the round."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from fcir.interpreters import production, reference
from fcir.interpreters.production.splitting import INTRINSICS
from productionlib import cases, rounds

import fcir
from fcir.ir import Func, Module, walk
from fcir.ir.types import SERVER, PlacedType, TensorType

SERVER_PARTS = ("server_prepare", "server_result")


def _run_flat(module: Module, leaves: list) -> list:
    """``reference.run`` of a part on flat leaves, returning flat results."""
    flat = Module(module.name, module.placements, [Func("main", module.main.body)])
    return list(reference.run(flat, *leaves))


def compose(split: production.Split, leaves: list) -> list:
    """The round's flat results, computed part by part in DistributeAggregateForm order."""
    p = split.parts
    nb = len(p["server_to_client_broadcast"].main.body.params)
    prepared = _run_flat(p["server_prepare"], [leaves[i] for i in split.server_args])
    b_in, temporary = prepared[:nb], prepared[nb:]
    b_out = _run_flat(p["server_to_client_broadcast"], b_in)
    a_in = _run_flat(p["client_work"], [leaves[i] for i in split.client_args] + b_out)
    a_out = _run_flat(p["client_to_server_aggregation"], temporary + a_in)
    return _run_flat(p["server_result"], temporary + a_out)


@pytest.mark.parametrize("name", cases.ALL)
def test_parts_compose_to_the_round(name):
    module = cases.captured(name)
    split = production.split(module)
    _, args = cases.fn_and_args(name)
    got = compose(split, jax.tree_util.tree_leaves(args))
    cases.assert_close(got, jax.tree_util.tree_leaves(cases.expected(name)), name=name)


@pytest.mark.parametrize("name", cases.ALL)
def test_every_part_is_self_contained_and_checks(name):
    split = production.split(cases.captured(name))
    assert list(split.parts) == list(production.PARTS)
    for part_name, part in split.parts.items():
        fcir.check(part)
        again = fcir.parse(part.to_text(full_constants=True))
        assert again.to_text() == part.to_text()
        assert fcir.Module.deserialize(part.serialize()).to_text() == part.to_text()
        assert part.placements == split.round.placements, part_name


@pytest.mark.parametrize("name", cases.ALL)
def test_parts_touch_only_their_own_values(name):
    split = production.split(cases.captured(name))
    p = split.parts
    for part_name in SERVER_PARTS:
        main = p[part_name].main
        for v in [*main.body.params, *main.body.results]:
            assert isinstance(v.type, PlacedType) and v.type.placement == SERVER, (part_name, v)
        assert not any(op.name.startswith("fed.") for _, op in walk(main.body)), part_name
    bcast = p["server_to_client_broadcast"].main.body
    assert all(op.name == "fed.broadcast" for op in bcast.ops)
    agg = p["client_to_server_aggregation"].main.body
    assert all(op.name in INTRINSICS for op in agg.ops)
    work = p["client_work"].main.body
    assert [op.name for op in work.ops] in ([], ["fed.map"])
    for v in [*work.params, *work.results]:
        assert isinstance(v.type, PlacedType) and v.type.placement != SERVER
    # What one client runs: member-level code, no federated op, no placed value.
    member = split.client_member.main
    for path, op in walk(member.body):
        assert not op.name.startswith("fed."), (path, op.name)
        for v in op.results:
            assert not isinstance(v.type, PlacedType), (path, v.type)
    for v in [*member.body.params, *member.body.results]:
        assert isinstance(v.type, TensorType)


def test_pytree_names_survive_into_the_parts():
    split = production.split(cases.captured("own:fedavg_pytree"))
    prepare = split.parts["server_prepare"].main
    params = prepare.arg_structure.children[0]
    assert params.kind == "dict" and params.names == ("dense", "scale")
    assert params.children[0].names == ("bias", "kernel")
    scale = params.children[1]
    assert scale.kind == "namedtuple" and scale.names == ("gain", "offset")
    assert scale.type_name.endswith("Scale")
    result = split.parts["server_result"].main.result_structure
    assert result.children[1].names == ("examples", "zloss")
    data = split.client_member.main.arg_structure.children[0]
    assert data.kind == "tuple" and len(data.children) == 2  # x and y


def test_interfaces_name_the_round_values():
    module = cases.captured("corpus:temperature_sensors")
    split = production.split(module)
    text = module.to_text()
    # temperature_sensors: %2 = fed.broadcast %0; %11 = fed.mean %3
    assert "%2: f32[]@clients! = fed.broadcast %0" in text
    assert "%11: f32[]@server = fed.mean %3" in text
    prepare = split.parts["server_prepare"].main.result_structure
    assert prepare.children[0].names == ("v2",)
    assert split.client_member.main.result_structure.names == ("v11",)
    assert split.parts["client_to_server_aggregation"].main.result_structure.names == ("v11",)
    (agg,) = split.aggregations
    assert agg.intrinsic == "federated_mean" and agg.inputs == ("v11",)
    assert agg.source == "fed.mean (op 2, defining %11)"


def test_server_work_waits_for_server_result():
    """Server ops the broadcast does not need go to server_result; their inputs travel
    in the temporary state."""
    split = production.split(cases.captured("own:server_side"))
    prepare = split.parts["server_prepare"].main
    assert not any(op.name == "jax.exp" for op in prepare.body.ops)
    assert any(op.name == "jax.exp" for op in split.parts["server_result"].main.body.ops)
    temporary = prepare.result_structure.children[1]
    assert len(temporary.names) == 2  # state["step"] and state["w"]


def test_reductions_become_intrinsics():
    split = production.split(cases.captured("own:weighted"))
    uses = sorted((a.fed_op, a.intrinsic, len(a.inputs)) for a in split.aggregations)
    assert uses == [
        ("fed.sum", "federated_sum", 1),  # per-element weights: sum of w*x ...
        ("fed.sum", "federated_sum", 1),  # ... and of w, divided in server_result
        ("fed.weighted_mean", "federated_weighted_mean", 2),
        ("fed.weighted_mean", "federated_weighted_mean", 2),
    ]
    secure = production.split(cases.captured("own:secure"))
    assert [a.bitwidth for a in secure.aggregations if a.fed_op == "fed.secure_sum"] == [5, 32, 8]
    # int means travel as f32; bools of min/max as int32
    int_mean = production.split(cases.captured("corpus:int_mean"))
    member = int_mean.client_member.main
    assert {str(v.type) for v in member.body.results} <= {"f32[4]", "f32[]", "f32[12]"}
    minmax = production.split(cases.captured("own:minmax"))
    assert "i32[2]" in {str(v.type) for v in minmax.client_member.main.body.results}


def test_server_only_round_has_empty_client_parts():
    split = production.split(cases.captured("own:server_only"))
    assert split.parts["client_work"].main.body.ops == []
    assert split.parts["client_to_server_aggregation"].main.body.ops == []
    assert split.aggregations == []


def test_constants_used_by_clients_are_copied_into_client_work():
    module = fcir.parse(rounds.CONSTANT_CHAIN_IR)
    split = production.split(module)
    fcir.check(split.parts["client_work"])
    member_ops = [op.name for op in split.client_member.main.body.ops]
    assert member_ops == ["fcir.constant", "jax.exp", "jax.mul"]
    x = np.ones((2, 3), np.float32)
    got = compose(split, [x])
    cases.assert_close(got, list(reference.run(module, x)))
