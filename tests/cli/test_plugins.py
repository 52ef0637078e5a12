"""Backends and libraries add their commands and backends to ``fcir`` through entry
points (``fcir.cli.plugins``): the core CLI imports none of them."""

from __future__ import annotations

import pathlib
import sys
import tomllib
import types
from importlib import metadata

import numpy as np
import pytest

from fcir import cli
from fcir.cli import plugins

ROOT = pathlib.Path(__file__).resolve().parents[2]


def declared(group: str) -> dict[str, str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return dict(project["entry-points"][group])


@pytest.mark.parametrize("group", [plugins.COMMANDS, plugins.BACKENDS])
def test_the_installed_entry_points_are_the_declared_ones(group):
    """Entry points are metadata: a stale install (pyproject edited, not reinstalled)
    would run other commands than the source declares."""
    installed = {ep.name: ep.value for ep in metadata.entry_points(group=group)}
    assert installed == declared(group)


def subcommands(parser) -> set[str]:
    (action,) = [a for a in parser._actions if a.dest == "command"]
    return set(action.choices)


def test_help_lists_the_core_and_every_plugins_commands():
    names = subcommands(cli.build_parser())
    assert {"compile", "show", "check", "diff", "run"} <= names
    assert {"export", "run-plan", "flower", "ckpt"} <= names


class _EntryPoint:
    def __init__(self, name, obj=None, error=None):
        self.name, self._obj, self._error = name, obj, error

    def load(self):
        if self._error:
            raise self._error
        return self._obj


def _with(monkeypatch, group, extra):
    real = metadata.entry_points

    def entry_points(*, group: str):
        found = list(real(group=group))
        return found + extra if group == wanted else found

    wanted = group
    monkeypatch.setattr(plugins.metadata, "entry_points", entry_points)


def test_a_command_plugin_that_cannot_import_adds_nothing(monkeypatch):
    def register(sub):
        sub.add_parser("hello", help="says hello")

    _with(monkeypatch, plugins.COMMANDS, [
        _EntryPoint("broken", error=ImportError("no module named 'missing_dependency'")),
        _EntryPoint("hello", register),
    ])
    names = subcommands(cli.build_parser())
    assert "hello" in names and "broken" not in names and "compile" in names


def test_run_takes_any_installed_backend(monkeypatch, tmp_path, capsys):
    seen = {}

    def run_program(module, args, clients_per_step=None):
        seen["module"], seen["args"] = module.name, args
        return np.arange(3.0)

    echo = types.SimpleNamespace(run_program=run_program, STREAMS=False)
    _with(monkeypatch, plugins.BACKENDS, [_EntryPoint("echo", echo)])
    assert "echo" in plugins.backend_names()
    src = tmp_path / "prog.py"
    src.write_text(
        "import jax.numpy as jnp\n"
        "def double(x):\n"
        "    return 2 * x\n"
        "EXAMPLE_ARGS = {'double': lambda: (jnp.zeros(3),)}\n"
    )
    np.savez(tmp_path / "in.npz", np.ones(3, np.float32))
    code = cli.main(["run", f"{src}:double", "--backend", "echo", "--inputs",
                     str(tmp_path / "in.npz")])
    out = capsys.readouterr().out
    assert code == 0, out
    assert seen["module"] == "double" and len(seen["args"]) == 1
    assert "arr_0: float64[3] [0., 1., 2.]" in out


def test_clients_per_step_names_the_backends_that_stream(capsys):
    code = cli.main(["run", "x.fcir", "--inputs", "x.npz", "--clients-per-step", "2"])
    err = capsys.readouterr().err
    assert code == 2
    assert "--clients-per-step streams members on the xla backend: add --backend xla" in err
    assert plugins.streaming_backends() == ["xla"]


def test_the_core_cli_loads_no_backend_to_build_its_parser():
    code = (
        "import sys; from fcir import cli; cli.build_parser(); "
        "print(sorted(m for m in sys.modules if m.startswith(('fcir.interpreters.xla', "
        "'fcir.interpreters.reference'))))"
    )
    import subprocess

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"
