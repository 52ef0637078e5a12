"""Every install command the docs and error messages give works from a checkout: fcir
is not on the package index, so `pip install 'fcir[flower]'` finds nothing; the
extras are installed with `pip install -e ".[flower]"`, and each extra named exists."""

import pathlib
import re
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[2]
SOURCES = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").rglob("*.md")),
    *sorted((ROOT / "fcir").rglob("*.py")),
    *sorted((ROOT / "interpreters").rglob("*.py")),
    *sorted((ROOT / "examples").rglob("*.py")),
]


def _extras() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return set(project["optional-dependencies"])


def test_no_install_command_names_fcir_on_the_package_index():
    offenders = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for path in SOURCES
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"\bfcir\[[a-z,]+\]", line)
    ]
    assert not offenders, "\n".join(offenders)


def test_every_extra_an_install_command_names_exists():
    extras = _extras()
    named = {
        (path.relative_to(ROOT), extra)
        for path in SOURCES
        for group in re.findall(r"pip install -e ['\"]\.\[([a-z,]+)\]['\"]", path.read_text())
        for extra in group.split(",")
    }
    assert {"flower", "storage", "iree"} <= {e for _, e in named}  # the docs name them
    assert not {(p, e) for p, e in named if e not in extras}
