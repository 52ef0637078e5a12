"""Production export errors name the user's ops (not those of the DP decomposition),
and a bundle written over a file keeps the file."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from fcir.interpreters import production

import fcir

N = 4


@fcir.program(placements={"clients": 3})
def _mean_update(w, x):
    return fcir.reduce_mean(fcir.map_fn(lambda w, x: x - w, (fcir.broadcast(w), x)))


# --- export errors name the user's ops, not those of the DP decomposition -------


@fcir.program(placements={"clients": N}, private=True)
def _two_dp_exchanges(w, x, key):
    k1, k2 = jax.random.split(key)
    d1 = fcir.dp_mean(fcir.map_fn(lambda w, x: x - w, (fcir.broadcast(w), x)), 1.0, 1.0, k1)
    w2 = w + d1
    d2 = fcir.dp_mean(fcir.map_fn(lambda w, x: x * w, (fcir.broadcast(w2), x)), 1.0, 1.0, k2)
    return w2 + d2


def test_export_refusal_of_two_dp_exchanges_names_the_users_ops():
    module = fcir.capture(_two_dp_exchanges, jnp.zeros(3), jnp.ones((N, 3)), jax.random.key(0))
    # The ops the message must name, as the user's IR numbers them (main's ops are the
    # lines indented once; how JAX traces the key split differs between versions).
    body = [line.strip() for line in module.to_text().splitlines() if line.startswith("  %")]

    def where(op_name, k):
        i = [j for j, line in enumerate(body) if f"= {op_name} " in line][k]
        return f"{op_name} (op {i}, defining {body[i].split(':')[0]})"

    with pytest.raises(fcir.ExportError) as info:
        production.export(module)
    message = str(info.value)
    assert where("fed.broadcast", 1) in message
    assert where("fed.dp_mean", 0) + ", at its fed.sum in production" in message


def test_a_production_bundle_written_over_a_file_is_an_fcir_error_and_keeps_the_file(tmp_path):
    from fcir.interpreters import production

    module = fcir.capture(_mean_update, jnp.zeros(2), jnp.ones((3, 2)))
    ir_file = tmp_path / "round.fcir"
    ir_file.write_text(module.to_text())
    with pytest.raises(fcir.FcirError, match="is a file, not a directory"):
        production.export(module).write(ir_file)
    assert fcir.parse(ir_file.read_text()).to_text() == module.to_text()
