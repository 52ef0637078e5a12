"""DP programs under JAX transformations: a function that calls a private program is
private, whatever wraps the call (grad, vmap, jit, custom_vjp, a scan body), and
``jax.vmap`` of a DP round captures, checks and runs like ``jax.jit``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fcir.interpreters import reference, xla

import fcir

N = 4
W = jnp.asarray([0.5, -1.0, 2.0], jnp.float32)
WS = jnp.stack([W, 2.0 * W, -W])
KEY = jax.random.key(5)
X = jnp.asarray(np.random.default_rng(1).normal(size=(N, 3)), jnp.float32)


def dp_round(private=True):
    @fcir.program(placements={"clients": N}, private=private)
    def private_round(w, key, x):
        upd = fcir.map_fn(
            lambda w, x: {"a": x - w, "b": jnp.sum(x * w)[None]}, (fcir.broadcast(w), x)
        )
        out = fcir.dp_mean(upd, 1.0, 0.9, key)
        return w + out["a"] + out["b"]

    return private_round


def outer(fn):
    """Captured as a plain (not private) program."""
    return fcir.program(placements={"clients": N})(fn)


def runs_like_jit(program, *args):
    module = fcir.capture(program, *args)
    want = jax.jit(program)(*args)
    np.testing.assert_allclose(reference.run(module, *args), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(xla.compile(module)(*args), want)
    return module


def test_the_gradient_of_a_loss_of_a_private_round_is_private_and_its_leak_rejected():
    private_round = dp_round()

    def loss(out):
        return jnp.sum(out**2)

    # d loss / d w sums un-noised per-client derivatives at the server: a leak.
    grad = jax.grad(lambda w, k, x: loss(private_round(w, k, x)))
    with pytest.raises(fcir.PrivacyError, match=r"^fed.sum \(op .*privacy/C1"):
        fcir.capture(outer(grad), W, KEY, X)
    with pytest.raises(fcir.PrivacyError, match="privacy/C1"):
        fcir.capture(grad, W, KEY, X)
    # The same gradient of the round not declared private is an ordinary program.
    public = dp_round(private=False)
    runs_like_jit(outer(jax.grad(lambda w, k, x: loss(public(w, k, x)))), W, KEY, X)
    # A wrapper that adds its own plain aggregate of the client data is checked too.
    with pytest.raises(fcir.PrivacyError, match=r"^fed.mean \(op .*privacy/C1"):
        fcir.capture(outer(lambda w, k, x: private_round(w, k, x) + fcir.reduce_mean(x)), W, KEY, X)


@jax.custom_vjp
def _through(w, key, x):
    return dp_round()(w, key, x)


def _through_fwd(w, key, x):
    return _through(w, key, x), None


def _through_bwd(_, g):
    return g, None, None


_through.defvjp(_through_fwd, _through_bwd)


@pytest.mark.slow  # 10 s: four transformations of a private round (docs/contributing.md)
def test_jit_vmap_scan_bodies_and_custom_vjp_around_a_private_round_are_private():
    private_round = dp_round()

    def in_scan(w, key, x):
        def body(w, i):
            return private_round(w, jax.random.fold_in(key, i), x), None

        return jax.lax.scan(body, w, jnp.arange(3))[0]

    wrapped = {
        "jit": (jax.jit(lambda w, k, x: 2.0 * private_round(w, k, x)), (W, KEY, X)),
        "vmap": (
            lambda ws, k, x: jax.vmap(private_round, (0, 0, None))(ws, jax.random.split(k, 3), x),
            (WS, KEY, X),
        ),
        "scan body": (in_scan, (W, KEY, X)),
        "custom_vjp": (_through, (W, KEY, X)),
    }
    for name, (fn, args) in wrapped.items():
        module = runs_like_jit(outer(fn), *args)
        assert module.private, name
        assert module.to_text().splitlines()[0].endswith(" private"), name
    # Not calling a private program, a module is not private.
    assert not fcir.capture(outer(jax.jit(dp_round(private=False))), W, KEY, X).private


@pytest.mark.slow  # 11 s: a vmapped dp round on every backend (docs/contributing.md)
def test_vmap_of_a_dp_round_over_server_models_checks_and_runs_like_jit():
    # The DP batching rule takes each model's slice of the client values inside a
    # fed.map (a slice at the server of client data is client-to-client communication).
    public = dp_round(private=False)
    module = runs_like_jit(outer(jax.vmap(public, (0, None, None))), WS, KEY, X)
    assert [op.name for op in module.main.body.ops].count("fed.dp_mean") == 3
    # Private, each model's release needs its own key...
    private_round = dp_round()
    runs_like_jit(
        outer(
            lambda ws, k, x: jax.vmap(private_round, (0, 0, None))(ws, jax.random.split(k, 3), x)
        ),
        WS,
        KEY,
        X,
    )
    # ...one key for all three draws one noise three times: the difference of two
    # models' releases would be noise-free.
    with pytest.raises(fcir.PrivacyError, match="privacy/C4"):
        fcir.capture(outer(jax.vmap(private_round, (0, None, None))), WS, KEY, X)
    # Batched over client data too (one data set per model).
    xs = jnp.stack([X, 2.0 * X, X - 1.0], axis=1)  # [clients, models, 3]
    runs_like_jit(outer(jax.vmap(public, (0, None, 1))), WS, KEY, xs)
