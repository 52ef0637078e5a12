"""Imports go one way, as docs/architecture.md's layer table says, and form no circle.

The module graph is read from the source: every import of every module under
``fcir/``, ``interpreters/`` (``fcir.interpreters``) and ``checkpoint/``
(``fcir.checkpoint``), function-local ones included. Importing ``a.b.c`` from outside
``a.b`` also runs ``a.b``'s ``__init__`` first, so that is an edge too (but the root
``fcir``'s, which every import runs: only importing ``fcir`` itself, the public API,
is an edge to it). The layer table is read from docs/architecture.md, so the page and
the rule are one: every module has its row, and every edge goes down or stays within
its side of a row.
"""

from __future__ import annotations

import ast
import importlib
import pathlib
import re

import pytest

pytestmark = pytest.mark.jax_independent  # reads the source's imports

ROOT = pathlib.Path(__file__).resolve().parents[1]
# Source folder -> the package it is imported as (pyproject's package-dir).
FOLDERS = {"fcir": "fcir", "interpreters": "fcir.interpreters", "checkpoint": "fcir.checkpoint"}


def module_files() -> dict[str, pathlib.Path]:
    """Every fcir module by its import name."""
    out = {}
    for folder, package in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            name = ".".join([package, *parts])
            if folder == "fcir" and name.startswith(("fcir.interpreters", "fcir.checkpoint")):
                continue
            out[name] = path
    return out


