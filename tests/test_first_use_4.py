"""Defects a first-time user finds (fourth hunt): each test is the plausible program or
call, and what it must give: the numbers plain JAX gives, or an ``fcir.FcirError`` that
says what to do."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fcir.interpreters import reference, xla

import fcir


@fcir.program(placements={"clients": 3})
def _mean_update(w, x):
    return fcir.reduce_mean(fcir.map_fn(lambda w, x: x - w, (fcir.broadcast(w), x)))


def test_executable_as_text_of_an_unknown_dialect_is_an_fcir_error_naming_the_dialects():
    exe = xla.compile(fcir.capture(_mean_update, jnp.zeros(2), jnp.ones((3, 2))))
    with pytest.raises(fcir.InterpreterError, match="stablehlo, hlo, optimized_hlo.*'mlir'"):
        exe.as_text("mlir")


# --- a dict argument with other keys than at capture: leaves matched by sorted position ----


@fcir.program(placements={"clients": 2})
def _affine(p, x):
    return fcir.reduce_sum(fcir.map_fn(lambda p, x: p["w"] * x + p["b"], (fcir.broadcast(p), x)))


def _affine_module():
    p = {"w": jnp.float32(2.0), "b": jnp.float32(10.0)}
    return fcir.capture(_affine, p, jnp.ones(2))


@pytest.mark.parametrize("backend", ["reference", "xla"])
def test_a_dict_argument_with_renamed_keys_is_refused_not_matched_by_sorted_position(backend):
    module = _affine_module()
    run = reference.run if backend == "reference" else (lambda m, *a: xla.compile(m)(*a))
    # Renamed w -> kernel, b -> shift: sorted ("kernel", "shift") would run b=2, w=10
    # (22 where the program computes 24; jax.jit of the program raises a KeyError).
    renamed = {"kernel": jnp.float32(2.0), "shift": jnp.float32(10.0)}
    with pytest.raises(fcir.InterpreterError, match=r"argument \[0\].*'kernel', 'shift'.*'b', 'w'"):
        run(module, renamed, jnp.ones(2))
    # The captured keys, in any order, and flat leaves still run.
    assert float(run(module, {"w": 2.0, "b": 10.0}, jnp.ones(2))) == 24.0
    assert float(run(module, jnp.float32(10.0), jnp.float32(2.0), jnp.ones(2))) == 24.0


def test_a_renamed_nested_dict_key_is_refused_by_xla_lower_and_cost_too():
    exe = xla.compile(_affine_module())
    renamed = ({"kernel": jnp.float32(2.0), "shift": jnp.float32(10.0)}, jnp.ones(2))
    for call in (exe.lower, exe.cost):
        with pytest.raises(fcir.InterpreterError, match="captured with"):
            call(*renamed)


# --- a number of rounds from NumPy (a config, np.arange) is a count like a Python int -----


@fcir.program(placements={"clients": 4}, private=True)
def _dp_round(w, key, x):
    upd = fcir.map_fn(lambda w, x: x - w, (fcir.broadcast(w), x))
    return w + fcir.dp_mean(upd, 1.0, 1.1, key)


def _dp_module():
    return fcir.capture(_dp_round, jnp.zeros(3), jax.random.key(0), jnp.ones((4, 3)))


def test_epsilon_sampler_tv_and_budget_take_numpy_integer_rounds_as_ints():
    module = _dp_module()
    rounds = np.arange(1, 4)[-1]  # np.int64(3)
    assert fcir.privacy.epsilon(module, rounds, 1e-5) == fcir.privacy.epsilon(module, 3, 1e-5)
    assert fcir.privacy.sampler_tv(module, rounds) == fcir.privacy.sampler_tv(module, 3)
    budget = fcir.privacy.Budget(module, 1e-5, 100.0)
    assert budget.spend(rounds=rounds) == fcir.privacy.epsilon(module, 3, 1e-5)
    state = json.loads(json.dumps(budget.state()))  # still JSON-able: a Python int
    assert state["rounds"] == 3 and type(state["rounds"]) is int


@pytest.mark.parametrize("rounds", [np.True_, True, 1.0, np.float32(2), -1, np.int32(-1)])
def test_rounds_that_are_not_a_count_are_still_a_privacy_error(rounds):
    with pytest.raises(fcir.PrivacyError, match="rounds must be an int >= 0"):
        fcir.privacy.epsilon(_dp_module(), rounds, 1e-5)


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


# --- `fcir export --target flower IN -o DIR` replaced whatever DIR was ----------------------


def test_flower_export_refuses_to_replace_a_directory_or_file_it_did_not_write(tmp_path):
    from fcir.interpreters import flower

    module = fcir.capture(_mean_update, jnp.zeros(2), jnp.ones((3, 2)))
    project = tmp_path / "project"  # e.g. `-o .` in the user's project
    project.mkdir()
    (project / "train.py").write_text("precious\n")
    ir_file = tmp_path / "round.fcir"  # e.g. `-o round.fcir`, the input itself
    ir_file.write_text(module.to_text())
    for target in (project, ir_file):
        with pytest.raises(fcir.ExportError, match="give -o a new or empty directory"):
            flower.export(module, target)
    assert (project / "train.py").read_text() == "precious\n"
    assert fcir.parse(ir_file.read_text()).to_text() == module.to_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["project", "round.fcir"]  # no leftovers
    # A new directory, an empty one, and an app written before are (re)written.
    (tmp_path / "empty").mkdir()
    for target in (tmp_path / "app", tmp_path / "empty", tmp_path / "app"):
        assert (flower.export(module, target) / "fcir_app" / "plan.json").is_file()


def test_a_production_bundle_written_over_a_file_is_an_fcir_error_and_keeps_the_file(tmp_path):
    from fcir.interpreters import production

    module = fcir.capture(_mean_update, jnp.zeros(2), jnp.ones((3, 2)))
    ir_file = tmp_path / "round.fcir"
    ir_file.write_text(module.to_text())
    with pytest.raises(fcir.FcirError, match="is a file, not a directory"):
        production.export(module).write(ir_file)
    assert fcir.parse(ir_file.read_text()).to_text() == module.to_text()
