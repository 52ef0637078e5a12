"""docs/ops.md is generated from the code (tools/gen_ops_doc.py) and is current, and
fcir's local-op schema is what capture writes under the running JAX."""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from examples_testing import tool
from fcir.interpreters import reference

import fcir
from fcir.jaxcompat import schema

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _tool():
    return tool("gen_ops_doc")


def test_ops_doc_is_current():
    assert _tool().main(["--check"]) == 0, "run: python tools/gen_ops_doc.py"


def test_ops_doc_lists_every_fed_op_and_every_fixed_attribute():
    text = (ROOT / "docs" / "ops.md").read_text()
    for cls in _tool()._fed_ops():
        assert f"| `{cls.name}` |" in text
    for prim, attrs in schema.SCHEMA.items():
        for key in attrs:
            assert f"| `jax.{prim}` | `{key}` |" in text


@fcir.program(placements={"clients": 2})
def _scan_and_inline(w, x):
    def body(c, xi):
        return c * w + xi, jnp.min(c)

    c, ys = jax.lax.scan(body, w, x)
    inner = jax.jit(lambda a: jnp.clip(a, 0.0, 1.0) * 2.0, inline=True)(c)
    return inner, jnp.max(ys)


def test_capture_writes_fcir_attributes_whatever_the_jax():
    module = fcir.capture(_scan_and_inline, jnp.ones(3), jnp.ones((4, 3)))
    all_ops = [op for _, op in fcir.ir.walk(module.main.body)]
    ops = {op.name: op for op in all_ops}
    scan = ops["jax.scan"]
    assert {"num_consts", "num_carry"} <= set(scan.attrs) and "ft_in" not in scan.attrs
    assert (scan.attrs["num_consts"], scan.attrs["num_carry"]) == (1, 1)
    # jit(inline=True) is inlined while tracing, as JAX 0.10 did: no jax.jit op is left
    jits = [op.attrs["name"] for op in all_ops if op.name == "jax.jit"]
    assert "<lambda>" not in jits and "clip" in jits
    for name in ("jax.reduce_min", "jax.reduce_max"):
        assert "out_sharding" not in ops[name].attrs
    args = (jnp.ones(3), jnp.ones((4, 3)))
    got, want = reference.run(module, *args), jax.jit(_scan_and_inline)(*args)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-6)


def test_schema_translation_round_trips_for_the_running_jax():
    closed = jax.make_jaxpr(lambda c, x: jax.lax.scan(lambda c, x: (c + x, c), c, x))(
        1.0, jnp.ones(3)
    )
    eqn = closed.jaxpr.eqns[0]
    params = schema.to_fcir("scan", eqn.params)
    assert (params["num_consts"], params["num_carry"]) == schema.scan_counts(eqn.params)
    back = schema.to_jax("scan", params)
    assert set(back) == set(eqn.params)
    outs = eqn.primitive.bind(1.0, jnp.ones(3), **back)
    np.testing.assert_allclose(outs[0], 4.0)
