"""The ``fcir`` command line: show, check, diff, run; exit codes, ``--help`` everywhere,
and no Python traceback for bad input unless ``--debug``."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

import fcir
from fcir import cli
from fcir.frontend.capture import capture_unchecked
from fcir.frontend.loading import load_function

TARGET = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, fcir

    @fcir.program(placements={"clients": 3})
    def fedavg(model, data):
        def local(m, d):
            return m - 0.1 * jnp.mean(d @ m) * jnp.ones_like(m)
        return fcir.reduce_mean(fcir.map_fn(local, (fcir.broadcast(model), data)))

    @fcir.program(placements={"clients": 3})
    def total(x):
        return {"sum": fcir.reduce_sum(x), "max": fcir.reduce_max(x)}

    @fcir.program(placements={"clients": 3})
    def peeks(x):
        return x[0] + fcir.reduce_sum(fcir.map_fn(lambda a: a * 2, x))

    def broken(x):
        raise ValueError("user code is broken")

    EXAMPLE_ARGS = {
        "fedavg": lambda: (jnp.ones((4, 2)), jnp.ones((3, 5, 4))),
        "peeks": lambda: jnp.ones((3, 2)),
    }
    """
)


@pytest.fixture
def files(tmp_path):
    """A Python target plus IR files written from it."""
    src = tmp_path / "target.py"
    src.write_text(TARGET)
    _, mod = load_function(f"{src}:fedavg")
    ns = vars(mod)
    args = ns["EXAMPLE_ARGS"]["fedavg"]()
    m = fcir.capture(ns["fedavg"], *args)
    paths = {
        "py": src,
        "fcir": tmp_path / "fedavg.fcir",
        "pb": tmp_path / "fedavg.pb",
        "other": tmp_path / "total.fcir",
        "bad_check": tmp_path / "peeks.fcir",
        "garbage": tmp_path / "garbage.fcir",
        "garbage_pb": tmp_path / "garbage.pb",
        "binary_text": tmp_path / "binary.fcir",
        "inputs": tmp_path / "in.npz",
        "bad_npz": tmp_path / "bad.npz",
        "few_npz": tmp_path / "few.npz",
        "out": tmp_path / "out.npz",
    }
    paths["fcir"].write_text(m.to_text(full_constants=True))
    paths["pb"].write_bytes(m.serialize())
    paths["other"].write_text(
        fcir.capture(ns["total"], jax.ShapeDtypeStruct((3, 2), np.float32)).to_text()
    )
    paths["bad_check"].write_text(
        capture_unchecked(ns["peeks"], *[np.ones((3, 2), np.float32)]).to_text()
    )
    paths["garbage"].write_text("fcir.module @x ir_version=1 placements=[clients:3]\nfunc @main(")
    paths["garbage_pb"].write_bytes(b"\xff\x00\x13garbage")
    paths["binary_text"].write_bytes(b"\xff\xfe\x00\x80")
    np.savez(paths["inputs"], *[np.asarray(a) for a in jax.tree.leaves(args)])
    paths["bad_npz"].write_text("this is not an npz file")
    np.savez(paths["few_npz"], np.ones((4, 2), np.float32))
    return paths, ns, args


def run_main(argv, capsys):
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def assert_no_traceback(err: str):
    assert "Traceback" not in err and 'File "' not in err, err


# --- show -----------------------------------------------------------------------------------


def test_show_prints_canonical_text_for_every_kind_of_target(files, capsys):
    paths, _, _ = files
    want = fcir.parse(paths["fcir"].read_text()).to_text()
    for target in [paths["fcir"], paths["pb"], f"{paths['py']}:fedavg"]:
        code, out, err = run_main(["show", target], capsys)
        assert (code, err) == (0, ""), err
        assert out == want
    code, out, _ = run_main(["show", paths["pb"], "--full-constants"], capsys)
    assert code == 0 and out == paths["fcir"].read_text()
    code, out, _ = run_main(["show", f"{paths['py']}:total", "--args", "f32[3,2]"], capsys)
    assert code == 0 and "fed.max" in out and '.results {"max": $0, "sum": $1}' in out


