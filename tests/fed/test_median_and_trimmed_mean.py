"""fcir.reduce_median and fcir.reduce_trimmed_mean: semantics on every backend, their
subgradient, their constraints while tracing, round trips, privacy and traffic.
(Corpus case robust_agg runs them through the corpus-wide checks; the production
round own:robust through the export tests; tests/interpreters/flower/test_flower_app.py through Flower.)"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fcir.interpreters import reference, xla

import fcir


def program(n: int, trim: int):
    @fcir.program(placements={"clients": n})
    def robust(x):
        return fcir.reduce_median(x), fcir.reduce_trimmed_mean(x, trim=trim)

    return robust


def numpy_robust(x: np.ndarray, trim: int):
    n = x.shape[0]
    return np.median(x, axis=0), np.sort(x, axis=0)[trim : n - trim].mean(axis=0)


@pytest.mark.parametrize("n, trim", [(5, 1), (6, 2), (4, 0), (1, 0)])
def test_every_backend_computes_numpys_median_and_trimmed_mean(n, trim):
    rng = np.random.default_rng(n)
    x = rng.normal(size=(n, 3, 2)).astype(np.float32)
    x[:, 0, 0] = 1.5  # a coordinate where every member ties
    want = numpy_robust(x, trim)
    f = program(n, trim)
    module = fcir.capture(f, x)
    for got in (f(x), jax.jit(f)(x), reference.run(module, x), xla.compile(module)(x)):
        np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
        np.testing.assert_allclose(got[1], want[1], rtol=1e-6)


def test_text_and_protobuf_round_trips_keep_the_ops():
    x = jnp.ones((5, 3))
    module = fcir.capture(program(5, 2), x)
    text = module.to_text()
    assert "fed.median %0" in text and "fed.trimmed_mean %0 {trim=2}" in text
    assert fcir.parse(text).to_text() == text
    again = fcir.Module.deserialize(module.serialize())
    assert again.to_text() == text
    np.testing.assert_array_equal(reference.run(again, x)[1], reference.run(module, x)[1])


def _weights(f, x, which: int):
    return jax.grad(lambda x: jnp.sum(f(x)[which]))(x)


def test_subgradient_without_ties_is_the_sorted_positions_weight():
    x = jnp.asarray(np.random.default_rng(0).permutation(7 * 3).reshape(7, 3), jnp.float32)
    f = program(7, 2)
    plain = jax.grad(
        lambda x: jnp.sum(jnp.sort(x, 0)[3]) + jnp.sum(jnp.mean(jnp.sort(x, 0)[2:5], 0))
    )
    got = _weights(f, x, 0) + _weights(f, x, 1)
    np.testing.assert_allclose(got, plain(x), rtol=1e-6)


def test_subgradient_shares_the_weight_of_tied_members_equally():
    # Sorted: 0 1 1 1 5 9; median = 1 (three tied members share 1); trim=1 keeps
    # positions 1..4 = 1 1 1 5: the tied 1s share 3/4, the 5 gets 1/4.
    x = jnp.asarray([[9.0], [1.0], [5.0], [1.0], [0.0], [1.0]])
    f = program(6, 1)
    med, tm = _weights(f, x, 0)[:, 0], _weights(f, x, 1)[:, 0]
    np.testing.assert_allclose(med, [0, 1 / 3, 0, 1 / 3, 0, 1 / 3], rtol=1e-6)
    np.testing.assert_allclose(tm, [0, 1 / 4, 1 / 4, 1 / 4, 0, 1 / 4], rtol=1e-6)


def test_even_median_splits_between_the_two_middle_members():
    x = jnp.asarray([[4.0], [1.0], [3.0], [2.0]])
    med = _weights(program(4, 0), x, 0)[:, 0]
    np.testing.assert_allclose(med, [0, 0, 0.5, 0.5])


def test_gradient_program_is_federated_and_runs_on_every_backend():
    x = jnp.asarray(np.random.default_rng(2).normal(size=(5, 3)), jnp.float32)
    f = program(5, 1)
    grad = jax.grad(lambda x: jnp.sum(f(x)[0]) + 2.0 * jnp.sum(f(x)[1]))
    module = fcir.capture(grad, x)  # checks: no client-to-client op in the derivative
    want = grad(x)
    np.testing.assert_allclose(reference.run(module, x), want, rtol=1e-6)
    np.testing.assert_allclose(xla.compile(module)(x), want, rtol=1e-6)
    np.testing.assert_allclose(
        jax.jvp(lambda x: f(x)[1], (x,), (jnp.ones_like(x),))[1], np.ones(3), rtol=1e-6
    )


def test_the_gradient_reaches_the_members_the_sort_chose_at_xla_optimization_level_0():
    """Members that take a gradient step (a dot, a mean), the gradient program compiled
    at XLA's optimization level 0, unchunked and streamed (k = 3 of 7, the last chunk
    ragged): the median's and trimmed mean's gradients are plain JAX's (a sort's). They
    found the member at an edge by value == edge, and the value another fusion (or the
    streamed backward pass) recomputed came out ulps away: the median's gradient was
    0.85 off unchunked and NaN streamed with k = 1. The member is now found by the index
    the sort recorded (fed.band_edges, fed.member_index)."""
    from fcir.interpreters.xla.interpreter import XlaInterpreter
    from fcir.interpreters.xla.streaming import StreamingInterpreter

    n = 7

    def step(w, x, y):
        return w - 0.1 * jax.grad(lambda w: jnp.mean(jnp.square(x @ w - y)))(w)

    @fcir.program(placements={"clients": n})
    def robust(w, x, y):
        upd = fcir.map_fn(step, (fcir.broadcast(w), x, y))
        return fcir.reduce_median(upd), fcir.reduce_trimmed_mean(upd, trim=1)

    def plain(w, x, y):  # the same in plain JAX: a sort's gradient
        s = jnp.sort(jax.vmap(step, (None, 0, 0))(w, x, y), axis=0)
        return s[3], jnp.mean(s[1:6], axis=0)

    def loss(f):
        return lambda *a: sum(jnp.sum(o * jnp.arange(1.0, 5.0)) for o in f(*a))

    rng = np.random.default_rng(21)
    args = [rng.normal(size=s).astype(np.float32) for s in [(4,), (n, 6, 4), (n, 6)]]
    args[2][3] *= 1000.0
    grad = jax.grad(loss(robust), argnums=(0, 1))
    module = fcir.capture(grad, *args)

    def every_budget(*a):
        return XlaInterpreter().run(module, *a), [
            StreamingInterpreter(clients_per_step=k).run(module, *a) for k in (1, 3)
        ]

    level_0 = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
    got, streamed = jax.jit(every_budget).lower(*args).compile(level_0)(*args)
    want = jax.grad(loss(plain), argnums=(0, 1))(*args)
    for g in (got, *streamed):
        for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(want)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def test_vmap_over_a_batch_of_client_values():
    xs = jnp.asarray(np.random.default_rng(3).normal(size=(2, 5, 3)), jnp.float32)
    f = program(5, 1)
    med, tm = jax.vmap(f)(xs)
    for b in range(2):
        want = numpy_robust(np.asarray(xs[b]), 1)
        np.testing.assert_allclose(med[b], want[0], rtol=1e-6)
        np.testing.assert_allclose(tm[b], want[1], rtol=1e-6)


def test_tracing_cites_the_constraint_tables():
    f = program(4, 1)
    with pytest.raises(fcir.IRTypeError, match=r"fed\.median/C4: operand must be a floating"):
        jax.make_jaxpr(f)(jnp.ones((4, 2), jnp.int32))

    @fcir.program(placements={"clients": 4})
    def too_much(x):
        return fcir.reduce_trimmed_mean(x, trim=2)

    with pytest.raises(fcir.IRTypeError, match=r"fed\.trimmed_mean/C5: attribute 'trim'"):
        jax.make_jaxpr(too_much)(jnp.ones((4, 2)))

    @fcir.program(placements={"clients": 4})
    def not_int(x):
        return fcir.reduce_trimmed_mean(x, trim=1.0)

    with pytest.raises(fcir.PlacementError, match="trim must be an int"):
        jax.make_jaxpr(not_int)(jnp.ones((4, 2)))


def test_a_private_program_may_not_release_a_median_without_noise():
    @fcir.program(placements={"clients": 4}, private=True)
    def leaky(x):
        return fcir.reduce_median(x)

    with pytest.raises(fcir.PrivacyError, match="privacy/C1: fed.median releases"):
        fcir.capture(leaky, jnp.ones((4, 3)))


def test_traffic_counts_every_members_value_and_cost_reports_it():
    from fcir.report import traffic

    module = fcir.capture(program(5, 1), jnp.ones((5, 3)))
    assert traffic.communication_bytes(module) == {
        "clients": {"broadcast": 0, "aggregate": 2 * 5 * 3 * 4}
    }
    report = xla.compile(module).cost()
    assert report["flops"] >= 0 and report["placements"]


def test_export_says_the_aggregator_sees_every_value(tmp_path):
    import json

    from fcir.interpreters import production
    from fcir.interpreters.production import splitting

    assert "every client's value" in str(splitting.OP_RULES[fcir.fed.Median])
    x = jnp.asarray(np.random.default_rng(4).normal(size=(5, 3)), jnp.float32)
    module = fcir.capture(program(5, 1), x)
    plan = production.export(module)
    plan.write(tmp_path / "b")
    aggs = json.loads((tmp_path / "b" / "manifest.json").read_text())["aggregations"]
    assert [(a["fed_op"], a["intrinsic"], a.get("attrs")) for a in aggs] == [
        ("fed.median", "federated_aggregate", None),
        ("fed.trimmed_mean", "federated_aggregate", {"trim": 1}),
    ]
    got = production.run_bundle(tmp_path / "b", x)
    want = numpy_robust(np.asarray(x), 1)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-6)


# --- NaN members: NaN out (np.median, jnp.median, scipy.stats.trim_mean), zero gradient -----


def _with_nans(n: int) -> np.ndarray:
    x = np.random.default_rng(10 + n).normal(size=(n, 3)).astype(np.float32)
    x[1, 0] = np.nan  # one NaN member: a sort would rank it largest and trim it away
    x[:, 2] = np.nan  # every member NaN
    return x


def _numpy_robust_nan(x: np.ndarray, trim: int):
    # np.median gives NaN for a coordinate with a NaN; the trimmed mean likewise
    # (scipy.stats.trim_mean's default nan_policy='propagate').
    med, tm = numpy_robust(x, trim)
    bad = np.isnan(x).any(axis=0)
    return np.where(bad, np.nan, med), np.where(bad, np.nan, tm)


@pytest.mark.parametrize("n, trim", [(5, 1), (6, 2), (4, 1)])
def test_a_nan_member_makes_its_coordinate_nan_on_every_backend(n, trim, tmp_path):
    from fcir.interpreters import production
    from fcir.interpreters.flower.app import runtime

    x = _with_nans(n)
    want = _numpy_robust_nan(x, trim)
    np.testing.assert_array_equal(want[0], np.asarray(jnp.median(jnp.asarray(x), axis=0)))
    assert np.isnan(want[0][0]) and not np.isnan(want[0][1])
    f = program(n, trim)
    module = fcir.capture(f, x)
    plan = production.export(module)
    plan.write(tmp_path / "b")
    gathered = [
        runtime._server_aggregate(cls.server_aggregate_source())(x, **attrs)
        for cls, attrs in ((fcir.fed.Median, {}), (fcir.fed.TrimmedMean, {"trim": trim}))
    ]
    for got in (
        f(x),
        jax.jit(f)(x),
        reference.run(module, x),
        xla.compile(module)(x),
        production.run_bundle(tmp_path / "b", x),
        gathered,  # what the Flower ServerApp computes from the replies
    ):
        np.testing.assert_allclose(np.asarray(got[0]), want[0], rtol=1e-6)
        np.testing.assert_allclose(np.asarray(got[1]), want[1], rtol=1e-6)


def _plain_trimmed_mean(x, trim: int):  # plain JAX, NaN propagating as the median does
    n = x.shape[0]
    mean = jnp.mean(jnp.sort(x, axis=0)[trim : n - trim], axis=0)
    return jnp.where(jnp.isnan(x).any(axis=0), jnp.nan, mean)


@pytest.mark.parametrize("n, trim", [(5, 1), (6, 2), (4, 1)])
def test_the_gradient_at_a_nan_member_is_plain_jaxs(n, trim):
    x = jnp.asarray(_with_nans(n))
    f = program(n, trim)
    want_med = jax.grad(lambda x: jnp.sum(jnp.median(x, axis=0)))(x)
    want_tm = jax.grad(lambda x: jnp.sum(_plain_trimmed_mean(x, trim)))(x)
    # The NaN coordinates get zero, the clean one the sorted positions' weights.
    assert not np.isnan(np.asarray(want_med)).any() and np.asarray(want_med)[:, 1].sum() == 1
    np.testing.assert_allclose(_weights(f, x, 0), want_med, rtol=1e-6)
    np.testing.assert_allclose(_weights(f, x, 1), want_tm, rtol=1e-6)
    grad = jax.grad(lambda x: jnp.sum(f(x)[0]) + 2.0 * jnp.sum(f(x)[1]))
    module = fcir.capture(grad, x)
    want = want_med + 2.0 * want_tm
    np.testing.assert_allclose(reference.run(module, x), want, rtol=1e-6)
    np.testing.assert_allclose(xla.compile(module)(x), want, rtol=1e-6)
