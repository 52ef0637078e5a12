"""Regression tests for the defects real programs hit (issue 10: 4, 8, 9, 11, 12).

Each test reproduces the program from the issue and runs it the way a user would.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from fcir.interpreters import production, reference, xla

import fcir
from fcir.check import verify

N = 3


# --- defect 8: a collective over the client's own vmap axis is local -----------------------


def _normalize(g):
    return jax.vmap(lambda r: r / jax.lax.psum(r, "batch"), axis_name="batch")(g)


@fcir.program(placements={"clients": N})
def normalized_mean(x):
    return fcir.reduce_mean(fcir.map_fn(_normalize, x))


def test_psum_over_a_vmap_axis_in_client_code_is_local(tmp_path):
    x = jnp.arange(1.0, 13.0).reshape(N, 4)
    m = fcir.capture(normalized_mean, x)  # checks: the psum's axis is not a placement
    assert "jax.psum" in m.to_text()
    assert verify(fcir.parse(m.to_text())) == []
    want = jax.jit(normalized_mean)(x)
    np.testing.assert_allclose(reference.run(m, x), want, rtol=1e-6)
    np.testing.assert_array_equal(xla.compile(m)(x), want)
    production.export(m).write(tmp_path / "b")
    np.testing.assert_allclose(production.run_bundle(tmp_path / "b", x), want, rtol=1e-6)


# --- defect 9: `fcir compile file.py:fn` on a file with future annotations and a dataclass --

_DATACLASS_PROGRAM = '''\
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import Array

import fcir


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Model:
    # Unqualified string annotations: dataclasses resolves them in sys.modules[__module__].
    w: Array
    b: Array


@fcir.program(placements={"clients": 3})
def step(model: Model, x: Array) -> Model:
    local = fcir.map_fn(lambda m, x: Model(m.w + x, m.b + 1.0), (fcir.broadcast(model), x))
    return fcir.reduce_mean(local)


EXAMPLE_ARGS = {"step": lambda: (Model(jnp.zeros(2), jnp.zeros(())), jnp.ones((3, 2)))}
'''


def test_cli_compiles_a_file_with_future_annotations_and_a_dataclass(tmp_path, capsys):
    from fcir import cli

    src = tmp_path / "dc_program.py"
    src.write_text(_DATACLASS_PROGRAM)
    code = cli.main(["compile", f"{src}:step", "--emit", "ir", "-o", str(tmp_path / "out")])
    out, err = capsys.readouterr()
    assert code == 0, err
    text = next((tmp_path / "out").glob("*.fcir")).read_text()
    assert "fed.mean" in text and "jax.add" in text
