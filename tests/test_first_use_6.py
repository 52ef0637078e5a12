"""Defects a first-time user finds (sixth hunt): each test is the plausible mistake and
the error it must give: an ``fcir.FcirError`` (or a command-line error) that names the
mistake and the user's line and says what to write instead."""

from __future__ import annotations

import argparse
import textwrap

import jax.numpy as jnp
import pytest
from fcir.interpreters import reference, xla

import fcir
from fcir import cli

N = 4


def _program(tmp_path, body: str, name: str = "mine.py"):
    """A user's file ``name`` with ``body`` after the imports; returns its path."""
    path = tmp_path / name
    path.write_text(
        "import jax, jax.numpy as jnp\nimport numpy as np\nimport fcir\n\n" + textwrap.dedent(body)
    )
    return path


def _line_of(path, text: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line)


def _load(path, name):
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"_first_use_6_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, name)


_ARGS = (jnp.zeros(3), jnp.ones((N, 5, 3)))

_PY_IF_IN_A_CLIENT = """
@fcir.program(placements={"clients": 4})
def rnd(w, x):
    def local(w, x):
        if jnp.sum(x) > 0:
            return w + 1
        return w
    return fcir.reduce_mean(fcir.map_fn(local, (fcir.broadcast(w), x)))
"""

_NUMPY_AT_THE_SERVER = """
@fcir.program(placements={"clients": 4})
def rnd(w, x):
    w = np.tanh(w)
    upd = fcir.map_fn(lambda w, x: w + x.mean(0), (fcir.broadcast(w), x))
    return fcir.reduce_mean(upd)
"""


# --- Python control flow and numpy on traced values -----------------------------------------


def test_a_python_if_in_a_map_fn_body_names_its_line_and_says_use_jnp_where(tmp_path):
    """Before: the advice was a server jax.lax.cond on an aggregate, and no line."""
    path = _program(tmp_path, _PY_IF_IN_A_CLIENT)
    with pytest.raises(fcir.UnsupportedError) as e:
        fcir.capture(_load(path, "rnd"), *_ARGS)
    msg = str(e.value)
    assert f"(at mine.py:{_line_of(path, 'if jnp.sum')})" in msg
    assert "a map_fn body (one member of 'clients')" in msg
    assert "jnp.where(pred, a, b)" in msg


def test_numpy_on_a_traced_value_says_use_jax_numpy_and_names_its_line(tmp_path):
    """Before: the message was the one for a Python `if` (branch with jax.lax.cond)."""
    path = _program(tmp_path, _NUMPY_AT_THE_SERVER)
    with pytest.raises(fcir.UnsupportedError) as e:
        fcir.capture(_load(path, "rnd"), *_ARGS)
    msg = str(e.value)
    assert f"(at mine.py:{_line_of(path, 'np.tanh')})" in msg
    assert "use jax.numpy" in msg
    assert "jax.lax.cond" not in msg


# --- the command line names the user's line of errors raised while tracing --------------------


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
    path = _program(tmp_path, body)
    assert cli.main(["check", f"{path}:rnd"]) == 1
    err = capsys.readouterr().err
    assert says in err
    assert f"(at mine.py:{_line_of(path, marker)})" in err


