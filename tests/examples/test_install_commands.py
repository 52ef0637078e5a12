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


def _requirement_names(requirements) -> set[str]:
    return {re.match(r"[A-Za-z0-9_.-]+", r)[0].lower().replace("_", "-") for r in requirements}


def test_every_example_s_imports_come_with_fcir_or_the_extras_it_names():
    """An example imports (anywhere in it) only the standard library, fcir, the files
    beside it, fcir's own dependencies, and those of the extras its docstring's
    ``pip install -e ".[...]"`` names: the README's `python examples/X.py` works after
    `pip install -e .` plus that command. (The training examples import optax, which
    is a dependency of fcir itself, as fcir.learning needs it.)"""
    import ast
    import importlib.metadata
    import sys

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    providers = importlib.metadata.packages_distributions()
    local = {p.stem for p in (ROOT / "examples").glob("*.py")}
    missing = []
    for path in sorted((ROOT / "examples").glob("*.py")):
        tree = ast.parse(path.read_text())
        named = re.findall(
            r"pip install -e ['\"]\.\[([a-z,]+)\]['\"]", ast.get_docstring(tree) or ""
        )
        allowed = _requirement_names(project["dependencies"])
        for group in named:
            for extra in group.split(","):
                allowed |= _requirement_names(extras[extra])
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                modules = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                modules = [node.module]
            else:
                continue
            for top in {m.split(".")[0] for m in modules}:
                if top in sys.stdlib_module_names or top in local or top == "fcir":
                    continue
                dists = {d.lower().replace("_", "-") for d in providers.get(top, [])}
                if not dists & allowed:
                    missing.append(
                        f"{path.name} imports {top} ({sorted(dists) or 'not installed'})"
                    )
    assert not missing, "\n".join(missing)
