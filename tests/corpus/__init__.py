"""The test corpus: federated programs, example arguments and plain-JAX oracles.

Every backend and check runs the same ``CASES``. A program module defines ``CASE``;
those whose body DrJAX can also express (one placement; only broadcast, map_fn,
reduce_sum, reduce_mean, reduce_weighted_mean) build it from the API module they are
given (``build(api)``), so ``drjax_program(name)`` runs the same body on ``drjax``.
"""

from __future__ import annotations

from collections.abc import Callable

from . import (
    bf16_client,
    client_rng,
    diloco,
    fedadam,
    fedavg_mlp,
    fedavg_weighted,
    fedprox,
    fedsgd_linreg,
    hierarchical_fedavg,
    int_mean,
    minmax_agg,
    robust_agg,
    scan_rounds,
    secure_histogram,
    temperature_sensors,
    transformer,
)
from .case import Case, sum_of_squares
from .compare import assert_trees_match

__all__ = [
    "CASES",
    "DRJAX_NAMES",
    "Case",
    "assert_trees_match",
    "case",
    "drjax_program",
    "sum_of_squares",
]

_MODULES = (
    temperature_sensors,
    fedsgd_linreg,
    fedavg_mlp,
    transformer,
    fedprox,
    fedadam,
    diloco,
    fedavg_weighted,
    secure_histogram,
    hierarchical_fedavg,
    minmax_agg,
    client_rng,
    bf16_client,
    int_mean,
    scan_rounds,
    robust_agg,
)

CASES: tuple[Case, ...] = tuple(m.CASE for m in _MODULES)

_BY_NAME = {c.name: c for c in CASES}
assert len(_BY_NAME) == len(CASES), "duplicate case names"

_DRJAX_BUILDERS: dict[str, Callable] = {
    m.CASE.name: getattr(m, "build_drjax", m.build)
    for m in _MODULES
    if getattr(m, "DRJAX_EXPRESSIBLE", False)
}
DRJAX_NAMES: tuple[str, ...] = tuple(_DRJAX_BUILDERS)


def case(name: str) -> Case:
    """The corpus case called ``name``."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(f"no corpus case {name!r}; cases: {sorted(_BY_NAME)}") from None


def drjax_program(name: str, api=None) -> Callable:
    """Case ``name``'s program built on DrJAX (``api`` defaults to the ``drjax`` package)."""
    if api is None:
        import drjax as api
    return _DRJAX_BUILDERS[name](api)
