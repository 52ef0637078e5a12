"""DrJAX 0.2.1's public API on fcir's primitives: ``import fcir.drjax as drjax``.

``program``, ``broadcast``, ``map_fn``, ``reduce_sum``, ``reduce_mean`` and
``reduce_weighted_mean`` take DrJAX's arguments, raise DrJAX's errors and lay values out
on a mesh by DrJAX's rules (see ``fcir.opkit.sharding``). Programs written against this module
bind fcir's primitives, so they capture into the fcir IR like ``fcir.program`` code.

Nothing global is patched: DrJAX swaps this module's functions while a program runs,
which breaks two programs running from threads; here the placement comes from fcir's
thread-local program context.

Deliberate differences (see ``docs/from_drjax.md``): ``reduce_mean`` of integers and
bools is float32 under ``jax.jit`` as well (DrJAX fails to lower it); a placed value's
leading axis must equal the placement's cardinality; collectives over the placement
inside ``map_fn`` and DrJAX calls inside a ``map_fn`` body are errors; a mesh with
Explicit axes but no placement axis works (replicated members) instead of raising.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from fcir.errors import PlacementError
from fcir.fed import FUNCTIONS as _FED
from fcir.opkit import placement as _api
from fcir.opkit import sharding as _sharding

__all__ = [
    "OperatorUndefinedError",
    "ProgramArgumentError",
    "broadcast",
    "map_fn",
    "program",
    "reduce_mean",
    "reduce_sum",
    "reduce_weighted_mean",
]

# The DrJAX release whose API and behaviour this module reproduces. Code gating on
# ``drjax.__version__`` keeps working after ``import fcir.drjax as drjax``.
__version__ = "0.2.1"
DRJAX_API_VERSION = __version__

_Mesh = jax.sharding.Mesh | jax.sharding.AbstractMesh | None


class OperatorUndefinedError(PlacementError):
    """A DrJAX operator was called outside a ``program``-decorated function.

    Same name, constructor and message as ``drjax._src.api.OperatorUndefinedError``;
    also a ``fcir.PlacementError`` (so a ``fcir.FcirError``).
    """

    def __init__(self, name: str):
        self.message = (
            f"The DrJAX operator {name} is only defined in the context of a DrJAX "
            "program decorator. Attempted to call without using this decorator."
        )
        super().__init__(self.message)


class ProgramArgumentError(PlacementError, ValueError):
    """Bad arguments to ``program``: a ``ValueError`` (what DrJAX raises) and a
    ``fcir.PlacementError``."""


def _require_program(name: str):
    try:
        return _api._current(name)
    except PlacementError:
        raise OperatorUndefinedError(name) from None


def program(**kwargs) -> Callable[[Callable], Callable]:
    """A decorator enabling calling the DrJAX API.

    ``program(clients=8)`` or ``program(placements={"clients": 8})``, optionally with
    ``use_abstract_mesh=False`` (ignore ``jax.set_mesh``'s mesh; only a ``with mesh:``
    block's). Exactly one placement, as in DrJAX; ``fcir.program`` takes hierarchies.
    """
    use_abstract_mesh = kwargs.pop("use_abstract_mesh", True)
    try:
        [(key, value)] = kwargs.items()
    except ValueError as e:
        raise ProgramArgumentError(
            f"The program API expects a single keyword argument but got {kwargs=}."
        ) from e
    if key == "placements":
        if not isinstance(value, Mapping):
            raise ProgramArgumentError(
                "When using the `placements` argument, value must be a mapping but got "
                f"{type(value)=}. `placements` is a reserved name and not a valid "
                "placement name."
            )
        placements = value
    else:
        placements = kwargs
    try:
        [_] = placements.keys()
    except ValueError as e:
        raise ProgramArgumentError(
            f"Expected a single-element dict for placements. Got {placements=}"
        ) from e
    try:
        spec = _api.Placements.from_mapping(placements)
    except PlacementError as e:
        raise ProgramArgumentError(str(e).replace("fcir.program", "drjax.program")) from None
    mesh = _sharding.AmbientMesh(use_abstract_mesh=bool(use_abstract_mesh))
    return _api.program(placements=dict(zip(spec.names, spec.sizes)), mesh=mesh)


def broadcast(x: Any, *, mesh: _Mesh = None) -> Any:
    """Broadcasts its input to the active placement.

    Every leaf gets a leading axis of the placement's cardinality, sharded along the
    mesh axis named after the placement if the mesh (``mesh``, else the program's
    ambient mesh) has one; the other dimensions are laid out like ``x``.
    """
    _require_program("broadcast")
    return _FED["broadcast"](jax.tree.map(jnp.asarray, x), mesh=mesh)


def map_fn(fn: Callable[..., Any], arg: Any, *, mesh: _Mesh = None) -> Any:
    """Maps ``fn`` across the placed dimension of ``arg`` (a tuple is unpacked).

    Inputs and outputs are sharded along the placement's mesh axis if there is one.
    """
    _require_program("map_fn")
    return _FED["map_fn"](fn, arg, mesh=mesh)


def reduce_sum(x: Any) -> Any:
    """Computes a sum across placed values, in ``jnp.sum``'s dtype as DrJAX does: bools
    and integers narrower than the default int are summed as int32 (uint32 for unsigned
    ones), not wrapped in their own width (``fcir.reduce_sum`` keeps ``T``)."""
    _require_program("reduce_sum")
    leaves = jax.tree_util.tree_leaves(x)
    if any(_sum_dtype(leaf.dtype) != leaf.dtype for leaf in leaves):
        # The widening is a client-side cast, so it is a map like any other client work.
        x = _FED["map_fn"](lambda v: jax.tree.map(lambda a: a.astype(_sum_dtype(a.dtype)), v), x)
    return _FED["reduce_sum"](x)


def _sum_dtype(dtype):
    """The dtype ``jnp.sum`` gives for a ``dtype`` operand (follows the x64 flag)."""
    return jnp.sum(jnp.zeros((1,), dtype)).dtype


def reduce_mean(x: Any) -> Any:
    """Computes an unweighted mean across placed values (float32 for ints and bools)."""
    _require_program("reduce_mean")
    return _FED["reduce_mean"](x)


def _promoted_dtype(x, w):
    # DrJAX computes sum(x * w) / sum(w) in JAX's promoted dtype (bf16 values with f32
    # weights give f32); fcir's weighted mean keeps the values' float dtype.
    dtype = jnp.result_type(x, w)
    if jnp.issubdtype(dtype, jnp.inexact) and dtype != jnp.result_type(x):
        return dtype
    return None


def reduce_weighted_mean(x: Any, w: Any) -> Any:
    """Computes a weighted mean ``sum(w * x) / sum(w)`` across placed values.

    ``w`` is a pytree like ``x`` (DrJAX's form) or one placed scalar per member.
    """
    _require_program("reduce_weighted_mean")
    x_leaves, x_tree = jax.tree.flatten(x)
    w_leaves, w_tree = jax.tree.flatten(w)
    if w_tree.num_leaves == 1 and x_tree.num_leaves != 1:
        w_leaves = w_leaves * x_tree.num_leaves
    if len(w_leaves) == len(x_leaves):
        casts = [_promoted_dtype(a, b) for a, b in zip(x_leaves, w_leaves)]
        if any(casts):
            # A fed.map region doing the casts keeps the IR federated.
            def cast(*leaves):
                return [a if d is None else a.astype(d) for a, d in zip(leaves, casts)]

            x = jax.tree.unflatten(x_tree, _FED["map_fn"](cast, tuple(x_leaves)))
    return _FED["reduce_weighted_mean"](x, w)
