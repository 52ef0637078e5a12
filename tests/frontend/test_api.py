"""The federated primitives and the program API, independent of capture."""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fcir


@fcir.program(placements={"clients": 4})
def mean_of_ints(x):
    return fcir.reduce_mean(x), fcir.reduce_mean(x > 1)


def test_mean_of_ints_and_bools_is_float32_in_type_and_value():
    x = jnp.arange(4, dtype=jnp.int32)
    declared = jax.eval_shape(mean_of_ints, x)
    assert [d.dtype for d in declared] == [jnp.float32, jnp.float32]
    for fn in (mean_of_ints, jax.jit(mean_of_ints)):
        value = fn(x)
        assert [v.dtype for v in value] == [jnp.float32, jnp.float32]
        np.testing.assert_allclose(value, [1.5, 0.5])


def test_cardinality_mismatch_is_a_placement_error_at_trace_time():
    @fcir.program(placements={"clients": 4})
    def round_(w, data):
        return fcir.reduce_sum(fcir.map_fn(lambda w, d: w * d, (fcir.broadcast(w), data)))

    with pytest.raises(fcir.PlacementError, match="cardinality of 'clients' \\(4\\)"):
        jax.make_jaxpr(round_)(jnp.ones(()), jnp.ones((3,)))
    with pytest.raises(fcir.PlacementError, match="not placed at 'clients'"):
        jax.eval_shape(mean_of_ints, jax.ShapeDtypeStruct((5,), jnp.int32))


def test_calls_outside_a_program_are_placement_errors():
    for call in (lambda: fcir.broadcast(1.0), lambda: fcir.reduce_sum(jnp.ones(3)),
                 lambda: fcir.map_fn(jnp.sin, jnp.ones(3))):
        with pytest.raises(fcir.PlacementError, match="@fcir.program"):
            call()


def test_nested_placements_address_the_placement_below():
    @fcir.program(placements={"silos": 2, "clients": 3})
    def two_level(w, x):
        def silo(w, x):
            return fcir.reduce_mean(fcir.map_fn(lambda w, x: w * x, (fcir.broadcast(w), x)))

        return fcir.reduce_sum(fcir.map_fn(silo, (fcir.broadcast(w), x)))

    x = jnp.arange(6.0).reshape(2, 3)
    np.testing.assert_allclose(two_level(2.0, x), 2.0 * (x.mean(1)).sum(), rtol=1e-6)
    with pytest.raises(fcir.PlacementError, match="directly below"):
        jax.make_jaxpr(fcir.program(placements={"silos": 2, "clients": 3})(
            lambda w: fcir.broadcast(w, to="clients")))(1.0)


def test_two_programs_interleave_from_threads():
    def make(n):
        @fcir.program(placements={"clients": n})
        def count(x):
            return fcir.reduce_sum(fcir.map_fn(lambda x: x + 1.0, fcir.broadcast(x)))

        return count

    programs = {n: make(n) for n in (2, 3, 5, 7)}
    results, errors = {}, []

    def work(n):
        try:
            for i in range(20):
                results[(n, i)] = float(programs[n](jnp.float32(i)))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(n,)) for n in programs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for (n, i), v in results.items():
        assert v == n * (i + 1.0)


def test_secure_sum_wraps_modulo_bitwidth():
    @fcir.program(placements={"clients": 3})
    def agg(x):
        return fcir.secure_sum(x, bitwidth=4)

    x = jnp.array([[7, 15], [8, 1], [9, 0]], jnp.int32)
    np.testing.assert_array_equal(agg(x), np.array([24, 16]) % 16)
    np.testing.assert_array_equal(jax.jit(agg)(x), np.array([24, 16]) % 16)
    with pytest.raises(fcir.IRTypeError, match="secure_sum/C4"):
        jax.make_jaxpr(agg)(jnp.ones((3, 2)))


def test_weighted_mean_takes_per_member_scalars_or_matching_pytrees():
    @fcir.program(placements={"clients": 2})
    def wm(x, w):
        return fcir.reduce_weighted_mean(x, w)

    x = {"a": jnp.array([[1.0, 2.0], [3.0, 4.0]]), "b": jnp.array([1.0, 3.0])}
    out = wm(x, jnp.array([1.0, 3.0]))
    np.testing.assert_allclose(out["a"], [2.5, 3.5])
    np.testing.assert_allclose(out["b"], 2.5)
    per_leaf = wm(x, {"a": jnp.array([[1.0, 0.0], [1.0, 1.0]]), "b": jnp.array([1.0, 1.0])})
    np.testing.assert_allclose(per_leaf["a"], [2.0, 4.0])


def test_vmap_of_a_program_batches_every_primitive():
    @fcir.program(placements={"clients": 3})
    def round_(w, x):
        local = fcir.map_fn(lambda w, x: w * x, (fcir.broadcast(w), x))
        return fcir.reduce_mean(local), fcir.reduce_max(local), fcir.reduce_weighted_mean(
            local, jnp.array([1.0, 2.0, 3.0]))

    ws = jnp.arange(2.0)
    x = jnp.arange(3.0)
    batched = jax.vmap(round_, in_axes=(0, None))(ws, x)
    for i, w in enumerate(ws):
        for b, e in zip(batched, round_(w, x)):
            np.testing.assert_allclose(b[i], e, rtol=1e-6)


def test_map_boundary_survives_in_the_jaxpr():
    @fcir.program(placements={"clients": 3})
    def round_(w, x):
        return fcir.reduce_sum(fcir.map_fn(lambda w, x: jnp.sin(w * x), (fcir.broadcast(w), x)))

    jaxpr = jax.make_jaxpr(round_)(1.0, jnp.ones(3)).jaxpr
    names = [e.primitive.name for e in jaxpr.eqns]
    assert names == ["fed_broadcast", "fed_map", "fed_sum"]
    body = jaxpr.eqns[1].params["body"].jaxpr
    assert "sin" in [e.primitive.name for e in body.eqns]
