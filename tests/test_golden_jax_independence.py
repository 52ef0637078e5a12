"""The goldens are one set for every supported JAX: capture pins the derivative rules
that changed after JAX 0.10.2 (fcir/jaxcompat/ad_rules.py), so a gradient captures to
the same equations, and IR written under a newer JAX runs under 0.10."""

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


def test_goldens_are_one_set_with_no_per_version_directory():
    # Every corpus program and gradient prints the same text under every supported JAX
    # (CI compares these goldens under jax 0.10.2 and 0.12): a golden/jax<X.Y>/ would
    # mean capture depends on the JAX again.
    assert [p.name for p in GOLDEN_DIR.iterdir() if p.is_dir()] == []
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
