"""``xla.compile``: check the module, then build its Executable, plain or streamed.

Imports go one way: this module uses ``executable`` (the Executable), ``memory_budget``
(the streamed one and its client budget) and ``members`` (the member loop's
interpreters); ``memory_budget`` uses ``executable``,
``streaming`` (which validates ``clients_per_step``) and ``cost`` (XLA's memory
analysis); nothing imports back.
"""

from __future__ import annotations

from jax.sharding import Mesh

from fcir.checker.check import check
from fcir.errors import PlacementError
from fcir.frontend import jaxpr_cache as captured
from fcir.ir import Module

from . import members as member_loop
from .executable import Executable
from .memory_budget import streaming_executable

__all__ = ["compile"]


def compile(
    module: Module,
    mesh: Mesh | None = None,
    clients_per_step: int | str | None = None,
    *,
    memory_limit: int | None = None,
    members: str = "vmap",
) -> Executable:
    """``module`` as a jit-compiled executable; placement axes sharded over ``mesh``.

    ``clients_per_step=k`` streams every ``fed.map``: ``k`` members at a time per device,
    reductions as running accumulators (``fcir.interpreters.xla.streaming``); ``"auto"``
    picks ``k`` from ``memory_limit`` bytes (default: the device's memory) with XLA's
    memory analysis (``fcir.interpreters.xla.memory_budget``).

    ``members="vmap"`` (the default) runs a ``fed.map``'s members at once, as
    ``jax.jit`` of the program does (bit for bit); ``members="loop"`` runs them one
    after another in a compiled loop, every convolution in XLA:CPU's fast layout
    (``fcir.interpreters.xla.members``): for convolutional clients on CPU. One device
    (no mesh); with ``clients_per_step`` the streamed chunks get the fast convolutions.
    ``members="auto"``: ``"loop"`` on CPU for a program with a convolution inside a
    ``fed.map``, else ``"vmap"``.

    ``exe(*args)`` takes and returns pytrees like ``reference.run``;
    ``exe.as_text("hlo" | "stablehlo")`` and ``exe.cost()`` need no arguments. The
    module is type-checked first (``fcir.check``; a module straight from ``fcir.capture``,
    unchanged since, was checked there), so an IR file read from disk fails here, naming
    the op, rather than somewhere in JAX.
    """
    if not captured.checked(module):  # straight from fcir.capture: checked there
        check(module)
    if mesh is not None and not isinstance(mesh, Mesh):
        raise PlacementError(
            f"xla.compile: mesh must be a jax.sharding.Mesh (or None for one device), got "
            f"{type(mesh).__name__}; build one with jax.make_mesh(shape, axis_names)"
        )
    if mesh is not None and mesh.empty:
        mesh = None
    loop = member_loop.check_members(members, mesh, module) == "loop"
    if clients_per_step is not None or memory_limit is not None:
        factory = member_loop.interpreter if loop else None
        return streaming_executable(module, mesh, clients_per_step, memory_limit, factory)
    return Executable(module, mesh, member_loop.interpreter() if loop else None)
