"""Every ```python block in the README and docs/ runs. Blocks of one file run in order
in one namespace, so a page can build on its earlier blocks. A block fenced
```python excerpt shows lines of a file at their place in it: the test of that file
checks it is a verbatim excerpt (docs/flower_app.md: test_flower_user_app.py)."""

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


# --- what the pages cite exists ---------------------------------------------------------

# A repository path: a top-level folder of the checkout, then a file (with its
# extension) or a folder (with its slash). A path a test page cites is under tests/
# (contributing.md: `checkpoint/test_durability.py`).
CITED_PATH = re.compile(
    r"(?<![\w./<-])((?:fcir|interpreters|checkpoint|tests|docs|bench|tools|examples|protos"
    r"|\.ci)/(?:[\w.-]+/)*(?:[\w-]+\.\w+\b|(?=[\s`),;:]|$)))(?![\w<*/-])"
)
# A page or a module named without its folder, in backticks (`bench.md`, `budget.py`).
CITED_NAME = re.compile(r"`([\w-]+\.(?:md|py))`")
# A link to another file of the checkout, relative to the page: [text](privacy.md#keys).
LINK = re.compile(r"\]\((?![a-z]+:)([^)#\s]+)")


def cited_paths(text: str) -> tuple[set[str], set[str]]:
    """(repository paths, bare file names) that ``text`` cites."""
    paths = {m.group(1).rstrip("/") for m in CITED_PATH.finditer(text)}
    return paths, set(CITED_NAME.findall(text))


def test_the_path_reader_finds_paths_and_names_but_not_placeholders():
    text = (
        "see fcir/ir/text.py, `bench.md` and interpreters/xla/; not fcir_app/program.py, "
        "fcir/fed/<op>.py or tests/golden/jax<X.Y>/, `x/y.py`."
    )
    paths, names = cited_paths(text)
    assert paths == {"fcir/ir/text.py", "interpreters/xla"}
    assert names == {"bench.md"}


def test_every_path_a_page_cites_exists():
    """Every repository path the README and docs/ cite is in the checkout, every page
    or module they name without a folder is a file of it somewhere, and every link
    to a file leads to one."""
    files = {p.name for p in ROOT.rglob("*") if ".venv" not in p.parts and ".git" not in p.parts}
    missing = []
    for page in PAGES:
        paths, names = cited_paths(page.read_text())
        where = page.relative_to(ROOT)
        missing += [
            f"{where}: {p}"
            for p in sorted(paths)
            if not any((base / p).exists() for base in (ROOT, ROOT / "tests"))
        ]
        missing += [f"{where}: {n}" for n in sorted(names) if n not in files]
        links = set(LINK.findall(page.read_text()))
        missing += [f"{where}: {n}" for n in sorted(links) if not (page.parent / n).exists()]
    assert not missing, missing


def test_readme_says_which_examples_take_longer_than_a_minute():
    """The README's examples run in under a minute on 2 cores, but for those on Flower's
    Simulation Engine, whose start-up alone costs about 55 CPU seconds a run: the
    sentence above the table names each of them (a script that calls ``simulate``, or an
    ``fcir flower simulate`` command)."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Examples", 1)[1].split("\n## ", 1)[0]
    intro, table = section.split("\n|", 1)
    rows = re.findall(r"^\| `([^`]+)` \|", "|" + table, re.M)
    simulated = []
    for command in rows:
        if command.startswith("fcir flower simulate"):
            simulated.append(command.rsplit(" --", 1)[0])
        elif command.startswith("python examples/"):
            script = ROOT / command.split()[1]
            if "flower.simulation import simulate" in script.read_text():
                simulated.append(script.name)
    assert len(simulated) == 2, rows
    assert "under a minute on 2 CPU cores, but for the" in intro
    for name in simulated:
        assert name in intro, (name, intro)
