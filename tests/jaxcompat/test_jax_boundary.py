"""fcir/jaxcompat/ is the one JAX boundary: no other module of fcir, its backends
(interpreters/, the Flower app code the exporter installs included) imports
``jax._src``, ``jax.interpreters`` or ``jax.extend``, at module level or inside a
function, directly or through ``importlib``/``__import__``."""

from __future__ import annotations

import ast
import pathlib

import pytest

pytestmark = pytest.mark.jax_independent  # reads the source's imports

ROOT = pathlib.Path(__file__).resolve().parents[2]
PRIVATE = ("jax._src", "jax.interpreters", "jax.extend")
BOUNDARY = ROOT / "fcir" / "jaxcompat"


def _private(name: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in PRIVATE)


def private_imports(source: str) -> list[tuple[int, str]]:
    """(line, module) for every import of a JAX internal in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if _private(a.name)]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if _private(node.module):
                found.append((node.lineno, node.module))
            elif node.module == "jax":  # from jax import extend / interpreters
                found += [
                    (node.lineno, f"jax.{a.name}") for a in node.names if _private(f"jax.{a.name}")
                ]
        elif isinstance(node, ast.Call) and node.args:
            f = node.func
            name = (
                f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
            )
            arg = node.args[0]
            if name in ("__import__", "import_module") and isinstance(arg, ast.Constant):
                if isinstance(arg.value, str) and _private(arg.value):
                    found.append((node.lineno, arg.value))
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            # jax._src.core used as an attribute chain after a plain `import jax`
            if node.value.id == "jax" and node.attr in ("_src", "interpreters", "extend"):
                found.append((node.lineno, f"jax.{node.attr}"))
    return sorted(found)


def _sources():
    for top in ("fcir", "interpreters", "checkpoint"):
        for path in sorted((ROOT / top).rglob("*.py")):
            if BOUNDARY in path.parents or path.parent == BOUNDARY:
                continue
            yield path


def test_only_jaxcompat_imports_jax_internals():
    offenders = [
        f"{path.relative_to(ROOT)}:{line}: {mod}"
        for path in _sources()
        for line, mod in private_imports(path.read_text())
    ]
    assert not offenders, (
        "JAX internals are imported outside fcir/jaxcompat/ (the one JAX boundary); "
        "import them from fcir.jaxcompat instead:\n" + "\n".join(offenders)
    )


def test_the_scan_covers_the_backends_and_the_flower_app():
    names = {str(p.relative_to(ROOT)) for p in _sources()}
    assert "fcir/frontend/capture.py" in names and "interpreters/xla/interpreter.py" in names
    assert any(n.startswith("interpreters/flower/app/") for n in names)
    assert not any(n.startswith("fcir/jaxcompat/") for n in names)


@pytest.mark.parametrize(
    "source",
    [
        "from jax._src import core",
        "import jax._src.core as c",
        "from jax._src.interpreters import partial_eval as pe",
        "import jax.interpreters.pxla",
        "from jax.extend import core",
        "from jax import extend",
        "def f():\n    from jax._src import config\n",
        "import importlib\nimportlib.import_module('jax._src.mesh')",
        "__import__('jax._src.api', fromlist=['Inline'])",
        "import jax\nx = jax._src.core.Jaxpr",
    ],
)
def test_the_check_sees_every_way_of_importing_an_internal(source):
    assert private_imports(source), source


@pytest.mark.parametrize(
    "source",
    [
        "import jax",
        "from jax import numpy",
        "from jax.sharding import PartitionSpec",
        "from fcir.jaxcompat import core",
        "import jax.numpy as jnp\njnp.zeros(2)",
    ],
)
def test_public_jax_and_the_boundary_are_allowed(source):
    assert private_imports(source) == []
