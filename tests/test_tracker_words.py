"""Code, tests and docs say the behaviour they are about, not the tracker number that
asked for it: "issue 17, item 16" means nothing to whoever reads the line next."""

from __future__ import annotations

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
