"""`fcir diff` takes the targets `compile` and `show` take (file.py:function, with
--args), and a misspelt function name gets the name meant."""

import textwrap

import pytest

from fcir import cli

_PROGRAM = textwrap.dedent(
    """
    import jax.numpy as jnp
    import fcir

    @fcir.program(placements={"clients": 2})
    def fedavg_round(w, x):
        return fcir.reduce_mean(fcir.map_fn(lambda w, x: w + x, (fcir.broadcast(w), x)))

    @fcir.program(placements={"clients": 2})
    def fedsum_round(w, x):
        return fcir.reduce_sum(fcir.map_fn(lambda w, x: w + x, (fcir.broadcast(w), x)))

    EXAMPLE_ARGS = {"fedavg_round": lambda: (jnp.zeros(2), jnp.ones((2, 2))),
                    "fedsum_round": lambda: (jnp.zeros(2), jnp.ones((2, 2)))}
    """
)


@pytest.fixture
def prog(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "prog.py").write_text(_PROGRAM)
    return "prog.py"


def test_diff_takes_python_targets_and_ir_files(prog, capsys):
    assert cli.main(["compile", f"{prog}:fedavg_round", "--emit", "ir", "-o", "out"]) == 0
    capsys.readouterr()
    assert cli.main(["diff", f"{prog}:fedavg_round", "out/fedavg_round.fcir"]) == 0
    assert cli.main(["diff", f"{prog}:fedavg_round", f"{prog}:fedsum_round"]) == 1
    out = capsys.readouterr().out
    assert "-  %7: f32[2]@server = fed.mean %3" in out
    assert "+  %7: f32[2]@server = fed.sum %3" in out


def test_diff_args_type_the_python_targets(prog, capsys):
    assert cli.main(["compile", f"{prog}:fedavg_round", "--emit", "ir", "-o", "out"]) == 0
    capsys.readouterr()
    # The IR file keeps its f32[2]; --args make the Python target f32[3].
    assert cli.main(["diff", f"{prog}:fedavg_round", "out/fedavg_round.fcir",
                     "--args", "f32[3]", "f32[2,3]"]) == 1
    assert "-func @main(%0: f32[3]@server" in capsys.readouterr().out
    assert cli.main(["diff", f"{prog}:fedavg_round", f"{prog}:fedavg_round",
                     "--args", "f32[3]", "f32[2,3]"]) == 0


def test_a_target_that_fails_to_load_is_exit_2_not_different(prog, capsys):
    assert cli.main(["diff", f"{prog}:fedavg_round", f"{prog}:fedavg_round",
                     "--args", "f32[3]", "f32[5,3]"]) == 2
    assert "fcir diff: error:" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["compile", "show", "diff"])
def test_a_misspelt_function_gets_the_name_meant(prog, capsys, command):
    argv = [command, f"{prog}:fedavg_rund"] + ([f"{prog}:fedavg_round"] if command == "diff" else [])
    assert cli.main(argv) in (1, 2)
    err = capsys.readouterr().err
    assert "prog.py has no function 'fedavg_rund'; did you mean prog.py:fedavg_round?" in err
