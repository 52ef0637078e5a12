"""Client data declared with ``@fcir.program(client_data=...)``: read only through
map_fn's arguments (never through a closure or whole at the server), checked
against the cohort, and a server value given to map_fn says to broadcast it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import fcir

N = 4


@fcir.program(placements={"clients": N}, private=True)
def _dp_round(w, key, x):
    upd = fcir.map_fn(lambda w, x: x - w, (fcir.broadcast(w), x))
    return w + fcir.dp_mean(upd, 1.0, 1.1, key)


# --- client data that never goes through map_fn's arguments ----------------------------------

_X = jnp.arange(12.0).reshape(N, 3)


def test_declared_client_data_read_through_a_closure_is_refused():
    """Before: with ``client_data=("x",)`` declared, a map_fn body that closed over ``x``
    captured: ``x`` was typed a server value and broadcast, so every client computed on
    all clients' data (what jit computes too, so no backend disagreed)."""

    @fcir.program(placements={"clients": N}, client_data=("x",))
    def round_(w, x):
        return fcir.reduce_mean(fcir.map_fn(lambda w: w * jnp.mean(x), fcir.broadcast(w)))

    with pytest.raises(fcir.PlacementError, match="'x' is declared client data .* closure"):
        fcir.capture(round_, jnp.ones(3), _X)


def _leaky_closure(w, key, x):
    return fcir.dp_mean(fcir.map_fn(lambda w: w * jnp.mean(x), fcir.broadcast(w)), 1.0, 1.0, key)


def _leaky_server_read(w, key, x):
    upd = fcir.map_fn(lambda w: w, fcir.broadcast(w))
    return fcir.dp_mean(upd, 1.0, 1.0, key) + jnp.mean(x)


@pytest.mark.parametrize("body", [_leaky_closure, _leaky_server_read], ids=["closure", "server"])
def test_a_private_program_that_reads_declared_client_data_at_the_server_is_rejected(body):
    """Before: the private check follows client-*placed* values only; client data read
    whole at the server (directly, or by a closure in map_fn) is typed a server value, so
    ``jnp.mean(x)`` over every client's data reached the server un-noised and passed.
    Declaring the client data is how a private program says which arguments they are
    (undeclared, fcir cannot tell ``x`` from a model with the cohort's leading axis)."""
    declared = fcir.program(placements={"clients": N}, private=True, client_data=("x",))(body)
    with pytest.raises(fcir.PlacementError, match="'x' is declared client data"):
        fcir.capture(declared, jnp.ones(3), jax.random.key(0), _X)
    # passed to map_fn, the same data is client data and the round checks
    ok = fcir.program(placements={"clients": N}, private=True, client_data=("x",))(
        _dp_round.__wrapped__
    )
    fcir.capture(ok, jnp.ones(3), jax.random.key(0), _X)


# --- declaring client data; forgetting fcir.broadcast ------------------------------


def _local(w, x):
    return w - 0.1 * x


def test_a_server_model_with_the_cohorts_leading_axis_is_refused_when_client_data_is_declared():
    @fcir.program(placements={"clients": N}, client_data=("x",))
    def forgot(w, x):
        return fcir.reduce_mean(fcir.map_fn(_local, (w, x)))

    # w is f32[4, 3]: its leading axis equals the cohort, so undeclared it would be
    # silently typed client data and the round would train the wrong thing.
    undeclared = fcir.capture(fcir.program(placements={"clients": N})(forgot.__wrapped__),
                              jnp.ones((N, 3)), jnp.ones((N, 3)))
    assert str(undeclared.main.body.params[0].type) == "{f32[3]}@clients"
    with pytest.raises(fcir.PlacementError, match=r"argument 'w' \(%0: \{f32\[3\]\}@clients\) "
                       r"is used as client data.*did you mean fcir.broadcast\(w\)\?"):
        fcir.capture(forgot, jnp.ones((N, 3)), jnp.ones((N, 3)))


def test_declared_client_data_is_checked_and_a_correct_round_captures():
    @fcir.program(placements={"clients": N}, client_data="x")
    def good(w, x):
        return fcir.reduce_mean(fcir.map_fn(_local, (fcir.broadcast(w), x)))

    module = fcir.capture(good, jnp.ones((N, 3)), jnp.ones((N, 3)))
    assert str(module.main.body.params[0].type) == "f32[4,3]@server"
    with pytest.raises(fcir.PlacementError, match="argument 'x' is declared client data"):
        fcir.capture(good, jnp.ones(3), jnp.ones((N + 1, 3)))
    with pytest.raises(fcir.PlacementError, match="has no argument 'y'"):
        fcir.program(placements={"clients": N}, client_data=("y",))(good.__wrapped__)
    with pytest.raises(fcir.PlacementError, match="client_data must name arguments"):
        fcir.program(placements={"clients": N}, client_data=[0])


def test_a_server_value_given_to_map_fn_says_did_you_mean_broadcast():
    @fcir.program(placements={"clients": N})
    def forgot(w, x):
        return fcir.reduce_mean(fcir.map_fn(_local, (w, x)))

    with pytest.raises(fcir.PlacementError, match=r"did you mean fcir.broadcast"):
        fcir.capture(forgot, jnp.ones(3), jnp.ones((N, 3)))
