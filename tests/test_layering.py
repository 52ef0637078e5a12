"""Imports go one way: the core never imports a backend, no backend imports a command
line layer, the checker does not import capture, and the XLA backend's modules form
no cycle (budget, cost and executable included)."""

from __future__ import annotations

import ast
import pathlib

import pytest

pytestmark = pytest.mark.jax_independent  # reads the source's imports

ROOT = pathlib.Path(__file__).resolve().parents[1]


def imports_of(path: pathlib.Path, package: str) -> set[str]:
    """Modules ``path`` imports anywhere (function-local imports included), absolute."""
    tree = ast.parse(path.read_text())
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                mod = f"{base}.{node.module}" if node.module else base
                if node.module is None:
                    out.update(f"{base}.{a.name}" for a in node.names)
                    continue
            else:
                mod = node.module
            out.add(mod)
            out.update(f"{mod}.{a.name}" for a in node.names)
    return out


def test_no_backend_imports_a_command_line_layer():
    offenders = []
    for path in sorted((ROOT / "interpreters").rglob("*.py")):
        pkg = "fcir.interpreters." + ".".join(path.relative_to(ROOT / "interpreters").parts[:-1])
        found = imports_of(path, pkg.rstrip("."))
        if {"fcir.cli", "fcir.targets"} & found:
            offenders.append(str(path.relative_to(ROOT)))
    assert not offenders, f"backends importing the CLI layer: {offenders}"


def test_the_checker_does_not_import_capture():
    found = imports_of(ROOT / "fcir" / "check.py", "fcir")
    assert "fcir.capture" not in found


def test_one_list_of_elementwise_ops():
    import importlib

    capture, check, elementwise, streaming = (
        importlib.import_module(m)
        for m in (
            "fcir.capture",
            "fcir.check",
            "fcir.elementwise",
            "fcir.interpreters.xla.streaming",
        )
    )

    assert capture.ELEMENTWISE is elementwise.PER_MEMBER
    assert check.ELEMENTWISE is elementwise.PER_MEMBER
    assert {n.removeprefix("jax.") for n in streaming.ELEMENTWISE} == elementwise.ELEMENTWISE
    assert not elementwise.ELEMENTWISE & elementwise.LAYOUT


def test_xla_backend_modules_import_one_way():
    folder = ROOT / "interpreters" / "xla"
    pkg = "fcir.interpreters.xla"
    names = {p.stem for p in folder.glob("*.py") if p.stem != "__init__"}
    graph = {
        n: {
            m.rsplit(".", 1)[-1]
            for m in imports_of(folder / f"{n}.py", pkg)
            if m.startswith(pkg + ".") and m.count(".") == pkg.count(".") + 1
        }
        & names - {n}
        for n in names
    }
    assert "budget" in graph["build"] and "executable" in graph["budget"]
    seen: dict[str, int] = {}

    def visit(n, stack):
        if seen.get(n) == 1:
            raise AssertionError(f"import cycle: {' -> '.join([*stack, n])}")
        if seen.get(n) == 2:
            return
        seen[n] = 1
        for m in sorted(graph[n]):
            visit(m, [*stack, n])
        seen[n] = 2

    for n in sorted(graph):
        visit(n, [])


def test_clients_per_step_is_validated_in_one_place():
    import re

    folder = ROOT / "interpreters" / "xla"
    checks = [
        p.name
        for p in folder.glob("*.py")
        if re.search(r"isinstance\(\s*(clients_per_step|k)\s*,\s*bool\)", p.read_text())
    ]
    assert checks == ["streaming.py"], checks