# --- check ----------------------------------------------------------------------------------


def test_check_exit_codes(files, capsys):
    paths, _, _ = files
    for target in [paths["fcir"], paths["pb"], f"{paths['py']}:fedavg"]:
        code, out, _ = run_main(["check", target], capsys)
        assert code == 0 and "ok" in out
    code, out, err = run_main(["check", paths["bad_check"]], capsys)
    assert code == 1
    assert "local/C1" in out and "client-to-client" in out and "error(s)" in out
    assert_no_traceback(err)
    code, out, _ = run_main(["check", f"{paths['py']}:peeks"], capsys)
    assert code == 1 and "local/C1" in out


# --- diff -----------------------------------------------------------------------------------


def test_diff_exit_codes(files, capsys):
    paths, _, _ = files
    code, out, _ = run_main(["diff", paths["fcir"], paths["pb"]], capsys)
    assert (code, out) == (0, "")
    code, out, _ = run_main(["diff", paths["fcir"], paths["other"]], capsys)
    assert code == 1
    assert out.startswith(f"--- {paths['fcir']}\n+++ {paths['other']}\n")
    assert "-  %2: f32[4,2]@clients! = fed.broadcast" in out
    for bad in [paths["garbage"], paths["garbage_pb"], paths["py"].with_name("none.fcir")]:
        code, out, err = run_main(["diff", paths["fcir"], bad], capsys)
        assert code == 2 and out == "" and "error" in err
        assert_no_traceback(err)
    code, _, _ = run_main(["diff", "-U", "0", paths["fcir"], paths["other"]], capsys)
    assert code == 1


@pytest.mark.parametrize(
    "argv", [["diff", "fcir", "other"], ["show", "fcir"], ["--help"]], ids=["diff", "show", "help"]
)
def test_output_cut_by_a_pipe_ends_quietly(files, capsys, monkeypatch, argv):
    """``fcir diff A B | head``: the reader closes the pipe before the output ends. Every
    command (and the help) then exits 1 with nothing on stderr, and leaves nothing
    unwritten for the interpreter's flush at exit to fail on."""
    paths, _, _ = files
    read, write = os.pipe()
    os.close(read)  # the reader has left
    stdout = open(write, "w")  # noqa: SIM115 (closed below)
    monkeypatch.setattr(sys, "stdout", stdout)
    try:
        code = cli.main([str(paths.get(a, a)) for a in argv])
        stdout.write("more\n")
        stdout.flush()  # what the interpreter does at exit: not a BrokenPipeError
    finally:
        stdout.close()
    assert code == 1
    assert capsys.readouterr().err == ""


# --- run ------------------------------------------------------------------------------------


@pytest.mark.parametrize("target", ["fcir", "pb", "py"])
def test_run_writes_outputs(files, capsys, target):
    paths, ns, args = files
    t = f"{paths['py']}:fedavg" if target == "py" else paths[target]
    code, out, err = run_main(["run", t, "--inputs", paths["inputs"], "-o", paths["out"]], capsys)
    assert code == 0, err
    assert "wrote 1 output array(s)" in out
    with np.load(paths["out"]) as data:
        got = data["arr_0"]
    np.testing.assert_allclose(got, np.asarray(jax.jit(ns["fedavg"])(*args)), rtol=1e-5)
    code, out, _ = run_main(["run", t, "--inputs", paths["inputs"]], capsys)
    assert code == 0 and out.startswith("arr_0: float32[4, 2]")


