"""No fed op is named by string outside its own module (``fcir/fed/``) and the IR
parser: code elsewhere compares op classes (``fcir.fed.op_class(op) is F.Broadcast``),
asks for kinds (``fcir.fed.of_kind``) or reads a table keyed by class, so a renamed or
misspelt op is a Python error instead of a branch that silently never runs."""

from __future__ import annotations

import ast
import inspect
import pathlib
import re

import fcir
from fcir import fed as F

ROOT = pathlib.Path(__file__).resolve().parents[2]

_FED_NAME = re.compile(r"fed\.([A-Za-z_]\w*)")


def names_an_op(text: str) -> bool:
    """``text`` is a fed op's name, or starts with one (``"fed.sum/C2"``, ``"fed.map:
    member computation"``)."""
    if text in F.ops():
        return True
    m = _FED_NAME.match(text)
    return m is not None and f"fed.{m[1]}" in F.ops()


def offending_strings(source: str) -> list[tuple[int, str]]:
    """(line, text) of every string constant in ``source`` that names a fed op (the
    literal parts of f-strings included)."""
    return sorted(
        (node.lineno, node.value)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
        and names_an_op(node.value)
    )


def _allowed(rel: str) -> bool:
    parser = pathlib.Path(inspect.getsourcefile(fcir.parse)).resolve().relative_to(ROOT)
    return rel.startswith("fcir/fed/") or rel == parser.as_posix()


def _sources():
    for folder in ("fcir", "interpreters"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            yield path.relative_to(ROOT).as_posix(), path.read_text()


def offenders() -> dict[str, list[tuple[int, str]]]:
    out = {}
    for rel, source in _sources():
        if not _allowed(rel):
            found = offending_strings(source)
            if found:
                out[rel] = found
    return out


def test_no_fed_op_is_named_by_string_outside_fcir_fed_and_the_parser():
    found = offenders()
    new = {rel: hits[:3] for rel, hits in found.items()}
    assert not new, (
        f"fed ops named by string (compare classes, fcir.fed.op_class(op) is F.Sum, or "
        f"ask fcir.fed.of_kind): {new}"
    )


def test_the_scan_sees_op_names_and_prefixed_texts_but_not_other_fed_words():
    source = (
        'a = "fed.sum"\n'
        "b = f'fed.map: {n} ops'\n"
        'c = "fed.broadcast/C2"\n'
        'd = "fed."\n'
        'e = "fed.no_such_op"\n'
        'f = "a value reaches members only through fed.broadcast"\n'
        'g = "fed_sum"\n'
    )
    assert offending_strings(source) == [
        (1, "fed.sum"),
        (2, "fed.map: "),
        (3, "fed.broadcast/C2"),
    ]


def test_the_parser_and_the_op_modules_are_the_only_files_allowed_to_name_ops():
    assert _allowed("fcir/fed/sum.py")
    assert not _allowed("fcir/base_interpreter.py") and not _allowed("interpreters/reference.py")
    parser = inspect.getsourcefile(fcir.parse)
    assert _allowed(pathlib.Path(parser).resolve().relative_to(ROOT).as_posix())


def _imports_fcir_ops(source: str) -> bool:
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            if node.module == "fcir.ops" or (
                node.module == "fcir" and any(a.name == "ops" for a in node.names)
            ):
                return True
        elif isinstance(node, ast.Import) and any(a.name == "fcir.ops" for a in node.names):
            return True
    return False


def test_the_removed_fcir_ops_shim_stays_removed():
    importers = set()
    for folder in ("fcir", "interpreters", "tests", "tools", "examples"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if _imports_fcir_ops(path.read_text()):
                importers.add(path.relative_to(ROOT).as_posix())
    assert not importers, f"fcir.ops is a removed shim: {importers}"
    assert not (ROOT / "fcir" / "ops.py").exists()
    assert _imports_fcir_ops("from fcir.ops import dtype_bits\n")
