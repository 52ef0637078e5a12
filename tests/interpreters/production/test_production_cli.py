"""``fcir export --target production`` and ``fcir run-plan``."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
from productionlib import cases, rounds

import fcir
from fcir.cli import main

ROUNDS_FILE = pathlib.Path(rounds.__file__)


def _ir_file(tmp_path, name: str, suffix: str) -> pathlib.Path:
    module = cases.captured(name)
    path = tmp_path / f"round{suffix}"
    if suffix == ".fcir":
        path.write_text(module.to_text(full_constants=True))
    else:
        path.write_bytes(module.serialize())
    return path


@pytest.mark.parametrize("suffix", [".fcir", ".pb"])
def test_export_an_ir_file(tmp_path, capsys, suffix):
    src = _ir_file(tmp_path, "corpus:temperature_sensors", suffix)
    out = tmp_path / "bundle"
    assert main(["export", "--target", "production", str(src), "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert (
        "@temperature_sensors: (<float32@SERVER,{float32[16]}@CLIENTS> -> float32@SERVER)"
        in printed
    )
    assert "client_work" in printed and f"wrote production bundle to {out}" in printed
    assert (out / "manifest.json").is_file() and (out / "round.computation.pb").is_file()
    _, args = cases.fn_and_args("corpus:temperature_sensors")
    got = fcir.interpreters.production.run_bundle(out, *args)
    cases.assert_close(got, cases.expected("corpus:temperature_sensors"))


def test_export_a_python_target(tmp_path, capsys):
    out = tmp_path / "bundle"
    target = f"{ROUNDS_FILE}:minmax"
    rc = main(
        [
            "export",
            "--target",
            "production",
            target,
            "-o",
            str(out),
            "--aggregate-with",
            "federated_aggregate",
        ]
    )
    assert rc == 0, capsys.readouterr().err
    assert "@minmax:" in capsys.readouterr().out
    import json

    assert (
        json.loads((out / "manifest.json").read_text())["aggregate_with"] == "federated_aggregate"
    )


def test_export_a_python_target_with_arg_specs(tmp_path, capsys):
    out = tmp_path / "bundle"
    target = f"{ROUNDS_FILE}:server_only"
    assert (
        main(["export", "--target", "production", target, "--args", "f32[5]", "-o", str(out)]) == 0
    )
    assert "(<float32[5]@SERVER> -> float32[5]@SERVER)" in capsys.readouterr().out


def test_not_exportable_is_exit_1_with_one_line(tmp_path, capsys):
    src = tmp_path / "peek.fcir"
    src.write_text(rounds.PER_MEMBER_READ_IR)
    rc = main(["export", "--target", "production", str(src), "-o", str(tmp_path / "b")])
    assert rc == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("fcir export: error: @peek is not exportable: jax.reduce_sum (op 0, ")
    assert "per-member read" in err
    assert not (tmp_path / "b" / "manifest.json").exists()


def test_usage_errors(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        main(["export", str(tmp_path / "x.fcir"), "-o", str(tmp_path)])  # no --target
    assert info.value.code == 2
    with pytest.raises(SystemExit) as info:
        main(["export", "--target", "mobile", "x.fcir", "-o", str(tmp_path)])
    assert info.value.code == 2
    assert (
        main(
            [
                "export",
                "--target",
                "production",
                str(tmp_path / "missing.fcir"),
                "-o",
                str(tmp_path),
            ]
        )
        == 1
    )
    assert "no such IR file" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["export", "run-plan"])
def test_help(command, capsys):
    with pytest.raises(SystemExit) as info:
        main([command, "--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    assert "DistributeAggregateForm" in text
    assert "Example: fcir" in text


@pytest.mark.slow  # a fresh process (docs/contributing.md)
def test_run_plan_in_a_fresh_process_without_the_source(tmp_path):
    """The bundle alone runs: copied away from the program, in a new process whose
    working directory and import path know nothing of the program's Python source."""
    name = "own:fedavg_pytree"
    bundle = tmp_path / "shipped"
    shutil.copytree(cases.bundle(name), bundle)
    _, args = cases.fn_and_args(name)
    np.savez(tmp_path / "in.npz", *jax.tree_util.tree_leaves(args))
    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "fcir.cli",
            "run-plan",
            str(bundle),
            "--inputs",
            str(tmp_path / "in.npz"),
            "-o",
            str(tmp_path / "out.npz"),
        ],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "wrote 6 output array(s)" in proc.stdout
    with np.load(tmp_path / "out.npz") as data:
        got = [data[f"arr_{i}"] for i in range(len(data.files))]
    cases.assert_close(got, jax.tree_util.tree_leaves(cases.expected(name)), name=name)


def test_run_plan_prints_a_summary(tmp_path, capsys):
    name = "corpus:secure_histogram"
    _, args = cases.fn_and_args(name)
    np.savez(tmp_path / "in.npz", *jax.tree_util.tree_leaves(args))
    assert main(["run-plan", cases.bundle(name), "--inputs", str(tmp_path / "in.npz")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("arr_0: int32[8] [")
    assert out[1].startswith("arr_1: int32[] ")


def test_run_plan_takes_int64_inputs_as_int32_like_run_with_a_note(tmp_path, capsys):
    name = "corpus:secure_histogram"
    _, args = cases.fn_and_args(name)
    leaves = jax.tree_util.tree_leaves(args)
    np.savez(tmp_path / "in.npz", *[np.asarray(x, np.int64) for x in leaves])
    assert main(["run-plan", cases.bundle(name), "--inputs", str(tmp_path / "in.npz"),
                 "-o", str(tmp_path / "out.npz")]) == 0
    assert "arr_0 is int64, converted to int32 as jax.jit does" in capsys.readouterr().err
    with np.load(tmp_path / "out.npz") as data:
        got = [data[f"arr_{i}"] for i in range(len(data.files))]
    cases.assert_close(got, jax.tree_util.tree_leaves(cases.expected(name)), name=name)


def test_run_plan_bad_inputs_are_one_line_errors(tmp_path, capsys):
    bundle = cases.bundle("corpus:secure_histogram")
    np.savez(tmp_path / "short.npz", np.zeros((6, 16), np.int32))
    assert main(["run-plan", bundle, "--inputs", str(tmp_path / "short.npz")]) == 1
    err = capsys.readouterr().err
    assert "short.npz has no arr_1: i32[6,16] (%1: {i32[16]}@clients" in err
    assert err.count("\n") == 1
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    assert main(["run-plan", bundle, "--inputs", str(tmp_path / "junk.npz")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("fcir run-plan: error: cannot read inputs") and err.count("\n") == 1
    np.savez(tmp_path / "named.npz", x=np.zeros(3))
    assert main(["run-plan", bundle, "--inputs", str(tmp_path / "named.npz")]) == 1
    err = capsys.readouterr().err
    assert "named.npz holds arrays named x: inputs are read by position, as arr_0" in err
    assert main(["run-plan", str(tmp_path), "--inputs", str(tmp_path / "short.npz")]) == 1
    assert "not a production bundle" in capsys.readouterr().err
