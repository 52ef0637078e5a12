"""The ``Case`` record: one federated program, its example arguments and its oracle."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Case:
    """A corpus program that every backend and every check runs the same way.

    ``fn(*make_args())`` and ``oracle(*make_args())`` compute the same pytree; the oracle
    writes each federated op as an explicit loop over members in plain JAX, so it never
    touches fcir.
    """

    name: str  # snake_case; golden file stem tests/golden/<name>.fcir
    fn: Callable  # the @fcir.program-decorated round
    make_args: Callable[[], tuple]  # deterministic, small example arguments
    oracle: Callable  # same computation as per-member Python loops, no fcir
    grad_argnums: tuple[int, ...] | None  # args a scalar gradient makes sense for
    loss: Callable | None = None  # output pytree -> scalar, for AD tests
    hierarchical: bool = False
    exportable: bool = True  # single-level clients, one broadcast/aggregate exchange


def sum_of_squares(out) -> jax.Array:
    """Scalar loss over every floating leaf of a program's output (others are skipped)."""
    leaves = [x for x in jax.tree.leaves(out) if jnp.issubdtype(jnp.result_type(x), jnp.floating)]
    return sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in leaves)
