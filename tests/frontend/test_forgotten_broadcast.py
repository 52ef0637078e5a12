"""A server value given to fcir.map_fn without fcir.broadcast: the error leads with the
fix, names the program's argument and the user's line."""

import inspect

import jax.numpy as jnp
import pytest

import fcir


def _client(w, x, y):
    return jnp.sum((x @ w - y) ** 2)


def _line(fn, marker):
    lines, first = inspect.getsourcelines(fn)
    return first + next(i for i, text in enumerate(lines) if marker in text)


@pytest.mark.parametrize("client_data", [None, ("x", "y")])
def test_a_model_not_broadcast_leads_with_did_you_mean_and_names_the_argument(client_data):
    def forgot(w, x, y):
        return fcir.reduce_mean(fcir.map_fn(_client, (w, x, y)))  # no broadcast

    rnd = fcir.program(placements={"clients": 4}, client_data=client_data)(forgot)
    # The model's leading axis (8) is not the cohort (4).
    w, x, y = jnp.zeros((8, 3)), jnp.zeros((4, 5, 8)), jnp.zeros((4, 5, 3))
    with pytest.raises(fcir.PlacementError) as e:
        fcir.capture(rnd, w, x, y)
    msg = str(e.value)
    assert msg.startswith("fcir.map_fn: did you mean fcir.broadcast(w)?"), msg
    assert "argument 'w'" in msg
    assert f"(at test_forgotten_broadcast.py:{_line(forgot, 'no broadcast')})" in msg
    # The cohort-size reading is still offered, after the likelier one.
    assert msg.index("broadcast(w)") < msg.index("declare 'clients': 8")


def test_data_of_another_cohort_size_still_leads_with_the_cohort():
    @fcir.program(placements={"clients": 4})
    def rnd(w, x):
        return fcir.reduce_mean(fcir.map_fn(lambda w, x: w + x.mean(0), (fcir.broadcast(w), x)))

    with pytest.raises(fcir.PlacementError) as e:
        fcir.capture(rnd, jnp.zeros(3), jnp.ones((5, 5, 3)))
    msg = str(e.value)
    assert "argument 'x'" in msg
    assert msg.index("declare 'clients': 5") < msg.index("did you mean fcir.broadcast(x)?")