def test_the_cli_names_the_line_once_when_the_message_has_it(tmp_path, capsys):
    path = _program(
        tmp_path,
        _PY_IF_IN_A_CLIENT + 'EXAMPLE_ARGS = {"rnd": lambda: (jnp.zeros(3), '
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


# --- arguments a backend is called with that are not the captured ones -----------------------


@pytest.fixture(scope="module")
def module():
    @fcir.program(placements={"clients": N})
    def rnd(w, x):
        upd = fcir.map_fn(lambda w, x: w + x.mean(0), (fcir.broadcast(w), x))
        return fcir.reduce_mean(upd)

    return fcir.capture(rnd, *_ARGS)


_BACKENDS = {
    "reference": lambda m, *a: reference.run(m, *a),
    "xla": lambda m, *a: xla.compile(m)(*a),
}


@pytest.mark.parametrize("backend", sorted(_BACKENDS))
@pytest.mark.parametrize(
    "bad, said",
    [("w", r"of type str \('w'\)"), (None, "None"), ([0.0, 0.0, 0.0], "a list of 3 item")],
)
def test_an_argument_that_is_not_an_array_is_an_fcir_error_naming_it(module, backend, bad, said):
    """Before: a str was JAX's TypeError, None and a list 'takes 2 array leaves, got 1/4'."""
    with pytest.raises(
        fcir.InterpreterError, match=rf"argument \[0\] of @rnd is {said}.*an array of f32\[3\]"
    ):
        _BACKENDS[backend](module, bad, _ARGS[1])


@pytest.mark.parametrize("backend", sorted(_BACKENDS))
def test_too_few_or_many_arguments_say_what_the_program_takes(module, backend):
    expected = r"@rnd takes 2 arguments \(f32\[3\], f32\[4,5,3\]\), as it was captured; got "
    with pytest.raises(fcir.InterpreterError, match=expected + "1"):
        _BACKENDS[backend](module, _ARGS[0])
    with pytest.raises(fcir.InterpreterError, match=expected + "3"):
        _BACKENDS[backend](module, *_ARGS, _ARGS[0])


# --- the command line's --args and --help -------------------------------------------------------


def test_an_args_spec_with_numpys_dtype_name_names_the_spec_and_the_irs_spelling(capsys):
    code = cli.main(
        [
            "compile",
            "examples/fedavg.py:fedavg_round",
            "--emit",
            "ir",
            "--args",
            "f32[16,1]",
            "(float32[8,32,16], f32[8,32,1])",
        ]
    )
    err = capsys.readouterr().err
    assert code == 1
    assert "--args '(float32[8,32,16], f32[8,32,1])'" in err
    assert "unknown dtype 'float32'; the IR writes it f32" in err


def test_every_option_of_every_command_has_help():
    """`fcir run --help` listed --backend and --inputs with no word on either."""
    missing = []

    def walk(parser, name):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub, p in action.choices.items():
                    walk(p, f"{name} {sub}")
            elif not action.help and not isinstance(action, argparse._HelpAction):
                missing.append(f"{name} {'/'.join(action.option_strings) or action.dest}")

    walk(cli.build_parser(), "fcir")
    assert not missing


def test_ir_text_in_a_pb_file_says_it_is_text_and_to_rename_it(tmp_path, capsys):
    """Before: 'not a serialized fcir.v1.Module: Error parsing message', no word of why."""
    module = fcir.capture(
        _load(
            _program(tmp_path, _NUMPY_AT_THE_SERVER.replace("w = np.tanh(w)", "w = jnp.tanh(w)")),
            "rnd",
        ),
        *_ARGS,
    )
    (tmp_path / "r.pb").write_text(module.to_text())
    assert cli.main(["check", str(tmp_path / "r.pb")]) == 1
    err = capsys.readouterr().err
    assert "is IR text, not a serialized module (text IR files end in .fcir)" in err


@pytest.mark.parametrize("target", ["sub/rnd:rnd", "sub.rnd:rnd"])
def test_a_target_naming_a_file_without_py_says_the_target_to_write(
    tmp_path, monkeypatch, capsys, target
):
    """Before: 'cannot import ...: No module named ...' and nothing more (the current
    directory is not on the fcir command's import path, so sub.rnd is not importable)."""
    (tmp_path / "sub").mkdir()
    _program(tmp_path / "sub", _PY_IF_IN_A_CLIENT, "rnd.py")
    monkeypatch.chdir(tmp_path)
    assert cli.main(["check", target]) == 1
    assert "did you mean sub/rnd.py:rnd?" in capsys.readouterr().err


def test_an_error_of_a_nested_command_names_the_command_as_typed(monkeypatch, capsys):
    """Before: an error reaching the command line's handler said 'fcir ckpt: error:' where
    the command's own errors and its usage say 'fcir ckpt inspect'."""
    from fcir.checkpoint import inspect as ckpt_inspect

    def fails(args):
        raise fcir.CheckpointError("s3://b/ck: the server did not answer")

    monkeypatch.setattr(ckpt_inspect, "run", fails)
    assert cli.main(["ckpt", "inspect", "s3://b/ck"]) == 1
    assert capsys.readouterr().err.startswith("fcir ckpt inspect: error: s3://b/ck")