def test_run_on_xla(files, capsys):
    pytest.importorskip("fcir.interpreters.xla")
    paths, ns, args = files
    code, _, err = run_main(
        ["run", paths["pb"], "--backend", "xla", "--inputs", paths["inputs"], "-o", paths["out"]],
        capsys,
    )
    assert code == 0, err
    with np.load(paths["out"]) as data:
        np.testing.assert_array_equal(data["arr_0"], np.asarray(jax.jit(ns["fedavg"])(*args)))


@pytest.mark.parametrize("backend", ["reference", "xla"])
def test_float64_inputs_run_as_float32_on_every_backend_with_a_note(files, capsys, backend):
    """One input rule (jax.jit's): float64 numpy leaves become float32, on every backend,
    and the command line says so instead of converting silently."""
    paths, ns, args = files
    f64 = paths["inputs"].with_name("f64.npz")
    np.savez(f64, *[np.asarray(a, np.float64) for a in args])
    code, _, err = run_main(
        ["run", paths["pb"], "--backend", backend, "--inputs", f64, "-o", paths["out"]], capsys
    )
    assert code == 0, err
    assert "arr_0 is float64, converted to float32 as jax.jit does" in err
    with np.load(paths["out"]) as data:
        np.testing.assert_allclose(
            data["arr_0"], np.asarray(jax.jit(ns["fedavg"])(*args)), rtol=1e-6
        )


def test_reference_and_xla_take_float64_numpy_alike_from_python():
    from fcir.interpreters import reference, xla

    @fcir.program(placements={"clients": 3})
    def mean(x):
        return fcir.reduce_mean(x)

    x = np.arange(6, dtype=np.float64).reshape(3, 2) / 7
    m = fcir.capture(mean, x.astype(np.float32))
    by_reference, by_xla = reference.run(m, x), xla.compile(m)(x)
    assert by_reference.dtype == by_xla.dtype == np.float32
    np.testing.assert_allclose(by_reference, by_xla, rtol=1e-6)


def test_inputs_saved_by_name_are_refused_listing_the_leaves_by_position(files, capsys):
    paths, _, _ = files
    named = paths["inputs"].with_name("named.npz")
    np.savez(named, b1=np.ones((4, 2), np.float32), w1=np.ones((3, 5, 4), np.float32))
    code, _, err = run_main(["run", paths["pb"], "--inputs", named], capsys)
    assert code == 1
    assert "holds arrays named b1, w1: inputs are read by position, as arr_0, arr_1" in err
    assert "arr_0: f32[4,2] (%0: f32[4,2]@server, argument [0])" in err
    assert "arr_1: f32[3,5,4] (%1: {f32[5,4]}@clients, argument [1])" in err
    assert "the inputs hold 0" not in err


def test_a_missing_input_leaf_is_named(files, capsys):
    paths, _, args = files
    short = paths["inputs"].with_name("short.npz")
    np.savez(short, np.asarray(args[0]))
    code, _, err = run_main(["run", paths["pb"], "--inputs", short], capsys)
    assert code == 1
    assert "short.npz has no arr_1: f32[3,5,4] (%1: {f32[5,4]}@clients, argument [1])" in err


# --- bad input ------------------------------------------------------------------------------


def _py(paths, name):
    return f"{paths['py']}:{name}"


def _missing(paths, name):
    return paths["py"].with_name(name)


