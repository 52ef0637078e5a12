"""JAX ops real client code uses: a psum over the client's own vmap axis is local;
max-pool gradients (select_and_scatter_add), jax.debug.print and a variadic
lax.reduce capture, check, round-trip and run; what has no plain data form is
refused by name, and a round that prints is not exportable."""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fcir.interpreters import production, reference, xla

import fcir
from fcir.checker.check import verify
from fcir.ir import Module

N = 3


_Pair = collections.namedtuple("_Pair", "a b")


# --- a collective over the client's own vmap axis is local -----------------------


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


# --- max-pool gradients, jax.debug.print and lax.reduce in client code --------


def _maxpool(x):  # NHWC, 2x2 windows
    return jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")


def _cnn_loss(params, images, labels):
    h = jax.lax.conv_general_dilated(
        images, params["conv"], (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )
    h = _maxpool(jax.nn.relu(h)).reshape(images.shape[0], -1)
    logits = h @ params["dense"]
    return -jnp.mean(jnp.sum(jax.nn.log_softmax(logits) * labels, -1))


@fcir.program(placements={"clients": N})
def cnn_round(params, images, labels):
    """One FedAvg round of a CNN with max pooling: the client step's gradient holds
    select_and_scatter_add."""

    def client(params, images, labels):
        grads = jax.grad(_cnn_loss)(params, images, labels)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

    return fcir.reduce_mean(fcir.map_fn(client, (fcir.broadcast(params), images, labels)))


@fcir.program(placements={"clients": N})
def printing_round(x):
    def client(x):
        jax.debug.print("member sum={s} first={}", x[0], s=jnp.sum(x))
        return x * 2.0

    return fcir.reduce_sum(fcir.map_fn(client, x))


@fcir.program(placements={"clients": N})
def custom_reduce_round(x):
    def client(x):  # a variadic reduction no monoid fast path covers: the region is kept
        def comp(a, b):
            return a[0] + b[0] * b[1], jnp.maximum(a[1], b[1])

        return jax.lax.reduce((x, x), (0.0, -jnp.inf), comp, (0,))

    return fcir.reduce_sum(fcir.map_fn(client, x))


def _cnn_args():
    k1, k2, k3, k4 = jax.random.split(jax.random.key(0), 4)
    params = {
        "conv": 0.3 * jax.random.normal(k1, (3, 3, 1, 2)),
        "dense": 0.3 * jax.random.normal(k2, (2 * 3 * 3, 3)),
    }
    images = jax.random.normal(k3, (N, 2, 6, 6, 1))
    labels = jax.nn.one_hot(jax.random.randint(k4, (N, 2), 0, 3), 3)
    return params, images, labels


NEW_OPS = {
    "cnn_round": (cnn_round, _cnn_args, "jax.select_and_scatter_add"),
    "printing_round": (printing_round, lambda: (jnp.arange(12.0).reshape(N, 4),), "jax.debug_print"),
    "custom_reduce_round": (
        custom_reduce_round, lambda: (jnp.arange(24.0).reshape(N, 4, 2) / 7,), "jax.reduce"
    ),
}


@pytest.mark.parametrize("name", sorted(NEW_OPS))
def test_ops_real_programs_need_capture_check_round_trip_and_run(name, capsys):
    fn, make_args, op = NEW_OPS[name]
    args = make_args()
    m = fcir.capture(fn, *args)  # captures and checks
    text = m.to_text()
    assert op in text
    parsed, reread = fcir.parse(text), Module.deserialize(m.serialize())
    assert parsed.to_text() == text and reread.to_text() == text
    assert reread.serialize() == m.serialize()
    capsys.readouterr()
    want = jax.jit(fn)(*args)
    printed = sorted(capsys.readouterr().out.splitlines())
    # (The parsed and deserialized modules print to the same text: running one of them is
    # running what the IR file holds.)
    for run in (lambda: reference.run(m, *args), lambda: xla.compile(reread)(*args)):
        got = run()
        # A debug print runs again wherever the module runs, once per member.
        assert sorted(capsys.readouterr().out.splitlines()) == printed
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-6, atol=1e-7),
                     got, want)
    if op == "jax.debug_print":
        assert len(printed) == N and printed[0].startswith("member sum=")


def test_what_has_no_plain_data_form_is_refused_by_name():
    x = jnp.ones((N, 2))

    @fcir.program(placements={"clients": N})
    def calls_back(x):
        def client(x):
            jax.debug.callback(print, x)
            return x

        return fcir.reduce_sum(fcir.map_fn(client, x))

    with pytest.raises(fcir.UnsupportedError, match=r"jax\.debug_callback: param callback .*jax\.debug\.callback"):
        fcir.capture(calls_back, x)

    @fcir.program(placements={"clients": N})
    def prints_a_namedtuple(x):
        def client(x):
            jax.debug.print("{}", _Pair(x, x))
            return x

        return fcir.reduce_sum(fcir.map_fn(client, x))

    with pytest.raises(fcir.UnsupportedError, match=r"in_tree holds a pytree node of class _Pair"):
        fcir.capture(prints_a_namedtuple, x)
    # An IR file may name only the comparison primitives JAX passes as params.
    @fcir.program(placements={"clients": N})
    def pool_grad(x):
        return fcir.reduce_sum(fcir.map_fn(jax.grad(lambda x: jnp.sum(_maxpool(x))), x))

    x = jnp.ones((N, 1, 2, 2, 1))
    text = fcir.capture(pool_grad, x).to_text()
    forged = fcir.parse(text.replace("#Primitive.ge", "#Primitive.debug_callback"))
    with pytest.raises(fcir.FcirError, match=r"#Primitive\.debug_callback: only ge, gt, le, lt"):
        reference.run(forged, x)


def test_a_round_that_prints_is_not_exportable():
    from fcir.interpreters.production import checks

    m = fcir.capture(printing_round, jnp.ones((N, 4)))
    with pytest.raises(fcir.ExportError, match=rf"jax\.debug_print \(op 0/0/\d+\): {checks.HOST_PRINT}"):
        production.export(m)
