"""Command-line mistakes get an error that says what to do: missing --args types, an
inputs file that is not an .npz, an IR path that is a directory, numpy's dtype names,
IR text in a .pb file, a target without .py, a nested command's name; and every option
has help. (The user's line of an error raised while tracing: tests/frontend/
test_capture_errors.py, which runs on every JAX.)"""

from __future__ import annotations

import argparse

import numpy as np
import pytest
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










@fcir.program(placements={"clients": N})
def _sum_and_mean(x):
    return fcir.reduce_sum(x), fcir.reduce_mean(x)


def test_cli_args_with_a_missing_type_names_the_parameters(tmp_path, capsys):
    """Before: ``TypeError: fedavg_round() missing 1 required positional argument``."""
    from fcir import cli

    code = cli.main(
        ["compile", "examples/fedavg.py:fedavg_round", "--args", "f32[3]", "-o", str(tmp_path)]
    )
    err = capsys.readouterr().err
    assert code == 1
    assert "fedavg_round(model, client_data) takes 2 argument(s) but --args gave 1" in err
    assert "TypeError" not in err


def test_cli_run_with_a_non_npz_inputs_file_says_how_to_write_one(tmp_path, capsys):
    """Before: numpy's 'If you trust the file you can load it unsafely using the
    allow_pickle= keyword' advice, which fcir cannot take and a user should not."""
    from fcir import cli

    ir = tmp_path / "r.fcir"
    ir.write_text(fcir.capture(_sum_and_mean, np.ones((N, 1), np.float32)).to_text())
    assert cli.main(["run", str(ir), "--backend", "reference", "--inputs", str(ir)]) == 1
    err = capsys.readouterr().err
    assert "is not an .npz of arrays" in err and "np.savez(" in err
    assert "allow_pickle" not in err


# --- `fcir compile -o r.fcir` writes a directory: checking "r.fcir" points into it ------------


def test_an_ir_path_that_is_a_directory_says_so_and_names_the_ir_files_in_it(tmp_path, capsys):
    from fcir import cli

    out = tmp_path / "round.fcir"  # what a user passes to -o, expecting one file
    target = "examples/fedavg.py:fedavg_round"  # its EXAMPLE_ARGS give the types
    assert cli.main(["compile", target, "--emit", "ir", "-o", str(out)]) == 0
    capsys.readouterr()
    assert out.is_dir()
    for command in (["check", str(out)], ["show", str(out)], ["diff", str(out), str(out)]):
        assert cli.main(command) != 0
        err = capsys.readouterr().err
        assert f"{out} is a directory, not an IR file" in err, err
        assert f"did you mean {out}/fedavg_round.fcir" in err, err


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
        load(
            write_program(tmp_path, NUMPY_AT_THE_SERVER.replace("w = np.tanh(w)", "w = jnp.tanh(w)")),
            "rnd",
        ),
        *ARGS,
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
    write_program(tmp_path / "sub", PY_IF_IN_A_CLIENT, "rnd.py")
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