BAD_INPUTS = {
    "show nonexistent file": lambda p: ["show", _missing(p, "missing.fcir")],
    "show nonexistent python file": lambda p: ["show", f"{_missing(p, 'missing.py')}:f"],
    "show garbage text": lambda p: ["show", p["garbage"]],
    "show garbage binary": lambda p: ["show", p["garbage_pb"]],
    "show binary named .fcir": lambda p: ["show", p["binary_text"]],
    "show target without function": lambda p: ["show", _py(p, "nope")],
    "show target without colon": lambda p: ["show", "target"],
    "show no EXAMPLE_ARGS": lambda p: ["show", _py(p, "total")],
    "show bad --args spec": lambda p: ["show", _py(p, "total"), "--args", "f32[3,"],
    "show unknown dtype in --args": lambda p: ["show", _py(p, "total"), "--args", "q9[3]"],
    "show --args for an IR file": lambda p: ["show", p["fcir"], "--args", "f32[3]"],
    "show wrong --args shape": lambda p: ["show", _py(p, "total"), "--args", "f32[4,2]"],
    "show user code raises": lambda p: ["show", _py(p, "broken"), "--args", "f32[3]"],
    "check garbage": lambda p: ["check", p["garbage"]],
    "check nonexistent": lambda p: ["check", _missing(p, "missing.pb")],
    "run bad npz": lambda p: ["run", p["fcir"], "--inputs", p["bad_npz"]],
    "run missing npz": lambda p: ["run", p["fcir"], "--inputs", _missing(p, "missing.npz")],
    "run too few inputs": lambda p: ["run", p["fcir"], "--inputs", p["few_npz"]],
    "run wrong input shapes": lambda p: ["run", p["other"], "--inputs", p["inputs"]],
    "run garbage": lambda p: ["run", p["garbage"], "--inputs", p["inputs"]],
}


@pytest.mark.parametrize("name", sorted(BAD_INPUTS))
def test_bad_input_fails_without_traceback(files, capsys, name):
    paths, _, _ = files
    argv = [str(a) for a in BAD_INPUTS[name](paths)]
    code, out, err = run_main(argv, capsys)
    assert code == 1, (out, err)
    assert err.startswith(f"fcir {argv[0]}: error: "), err
    assert err.count("\n") <= 3, err
    assert_no_traceback(err)


def test_debug_shows_the_exception(files, capsys):
    paths, _, _ = files
    with pytest.raises(fcir.ParseError):
        cli.main(["--debug", "check", str(paths["garbage"])])
    with pytest.raises(ValueError, match="user code is broken"):
        cli.main(["--debug", "show", f"{paths['py']}:broken", "--args", "f32[3]"])


# --- usage and help -------------------------------------------------------------------------


def subcommands(parser: argparse.ArgumentParser, prefix=()):
    """Every (sub)command path, e.g. ("show",), ("ckpt", "inspect")."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield (*prefix, name)
                yield from subcommands(sub, (*prefix, name))


COMMANDS = sorted(set(subcommands(cli.build_parser())))


def test_core_commands_exist():
    assert {("show",), ("check",), ("diff",), ("run",), ("compile",)} <= set(COMMANDS)


@pytest.mark.parametrize("command", [(), *COMMANDS], ids=lambda c: " ".join(c) or "fcir")
def test_help_exits_0(command, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main([*command, "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: fcir") and " ".join(command) in out


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["nonsense"],
        ["show"],
        ["diff", "a.fcir"],
        ["run", "a.fcir"],
        ["run", "a.fcir", "--inputs", "x.npz", "--backend", "gpu9"],
        ["show", "a.fcir", "--format", "png"],
        ["check", "a.fcir", "--bogus"],
        ["diff", "-U", "many", "a.fcir", "b.fcir"],
    ],
    ids=lambda a: " ".join(a) or "nothing",
)
def test_usage_errors_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "usage: fcir" in err and "error:" in err
    assert_no_traceback(err)


# --- as a process ---------------------------------------------------------------------------


@pytest.mark.slow  # 9 s: fresh processes (docs/contributing.md)
def test_python_dash_m_fcir_cli(files):
    paths, _, _ = files
    runs = {
        "diff": (["diff", paths["pb"], paths["other"]], 1),
        "check garbage": (["check", paths["garbage"]], 1),
        "debug": (["--debug", "check", paths["garbage"]], 1),
    }
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-m", "fcir.cli", *map(str, argv)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for name, (argv, _) in runs.items()
    }
    results = {name: (p.communicate(timeout=300), p.returncode) for name, p in procs.items()}
    for name, ((_out, err), code) in results.items():
        assert code == runs[name][1], (name, code, err[-2000:])
        if name != "debug":
            assert_no_traceback(err)
    assert results["diff"][0][0].startswith(f"--- {paths['pb']}\n+++ {paths['other']}\n")
    assert results["check garbage"][0][1].startswith("fcir check: error: line 2, column")
    assert "Traceback" in results["debug"][0][1] and "ParseError" in results["debug"][0][1]


# --- --args specs for dicts and lists -----------------------------------------------------

HINTED = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, fcir

    @fcir.program(placements={"clients": 3})
    def plain(model, data):
        x, n = data
        step = lambda m, x, n: jax.tree.map(lambda p: p - jnp.mean(x) * n, m)
        return fcir.reduce_mean(fcir.map_fn(step, (fcir.broadcast(model), x, n)))

    @fcir.program(placements={"clients": 3})
    def keyed(model, key, data):
        return plain(model, data)

    EXAMPLE_ARGS = {"keyed": lambda: (
        {"w": jnp.zeros((4, 2)), "b": [jnp.zeros(2), jnp.zeros((), jnp.int32)]},
        jax.random.key(0),
        (jnp.ones((3, 5)), jnp.ones((3,), jnp.int32)),
    )}
    """
)


