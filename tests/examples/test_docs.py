"""Every ```python block in the README and docs/ runs. Blocks of one file run in order
in one namespace, so a page can build on its earlier blocks. A block fenced
```python excerpt shows lines of a file at their place in it: the test of that file
checks it is a verbatim excerpt (docs/flower_app.md's wrappers: test_flower_user_app.py)."""

from __future__ import annotations

import os
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def blocks(path: pathlib.Path) -> list[str]:
    return BLOCK.findall(path.read_text())


@pytest.mark.parametrize(
    "page", [p for p in PAGES if p.exists() and blocks(p)], ids=lambda p: str(p.relative_to(ROOT))
)
def test_python_blocks_run(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # pages may write files; keep them out of the checkout
    namespace = {"__name__": "__docs__"}
    for i, code in enumerate(blocks(page)):
        try:
            exec(compile(code, f"{page.name}[block {i}]", "exec"), namespace)
        except Exception as e:
            raise AssertionError(f"{page.relative_to(ROOT)} block {i} failed: {e!r}") from e


def test_readme_commands_match_ci():
    """The README's test command is the one .ci/run runs."""
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    commands = re.findall(r"^```bash\n(.*?)\n```", readme, re.S | re.M)
    assert len(commands) == 2, "the README has exactly two set-up commands"
    assert commands[1].strip() in ci
    assert os.access(ROOT / ".ci" / "run", os.X_OK)
