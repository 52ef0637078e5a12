"""What the whole tree holds to: code, tests and docs say the behaviour they are about,
not the tracker number that asked for it ("issue 17, item 16" means nothing to whoever
reads the line next), and no function is longer than a reader can hold (100 lines)."""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

pytestmark = pytest.mark.jax_independent  # reads text

ROOT = pathlib.Path(__file__).resolve().parents[1]
FOLDERS = ("fcir", "interpreters", "checkpoint", "tests", "tools", "bench", "examples", "docs")
TRACKER = re.compile(r"(?<![-\w])(?:issues? ?#?\d+|items? \d+(?: and \d+)?\b)", re.I)


def tracker_words(text: str) -> list[str]:
    return [m.group(0) for m in TRACKER.finditer(text)]


def test_the_reader_finds_tracker_numbers_only():
    assert tracker_words("(issue 17, item 16); Issue 32 item 7; issues 3") == [
        "issue 17", "item 16", "Issue 32", "item 7", "issues 3"
    ]  # fmt: skip
    assert tracker_words("--items 20, 2 items, the issue is the order") == []


def test_no_tracker_numbers_in_code_tests_or_docs():
    files = [ROOT / "README.md"]
    for folder in FOLDERS:
        files += [p for p in (ROOT / folder).rglob("*") if p.suffix in (".py", ".md", ".sh")]
    hits = [
        f"{p.relative_to(ROOT)}: {w}"
        for p in files
        if "_proto" not in p.parts and p.name != pathlib.Path(__file__).name  # its examples
        for w in tracker_words(p.read_text())
    ]
    assert not hits, hits


# --- units a reader can hold --------------------------------------------------------------

LONGEST = 100
UNIT_FOLDERS = ("fcir", "interpreters", "checkpoint", "tests", "tools", "bench", "examples")


def long_functions(source: str, limit: int = LONGEST) -> list[tuple[str, int]]:
    """(name, lines) of every function or method in ``source`` longer than ``limit``."""
    return [
        (node.name, node.end_lineno - node.lineno + 1)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno - node.lineno + 1 > limit
    ]


def test_the_length_counts_a_function_s_every_line():
    source = "def f():\n" + "    x = 1\n" * 100 + "def g():\n    return 1\n"
    assert long_functions(source) == [("f", 101)]
    assert long_functions(source, limit=101) == []


def test_no_function_is_over_100_lines():
    hits = [
        f"{path.relative_to(ROOT)}: {name} ({n} lines)"
        for folder in UNIT_FOLDERS
        for path in sorted((ROOT / folder).rglob("*.py"))
        if "_proto" not in path.parts
        for name, n in long_functions(path.read_text())
    ]
    assert not hits, hits