def test_args_specs_describe_dicts_lists_tuples_keys_and_none():
    from fcir.frontend.loading import format_arg_spec, parse_arg_specs

    specs = ['{"w": f32[4,2], b: [f32[2], i32[]]}', "(f32[3,5],)", "key<fry>[]", "none",
             "[(bf16[1], u8[2]), {}]"]
    w, x, k, none, nested = parse_arg_specs(specs)
    assert set(w) == {"w", "b"} and w["w"].shape == (4, 2) and w["b"][1].dtype == np.int32
    assert isinstance(w["b"], list) and x[0].shape == (3, 5) and none is None
    assert str(k.dtype) == "key<fry>" and nested[1] == {}
    for tree in (w, x, k, none, nested):
        again = parse_arg_specs([format_arg_spec(tree)])[0]
        assert jax.tree.structure(again) == jax.tree.structure(tree)
        assert jax.tree.leaves(again) == jax.tree.leaves(tree)


@pytest.mark.parametrize("spec", ['{"w": f32[2], "w": f32[2]}', "{w f32[2]}", "[f32[2]",
                                  "{1: f32[2]}", "(,)"])
def test_bad_args_specs_are_usage_errors_not_tracebacks(tmp_path, capsys, spec):
    src = tmp_path / "hinted.py"
    src.write_text(HINTED)
    code, _, err = run_main(["compile", f"{src}:plain", "--emit", "ir", "--args", spec], capsys)
    assert code == 1 and f"fcir compile: error: --args {spec!r}: line 1" in err
    assert_no_traceback(err)


def test_missing_example_args_hint_is_an_args_that_parses_and_compiles(tmp_path, capsys):
    import shlex

    src = tmp_path / "hinted.py"
    src.write_text(HINTED)
    code, _, err = run_main(["compile", f"{src}:plain", "--emit", "ir"], capsys)
    assert code == 1 and "defines no EXAMPLE_ARGS['plain']" in err
    hint = shlex.split(err[err.rindex("--args ") :])
    assert hint[0] == "--args" and len(hint) == 3  # model and data, not keyed's key
    code, out, err = run_main(["compile", f"{src}:plain", "--emit", "ir", *hint], capsys)
    assert code == 0, err
    assert '.args ({"b": [$0, $1], "w": $2}, ($3, $4))' in out


# --- show -o and --clients-per-step auto -----------------------------------------------


@pytest.mark.parametrize("fmt", ["text", "dot"])
def test_show_writes_text_and_dot_to_the_output_file(files, capsys, tmp_path, fmt):
    paths, _, _ = files
    out = tmp_path / f"shown.{fmt}"
    code, printed, err = run_main(["show", paths["fcir"], "--format", fmt, "-o", out], capsys)
    assert code == 0, err
    assert printed == f"wrote {out}\n"
    body = out.read_text()
    assert body.startswith("fcir.module @fedavg" if fmt == "text" else "digraph")