def imports_of(source: str, module: str, is_package: bool = False) -> set[str]:
    """Every name ``source`` (module ``module``) imports, anywhere in it (function-local
    imports included), absolute: ``from a import b`` gives ``a.b`` (which may be a module
    or a name in ``a``)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module if is_package else module.rpartition(".")[0]
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                mod = f"{base}.{node.module}" if node.module else base
            else:
                mod = node.module
            out.update(f"{mod}.{a.name}" for a in node.names)
    return out


def module_graph(files: dict[str, pathlib.Path]) -> dict[str, set[str]]:
    """Module -> the fcir modules importing it runs (see the module docstring)."""

    def owner(name: str) -> str | None:  # the module an imported name lives in
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        edges = set()
        for name in imports_of(path.read_text(), module, path.name == "__init__.py"):
            target = owner(name)
            if target is None or target == module:
                continue
            edges.add(target)
            parts = target.split(".")
            for i in range(2, len(parts)):  # the packages above it, but the root fcir
                package = ".".join(parts[:i])
                if package in files and not module.startswith(package + "."):
                    edges.add(package)
        graph[module] = edges - {module}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph`` (``[a, b, ..., a]``), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        path.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return [*path[path.index(m):], m]
            if m not in state and (found := visit(m)):
                return found
        path.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (found := visit(n)):
            return found
    return None


@pytest.fixture(scope="module")
def graph():
    return module_graph(module_files())


ARCHITECTURE = ROOT / "docs" / "architecture.md"


def layer_table(text: str) -> list[list[list[str]]]:
    """The rows of the layer table in ``text`` (the code block after "Which way imports
    go"), bottom first: each row its sides (``|``), each side its names (``,``), each
    name absolute (``ir`` is ``fcir.ir``, ``fcir`` the root). A row is a line that does
    not start with a space; its names end at the first run of two spaces."""
    block = text.split("## Which way imports go", 1)[1].split("```", 2)[1]
    rows = []
    for line in block.splitlines():
        if not line.strip() or line[0].isspace():
            continue  # the block's opening line, or a description's continuation
        names = re.split(r"\s{2,}", line.strip(), maxsplit=1)[0]
        rows.append(
            [
                [n if n == "fcir" else f"fcir.{n}" for n in map(str.strip, side.split(","))]
                for side in names.split("|")
            ]
        )
    return rows


def place(module: str, rows: list[list[list[str]]]) -> tuple[int, int] | None:
    """(row, side) of ``module``: that of the longest table name it is or is under."""
    best, where = -1, None
    for r, row in enumerate(rows):
        for g, side in enumerate(row):
            for name in side:
                under = module == name or (name != "fcir" and module.startswith(name + "."))
                if under and len(name) > best:
                    best, where = len(name), (r, g)
    return where


def wrong_way(graph: dict[str, set[str]], rows) -> list[str]:
    """Every edge of ``graph`` the table forbids (up a row, or across a ``|``), and every
    module it does not place."""
    out = [f"{m}: not in the layer table" for m in sorted(graph) if place(m, rows) is None]
    for m, targets in sorted(graph.items()):
        here = place(m, rows)
        for t in sorted(targets):
            there = place(t, rows)
            if here and there and (there[0] > here[0] or (there[0] == here[0] and there != here)):
                out.append(f"{m} -> {t}")
    return out


@pytest.fixture(scope="module")
def rows():
    return layer_table(ARCHITECTURE.read_text())


# --- the reader and the cycle finder themselves ----------------------------------------


def test_the_reader_sees_local_relative_and_package_imports():
    source = (
        "import fcir.ir.text\n"
        "from . import sibling\n"
        "from ..production import export\n"
        "def f():\n"
        "    from fcir.interpreters import xla\n"
    )
    found = imports_of(source, "fcir.interpreters.flower.app_writer")
    assert found == {
        "fcir.ir.text",
        "fcir.interpreters.flower.sibling",
        "fcir.interpreters.production.export",
        "fcir.interpreters.xla",
    }
    # In a package's __init__, "." is the package itself.
    assert imports_of("from .writer import x", "fcir.interpreters.flower", True) == {
        "fcir.interpreters.flower.writer.x"
    }


def test_the_graph_counts_the_packages_an_import_initialises(tmp_path):
    a = tmp_path / "a.py"
    a.write_text("def f():\n    from fcir.pkg.mod import name\n")
    b = tmp_path / "b.py"
    b.write_text("from fcir import pkg\n")
    init = tmp_path / "__init__.py"
    init.write_text("from fcir.a import f\n")
    files = {"fcir.a": a, "fcir.pkg.mod": b, "fcir.pkg": init}
    graph = module_graph(files)
    assert graph["fcir.a"] == {"fcir.pkg.mod", "fcir.pkg"}
    assert graph["fcir.pkg.mod"] == {"fcir.pkg"}  # its own package: already initialising
    assert find_cycle(graph) == ["fcir.a", "fcir.pkg", "fcir.a"]


def test_the_cycle_finder_reports_the_circle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


# --- the rules ------------------------------------------------------------------------


def test_no_import_cycle(graph):
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_imports_follow_the_layer_table(graph, rows):
    offenders = wrong_way(graph, rows)
    assert not offenders, "against docs/architecture.md's layer table:\n" + "\n".join(offenders)


def test_the_table_holds_the_stated_rules(rows):
    """The rules docs/architecture.md states in words are ones the table makes."""
    graph = {
        "fcir.ir.nodes": {"fcir.fed.sum"},  # the IR reads an op
        "fcir.fed.sum": {"fcir.checker.check"},  # an op reads the checker
        "fcir.frontend.capture": {"fcir.interpreters.xla"},  # the core imports a backend
        "fcir.learning.fedavg": {"fcir", "fcir.interpreters.flower"},  # a backend: no
        "fcir.cli.commands": {"fcir.checkpoint", "fcir.interpreters.reference"},
        "fcir.interpreters.production.cli": {"fcir.interpreters.flower.cli"},
        "fcir.interpreters.xla.build": {"fcir.cli.commands", "fcir.interpreters.reference"},
        "fcir.interpreters.flower.cli": {"fcir.interpreters.production.cli", "fcir.checkpoint"},
        "fcir.newpackage.mod": set(),
    }
    assert wrong_way(graph, rows) == [
        "fcir.newpackage.mod: not in the layer table",
        "fcir.cli.commands -> fcir.checkpoint",
        "fcir.cli.commands -> fcir.interpreters.reference",
        "fcir.fed.sum -> fcir.checker.check",
        "fcir.frontend.capture -> fcir.interpreters.xla",
        "fcir.interpreters.production.cli -> fcir.interpreters.flower.cli",
        "fcir.interpreters.xla.build -> fcir.cli.commands",
        "fcir.interpreters.xla.build -> fcir.interpreters.reference",
        "fcir.ir.nodes -> fcir.fed.sum",
        "fcir.learning.fedavg -> fcir.interpreters.flower",
    ]


def test_the_table_reader_reads_rows_sides_and_continuations():
    text = (
        "## Which way imports go\n\n```\n"
        "errors, ir    the floor\n"
        "a | b, c.d    two sides\n"
        "              a continuation\n"
        "fcir\n```\n"
    )
    assert layer_table(text) == [
        [["fcir.errors", "fcir.ir"]],
        [["fcir.a"], ["fcir.b", "fcir.c.d"]],
        [["fcir"]],
    ]
    assert place("fcir.c.d.e", layer_table(text)) == (1, 1)
    assert place("fcir.c", layer_table(text)) is None


def test_the_checkpoint_library_imports_nothing_of_fcir_but_errors_protos_and_jax():
    """Besides itself: fcir's errors, its protos and the JAX boundary (``fcir.jaxcompat``,
    the one place that touches JAX's internals)."""
    graph = module_graph(module_files())
    allowed = ("fcir.checkpoint", "fcir.errors", "fcir._proto", "fcir.jaxcompat")
    offenders = sorted(
        f"{m} -> {t}"
        for m, targets in graph.items()
        if m.startswith("fcir.checkpoint")
        for t in targets
        if not t.startswith(allowed)
    )
    assert not offenders, offenders


def test_one_list_of_elementwise_ops():
    capture, check, elementwise, streaming = (
        importlib.import_module(m)
        for m in (
            "fcir.frontend.capture",
            "fcir.checker.check",
            "fcir.ir.elementwise",
            "fcir.interpreters.xla.streaming",
        )
    )

    assert capture.ELEMENTWISE is elementwise.PER_MEMBER
    assert check.ELEMENTWISE is elementwise.PER_MEMBER
    assert {n.removeprefix("jax.") for n in streaming.ELEMENTWISE} == elementwise.ELEMENTWISE
    assert not elementwise.ELEMENTWISE & elementwise.LAYOUT


def test_xla_backend_modules_import_one_way(graph):
    pkg = "fcir.interpreters.xla"
    assert f"{pkg}.memory_budget" in graph[f"{pkg}.build"]
    assert f"{pkg}.executable" in graph[f"{pkg}.memory_budget"]
    xla = {m: {t for t in ts if t.startswith(pkg + ".")} for m, ts in graph.items()
           if m.startswith(pkg + ".")}
    assert find_cycle(xla) is None


def test_clients_per_step_is_validated_in_one_place():
    folder = ROOT / "interpreters" / "xla"
    checks = [
        p.name
        for p in folder.glob("*.py")
        if re.search(r"isinstance\(\s*(clients_per_step|k)\s*,\s*bool\)", p.read_text())
    ]
    assert checks == ["streaming.py"], checks


def test_every_source_package_is_installed():
    """A package folder missing from pyproject's ``packages`` is left out of a wheel."""
    import tomllib

    declared = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
                   ["packages"])
    found = {m for m, p in module_files().items() if p.name == "__init__.py"}
    assert found == declared, (found - declared, declared - found)
