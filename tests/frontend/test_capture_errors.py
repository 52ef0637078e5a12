"""Mistakes in a program are FcirErrors at capture that name the mistake and the
user's line and say what to write instead."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fcir.interpreters import reference
from user_programs import (
    ARGS,
    NUMPY_AT_THE_SERVER,
    PY_IF_IN_A_CLIENT,
    load,
    write_program,
)

import fcir
from fcir import cli

N = 4




def _line_of(path, text: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line)








# --- first mistakes: plain-Python errors become FcirErrors that say what to do ---------------


def test_program_without_placements_says_how_to_declare_them():
    """Before: ``@fcir.program`` without parentheses was a raw ``TypeError: program()
    takes 0 positional arguments but 1 was given``."""
    with pytest.raises(fcir.PlacementError, match=r"@fcir.program\(placements=\{'clients'"):

        @fcir.program
        def round_(x):
            return fcir.reduce_mean(x)

    with pytest.raises(fcir.PlacementError, match="needs its placements"):
        fcir.program()


def test_capture_of_a_non_array_argument_names_the_argument():
    """Before: a raw JAX TypeError about jit-wrapped functions and static arguments."""

    @fcir.program(placements={"clients": N})
    def round_(w, data):
        return fcir.reduce_mean(fcir.map_fn(lambda w, x: w * x, (fcir.broadcast(w), data["x"])))

    with pytest.raises(fcir.IRTypeError, match=r"argument \[1\]\['name'\] is a str"):
        fcir.capture(round_, jnp.ones(()), {"x": jnp.ones(N), "name": "mnist"})


def test_vmap_over_client_data_batched_in_front_of_the_members_says_use_in_axes_1():
    """jit runs ``jax.vmap(round_, in_axes=(None, 0))`` over data sets ``[B, N, ...]``,
    but capture sees a server value ``[B, N, ...]`` (its leading axis is not the cohort):
    the error said only 'pass per-member values as client data', which the user did."""

    @fcir.program(placements={"clients": N})
    def round_(w, x):
        return fcir.reduce_mean(fcir.map_fn(lambda w, x: w * jnp.sum(x), (fcir.broadcast(w), x)))

    with pytest.raises(fcir.PlacementError, match=r"under jax.vmap, .* in_axes=1"):
        fcir.capture(
            lambda w, xs: jax.vmap(round_, (None, 0))(w, xs), jnp.ones(3), jnp.ones((2, N, 3))
        )
    module = fcir.capture(
        lambda w, xs: jax.vmap(round_, (None, 1))(w, xs), jnp.ones(3), jnp.ones((N, 2, 3))
    )
    np.testing.assert_array_equal(
        reference.run(module, jnp.ones(3), jnp.ones((N, 2, 3))), np.full((2, 3), 3.0)
    )


def test_a_map_fn_body_that_returns_a_string_is_an_fcir_error():
    """Before: JAX's 'function flat_body at fcir/opkit/placement.py traced for jit returned a value of
    type <class 'str'>', naming fcir's internals instead of the user's body."""

    @fcir.program(placements={"clients": N})
    def round_(x):
        return fcir.map_fn(lambda x: {"loss": jnp.sum(x), "tag": "client"}, x)

    with pytest.raises(fcir.PlacementError, match=r"fn returned a str \('client'\)"):
        fcir.capture(round_, jnp.ones((N, 3)))


# --- Python control flow and numpy on traced values -----------------------------------------


def test_a_python_if_in_a_map_fn_body_names_its_line_and_says_use_jnp_where(tmp_path):
    """Before: the advice was a server jax.lax.cond on an aggregate, and no line."""
    path = write_program(tmp_path, PY_IF_IN_A_CLIENT)
    with pytest.raises(fcir.UnsupportedError) as e:
        fcir.capture(load(path, "rnd"), *ARGS)
    msg = str(e.value)
    assert f"(at mine.py:{_line_of(path, 'if jnp.sum')})" in msg
    assert "a map_fn body (one member of 'clients')" in msg
    assert "jnp.where(pred, a, b)" in msg


def test_numpy_on_a_traced_value_says_use_jax_numpy_and_names_its_line(tmp_path):
    """Before: the message was the one for a Python `if` (branch with jax.lax.cond)."""
    path = write_program(tmp_path, NUMPY_AT_THE_SERVER)
    with pytest.raises(fcir.UnsupportedError) as e:
        fcir.capture(load(path, "rnd"), *ARGS)
    msg = str(e.value)
    assert f"(at mine.py:{_line_of(path, 'np.tanh')})" in msg
    assert "use jax.numpy" in msg
    assert "jax.lax.cond" not in msg


# --- the command line names the user's line of errors raised while tracing (here, not in
# tests/cli, since where JAX raises them and what its traceback holds is JAX's) --------------------


