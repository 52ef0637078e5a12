"""Every fed op has a rule in every backend (or an explicit 'unsupported' entry), and
every op class declares its constraints and primitive: nothing is left to a table gap."""

from __future__ import annotations

import pytest

from fcir.interpreter import Interpreter
from fcir.ops import FED_OPS
from fcir.primitives import FEDERATED_PRIMITIVES


def backends() -> dict[str, set[str]]:
    from fcir.interpreters import reference, xla
    from fcir.interpreters.production import splitting

    return {
        "reference": set(reference.ReferenceInterpreter._impls),
        "xla": set(xla.XlaInterpreter._impls),
        "production": set(splitting.OP_RULES),
    }


@pytest.mark.parametrize("backend", ["reference", "xla", "production"])
def test_every_fed_op_has_a_rule(backend):
    missing = sorted(set(FED_OPS) - backends()[backend])
    assert not missing, f"{backend} has no rule for {missing}"


def test_every_fed_op_is_a_primitive_with_constraints():
    prims = {cls.primitive for cls in FED_OPS.values()}
    assert prims == set(FEDERATED_PRIMITIVES.values())
    for name, cls in FED_OPS.items():
        assert cls.constraints and all(k.startswith("C") for k in cls.constraints), name
        assert cls.__doc__, f"{name} has no docstring"


def test_base_interpreter_gives_every_fed_op_a_meaning():
    assert set(FED_OPS) <= set(Interpreter._impls)