def test_run_with_auto_clients_per_step_says_which_k_it_chose(files, capsys):
    pytest.importorskip("fcir.interpreters.xla")
    paths, _, _ = files
    code, _, err = run_main(["run", paths["pb"], "--backend", "xla", "--inputs",
                             paths["inputs"], "--clients-per-step", "auto"], capsys)
    assert code == 0, err
    assert re.search(r"clients-per-step auto: k=\d+ members per step and device "
                     r"\(predicted peak [\d,]+ B of a [\d,]+ B limit; tried k=1: ", err), err


# --- source lines ----------------------------------------------------------------------------


def test_check_of_a_python_target_names_the_source_line(files, capsys):
    paths, _, _ = files
    code, out, _ = run_main(["check", f"{paths['py']}:peeks"], capsys)
    lines = TARGET.splitlines()
    line = next(i for i, t in enumerate(lines) if "return x[0] + fcir.reduce_sum" in t)
    assert code == 1
    assert f"at target.py:{line + 1}: local/C1" in out


def test_show_locations_prints_each_ops_source_line(files, capsys):
    paths, _, _ = files
    code, out, _ = run_main(["show", f"{paths['py']}:fedavg", "--locations"], capsys)
    assert code == 0 and 'loc("target.py:' in out
    code, out, _ = run_main(["show", f"{paths['py']}:fedavg"], capsys)
    assert code == 0 and "loc(" not in out


# --- `fcir compile file.py:fn` on a file with future annotations and a dataclass --

_DATACLASS_PROGRAM = '''\
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import Array

import fcir


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Model:
    # Unqualified string annotations: dataclasses resolves them in sys.modules[__module__].
    w: Array
    b: Array


@fcir.program(placements={"clients": 3})
def step(model: Model, x: Array) -> Model:
    local = fcir.map_fn(lambda m, x: Model(m.w + x, m.b + 1.0), (fcir.broadcast(model), x))
    return fcir.reduce_mean(local)


EXAMPLE_ARGS = {"step": lambda: (Model(jnp.zeros(2), jnp.zeros(())), jnp.ones((3, 2)))}
'''


def test_cli_compiles_a_file_with_future_annotations_and_a_dataclass(tmp_path, capsys):
    from fcir import cli

    src = tmp_path / "dc_program.py"
    src.write_text(_DATACLASS_PROGRAM)
    code = cli.main(["compile", f"{src}:step", "--emit", "ir", "-o", str(tmp_path / "out")])
    out, err = capsys.readouterr()
    assert code == 0, err
    text = next((tmp_path / "out").glob("*.fcir")).read_text()
    assert "fed.mean" in text and "jax.add" in text


def test_run_prints_each_output_with_the_program_s_name(tmp_path, capsys):
    (tmp_path / "named.py").write_text(textwrap.dedent("""
        import fcir

        @fcir.program(placements={"clients": 2})
        def named(w, x):
            m = fcir.reduce_mean(fcir.map_fn(lambda w, x: w * x, (fcir.broadcast(w), x)))
            return {"params": {"w": m}, "train_loss": (m * m).sum()}, m
    """))
    np.savez(tmp_path / "in.npz", np.ones(2, np.float32), np.ones((2, 2), np.float32))
    code, out, err = run_main(
        ["run", f"{tmp_path / 'named.py'}:named", "--args", "f32[2]", "f32[2,2]",
         "--inputs", str(tmp_path / "in.npz")], capsys
    )
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("arr_0: float32[2]") and lines[0].endswith("(params.w)")
    assert lines[1].endswith("(train_loss)")
    assert lines[2].startswith("arr_2: float32[2]") and "(" not in lines[2]
