"""docs/production.md runs, and every output it shows is the real one."""

from __future__ import annotations

import pathlib

import pytest
from productionlib import doc_runner

# Runs the whole page (exports, bundles, run-plan): 8 s, like the examples (docs/contributing.md).
pytestmark = pytest.mark.slow

PAGE = pathlib.Path(__file__).resolve().parents[3] / "docs" / "production.md"


def test_production_page_runs_and_shows_real_outputs():
    problems = doc_runner.run(PAGE)
    assert not problems, (
        "\n\n".join(problems) + "\n\nIf the new outputs are right, update the page with:\n"
        "  python tests/productionlib/doc_runner.py docs/production.md --update"
    )
