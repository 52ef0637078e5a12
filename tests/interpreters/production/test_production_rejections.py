"""Every reason a round is not exportable is an ExportError that names the op."""

from __future__ import annotations

import re

import jax
import pytest
from fcir.interpreters import production
from fcir.interpreters.production import checks
from productionlib import cases, rounds

import fcir


def _reject(module: fcir.Module, reason: str, where: str) -> str:
    with pytest.raises(fcir.ExportError) as info:
        production.export(module)
    message = str(info.value)
    assert "\n" not in message
    assert f"@{module.name} is not exportable: " in message
    assert f": {reason}: " in message
    assert re.search(where, message), message
    return message


@pytest.mark.parametrize("name", cases.CORPUS_REJECTED)
def test_corpus_programs_that_are_not_exportable_are_rejected(name):
    module = cases.captured(f"corpus:{name}")
    reason = cases.KNOWN_REJECTED.get(name, checks.HIERARCHICAL)
    _reject(module, reason, r"(\(op [\d/]+|argument %\d+)")


def test_hierarchical_placements():
    module = fcir.capture(rounds.two_levels, *rounds.two_levels_args())
    message = _reject(module, checks.HIERARCHICAL, r"fed\.broadcast \(op 1/0/0, defining %\d+\)")
    assert "inside a fed.map over 'silos'" in message


def test_second_exchange_of_an_explicit_two_stage_round():
    module = fcir.capture(rounds.two_exchanges, *rounds.two_exchanges_args())
    message = _reject(module, checks.SECOND_EXCHANGE, r"^@two_exchanges .*fed\.broadcast \(op 4,")
    assert "from the aggregate fed.mean (op 2, defining %7)" in message


def test_second_exchange_of_reverse_mode_ad_through_a_round():
    module = fcir.capture(rounds.grad_through_round, *rounds.two_exchanges_args())
    _reject(module, checks.SECOND_EXCHANGE, r"fed\.broadcast \(op \d+, defining %\d+\)")


def test_federated_ops_under_control_flow():
    module = fcir.capture(rounds.rounds_in_a_loop, *rounds.rounds_in_a_loop_args())
    message = _reject(module, checks.CONTROL_FLOW, r"fed\.broadcast \(op \d+/0/\d+")
    assert "region of jax.scan" in message or "region of jax.while" in message


def test_client_to_client_communication():
    module = fcir.parse(rounds.CLIENT_TO_CLIENT_IR)
    _reject(module, checks.CLIENT_TO_CLIENT, r"jax\.psum \(op 0/0/0, defining %3\)")


def test_client_to_client_collective_is_refused_at_capture_already():
    @fcir.program(placements={"clients": 4})
    def gossip(x):
        return fcir.reduce_mean(fcir.map_fn(lambda v: jax.lax.psum(v, "clients"), x))

    with pytest.raises(fcir.FcirError):
        fcir.capture(gossip, jax.numpy.ones((4, 3)))


def test_per_member_read():
    module = fcir.parse(rounds.PER_MEMBER_READ_IR)
    message = _reject(module, checks.PER_MEMBER_READ, r"jax\.reduce_sum \(op 0, defining %1\)")
    assert "{f32[3]}@clients" in message


def test_server_value_reaching_clients_without_broadcast():
    module = fcir.parse(rounds.UNBROADCAST_IR)
    message = _reject(module, checks.UNBROADCAST_FLOW, r"jax\.mul \(op 1, defining %3\)")
    assert "operand %2 (f32[]@server)" in message


def test_unsupported_dtype_at_a_boundary():
    module = fcir.capture(rounds.broadcasts_a_key, *rounds.broadcasts_a_key_args())
    message = _reject(module, checks.UNSUPPORTED_DTYPE, r"argument %0")
    assert "key<fry>" in message and "jax.random.key_data" in message


def test_unsupported_dtype_inside_a_part_is_fine():
    """Keys made and used inside client work never cross a boundary."""

    @fcir.program(placements={"clients": 2})
    def noisy(seed, x):
        def client(s, x):
            return x + jax.random.normal(jax.random.key(s), x.shape)

        return fcir.reduce_mean(fcir.map_fn(client, (fcir.broadcast(seed), x)))

    module = fcir.capture(noisy, jax.numpy.int32(1), jax.numpy.zeros((2, 3)))
    assert production.export(module).parts["client_work"]


def test_sum_of_bools_is_refused():
    @fcir.program(placements={"clients": 2})
    def count_flags(flags):
        return fcir.reduce_sum(flags)

    module = fcir.capture(count_flags, jax.numpy.ones((2, 3), bool))
    message = _reject(module, checks.UNSUPPORTED_DTYPE, r"fed\.sum \(op 0, defining %1\)")
    assert "astype(jnp.int32)" in message


def test_round_results_must_be_at_the_server():
    module = fcir.capture(rounds.returns_client_values, *rounds.two_exchanges_args())
    _reject(module, checks.CLIENT_RESULT, r"fed\.map \(op \d+, defining %\d+\)")


def test_ill_typed_round():
    module = fcir.parse(rounds.ILL_TYPED_IR)
    message = _reject(module, checks.ILL_TYPED, r"fed\.mean \(op 0, defining %1\)")
    assert "fed.mean/C3" in message


def test_rejections_happen_before_any_lowering(monkeypatch):
    from fcir.interpreters.production import lowering

    def boom(*a, **k):
        raise AssertionError("lowered a round that is not exportable")

    monkeypatch.setattr(lowering, "hlo_module_proto", boom)
    with pytest.raises(fcir.ExportError):
        production.export(fcir.parse(rounds.PER_MEMBER_READ_IR))
