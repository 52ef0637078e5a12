"""The goldens are one set for every supported JAX but the few STILL_PER_VERSION lists:
capture pins the derivative rules that changed after JAX 0.10.2
(fcir/jaxcompat/ad_rules.py), so a gradient captures to the same equations, and IR
written under a newer JAX runs under 0.10."""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fcir.interpreters import reference

import fcir
from fcir.jaxcompat import ad_rules

GOLDEN_DIR = pathlib.Path(__file__).parent / "golden"


# Goldens that still differ under a JAX and so keep a copy in golden/jax<X.Y>/: only ever
# remove names from here (a new per-version golden means capture depends on the JAX
# again). Both differ in what JAX 0.12's own transposition and partial evaluation do,
# which a canonicalizing pass could undo only by moving the IR away from what that JAX's
# jax.jit computes (ir.md guarantee 1: bitwise, equal flops):
# - diloco_grad: 0.12 adds three cotangents of the outer momentum in another order
#   (other bits) and passes the literals 0.9/0.999 of Adam's bias correction to the
#   forward scan as constant operands;
# - fedavg_transformer_grad: 0.10.2 saves 21 residuals of the inner scans twice (0.12
#   once); merging them changes XLA's flops against 0.10.2's jax.jit.
STILL_PER_VERSION = {"jax0.12": {"diloco_grad", "fedavg_transformer_grad"}}


def test_no_golden_has_a_per_version_copy_beyond_the_known_ones():
    found = {d.name: {p.stem for p in d.glob("*.fcir")} for d in GOLDEN_DIR.iterdir() if d.is_dir()}
    assert found == STILL_PER_VERSION
    assert len(list(GOLDEN_DIR.glob("*.fcir"))) >= 21


@jax.jit
def _activations(x):
    half = 0.5 * x
    return jnp.tanh(x) + jnp.arcsin(half) + jnp.arccos(half) + jnp.arctanh(half)


def _loss(x):
    return jnp.sum(_activations(x) ** 2)


def test_gradient_of_tanh_and_inverse_trig_captures_without_one_minus_square():
    x = np.linspace(-0.9, 0.9, 6, dtype=np.float32)
    # JAX caches the derivative of the jitted function with its own rules first (JAX
    # 0.12: one_minus_square); capture must not pick that up.
    expected = jax.grad(_loss)(x)
    jaxpr_before = str(jax.make_jaxpr(jax.grad(_loss))(x))
    module = fcir.capture(jax.grad(_loss), x)
    text = module.to_text()
    assert "one_minus_square" not in text
    assert "jax.tanh" in text and "jax.asin" in text and "jax.atanh" in text
    np.testing.assert_allclose(reference.run(module, x), expected, rtol=1e-5, atol=1e-6)
    # Outside capture JAX differentiates with its own rules again.
    assert str(jax.make_jaxpr(jax.grad(_loss))(x)) == jaxpr_before


def test_capture_restores_jax_rules_when_tracing_fails():
    def broken(x):
        return jnp.tanh(x) @ jnp.ones((5, 5))  # shapes do not match

    jaxpr_before = str(jax.make_jaxpr(jax.grad(lambda v: jnp.tanh(v).sum()))(np.ones(3)))
    with pytest.raises(TypeError):
        fcir.capture(jax.grad(lambda v: broken(v).sum()), np.ones(3, np.float32))
    assert ad_rules._DEPTH == 0 and not ad_rules._SAVED and not ad_rules._SAVED_METHODS
    jaxpr_after = str(jax.make_jaxpr(jax.grad(lambda v: jnp.tanh(v).sum()))(np.ones(3)))
    assert jaxpr_after == jaxpr_before


@pytest.mark.skipif(not ad_rules.pins_rules(), reason="JAX 0.10 differentiates with its own rules")
def test_pinned_is_reentrant_and_restores_on_exit():
    with ad_rules.pinned():
        with ad_rules.pinned():
            assert ad_rules._DEPTH == 2
        assert ad_rules._DEPTH == 1
    assert ad_rules._DEPTH == 0 and not ad_rules._SAVED and not ad_rules._SAVED_METHODS