@pytest.mark.parametrize(
    "body, marker, says",
    [
        (  # fcir's own check, raised inside fcir.map_fn
            """
            @fcir.program(placements={"clients": 4})
            def rnd(w, x):
                upd = fcir.map_fn(lambda w, x: w + x.mean(0), (fcir.broadcast(w), x))
                return fcir.reduce_mean(upd)
            EXAMPLE_ARGS = {"rnd": lambda: (jnp.zeros(3), jnp.ones((5, 5, 3)))}
            """,
            "fcir.map_fn(",
            "is not placed at 'clients'",
        ),
        (  # the user's own bug, a TypeError from JAX
            """
            @fcir.program(placements={"clients": 4})
            def rnd(w, x):
                upd = fcir.map_fn(lambda w, x: w + x.mean(0) + "1", (fcir.broadcast(w), x))
                return fcir.reduce_mean(upd)
            EXAMPLE_ARGS = {"rnd": lambda: (jnp.zeros(3), jnp.ones((4, 5, 3)))}
            """,
            '+ "1"',
            "TypeError: unsupported operand",
        ),
        (  # an error while the file itself runs
            """
            SCALE = 1 / 0
            """,
            "1 / 0",
            "ZeroDivisionError",
        ),
    ],
)
def test_a_cli_error_raised_while_tracing_names_the_users_line(
    tmp_path, capsys, body, marker, says
):
    """Before: `fcir check mine.py:rnd` printed the message alone; only --debug's
    traceback said where."""
    path = write_program(tmp_path, body)
    assert cli.main(["check", f"{path}:rnd"]) == 1
    err = capsys.readouterr().err
    assert says in err
    assert f"(at mine.py:{_line_of(path, marker)})" in err


def test_the_cli_names_the_line_once_when_the_message_has_it(tmp_path, capsys):
    path = write_program(
        tmp_path,
        PY_IF_IN_A_CLIENT + 'EXAMPLE_ARGS = {"rnd": lambda: (jnp.zeros(3), '
        "jnp.ones((4, 5, 3)))}\n",
    )
    assert cli.main(["compile", f"{path}:rnd", "--emit", "ir"]) == 1
    err = capsys.readouterr().err
    assert err.count(f"(at mine.py:{_line_of(path, 'if jnp.sum')})") == 1


# --- data of another number of clients than the program declares ----------------------------


def test_client_data_of_another_cohort_size_names_the_leaf_and_the_count_to_declare():
    """Before: only 'did you mean fcir.broadcast(...)', wrong for 5 clients' data."""

    @fcir.program(placements={"clients": N})
    def rnd(w, x):
        upd = fcir.map_fn(lambda w, x: w + x.mean(0), (fcir.broadcast(w), x))
        return fcir.reduce_mean(upd)

    with pytest.raises(fcir.PlacementError) as e:
        fcir.capture(rnd, jnp.zeros(3), jnp.ones((5, 5, 3)))
    msg = str(e.value)
    assert "leaf [1] of shape (5, 5, 3) is not placed at 'clients'" in msg
    assert "declare 'clients': 5 in @fcir.program(placements=...)" in msg


@fcir.program(placements={"clients": N})
def _round(w, x):
    return fcir.reduce_mean(fcir.map_fn(lambda w, x: x - w, (fcir.broadcast(w), x)))


# --- capture errors name the user's source line -----------------------------------


def test_capture_error_names_the_source_line_without_locations():
    import inspect

    @fcir.program(placements={"clients": N})
    def leaky(x):
        means = fcir.map_fn(jnp.mean, x)
        return means[0]  # the line the error must name

    line = inspect.getsourcelines(leaky)[1] + 3  # `return means[0]`
    with pytest.raises(fcir.PlacementError) as info:
        fcir.capture(leaky, jnp.ones((N, 3)))
    assert f"(op 1, defining %6) at test_capture_errors.py:{line}: local/C1" in str(info.value)
    # The module of a successful capture stays without locations (text and goldens).
    ok = fcir.capture(_round, jnp.zeros(3), jnp.ones((N, 3)))
    assert all(op.location == "" or op.location is None for op in ok.main.body.ops)


def test_every_op_is_located_at_the_user_s_line_that_called_it():
    """A fed op binds its primitive inside fcir (fcir/fed/), a local op inside JAX: both
    are located at the user's line that called them, not at fcir's own."""
    import inspect

    @fcir.program(placements={"clients": N})
    def rnd(w, x):
        at_clients = fcir.broadcast(w)
        updates = fcir.map_fn(lambda w, x: w + x, (at_clients, x))
        total = fcir.reduce_sum(updates)
        return fcir.reduce_mean(updates) * total

    first = inspect.getsourcelines(rnd)[1]  # the decorator's line
    module = fcir.capture(rnd, jnp.zeros(3), jnp.ones((N, 3)), locations=True)
    got = {op.name: op.location for op in module.main.body.ops}
    here = "test_capture_errors.py"
    assert got == {
        "fed.broadcast": f"{here}:{first + 2}",
        "fed.map": f"{here}:{first + 3}",
        "fed.sum": f"{here}:{first + 4}",
        "fed.mean": f"{here}:{first + 5}",
        "jax.mul": f"{here}:{first + 5}",
    }, got
    member = [op for op in module.main.body.ops if op.name == "fed.map"][0].regions[0].ops
    assert [op.location for op in member if op.name == "jax.add"] == [f"{here}:{first + 3}"]
