"""``compile(module, mesh)``: a Module as one jit-compiled, mesh-sharded XLA program.

The executable is ``jax.jit`` of :class:`XlaInterpreter` running ``main`` on the flat
argument leaves, so its jaxpr, StableHLO and HLO are those of ``jax.jit`` of the
original program. Because a Module's parameter types are static, it lowers without
example arguments: :meth:`Executable.lower` with no arguments uses
:attr:`Executable.in_specs`.

Layout of the arguments: a ``jax.Array`` already laid out on the mesh's devices keeps
its sharding; anything else (numpy arrays, arrays on other devices) is placed with the
default layout, :func:`default_sharding`: placed values sharded along their
placements' mesh axes (``{{T}@clients}@silos`` over ``("silos", "clients")``), server
values replicated. Inside the program the layout is the constraints' and XLA's.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from fcir.check import check
from fcir.errors import InterpreterError, PlacementError
from fcir.ir import Module
from fcir.types import PlacedType, Type, dtype_name, runtime_type

from .interpreter import XlaInterpreter

__all__ = ["Executable", "compile", "default_sharding", "placement_spec"]

DIALECTS = ("stablehlo", "hlo", "optimized_hlo")


def compile(
    module: Module,
    mesh: Mesh | None = None,
    clients_per_step: int | str | None = None,
    *,
    memory_limit: int | None = None,
) -> Executable:
    """``module`` as a jit-compiled executable; placement axes sharded over ``mesh``.

    ``clients_per_step=k`` streams every ``fed.map``: ``k`` members at a time per device,
    reductions as running accumulators (``fcir.interpreters.xla.streaming``); ``"auto"``
    picks ``k`` from ``memory_limit`` bytes (default: the device's memory) with XLA's
    memory analysis (``fcir.interpreters.xla.budget``).

    ``exe(*args)`` takes and returns pytrees like ``reference.run``;
    ``exe.as_text("hlo" | "stablehlo")`` and ``exe.cost()`` need no arguments. The
    module is type-checked first (``fcir.check``), so an IR file read from disk fails
    here, naming the op, rather than somewhere in JAX.
    """
    check(module)
    if mesh is not None and not isinstance(mesh, Mesh):
        raise PlacementError(
            f"xla.compile: mesh must be a jax.sharding.Mesh (or None for one device), got "
            f"{type(mesh).__name__}; build one with jax.make_mesh(shape, axis_names)"
        )
    if mesh is not None and mesh.empty:
        mesh = None
    if clients_per_step is not None or memory_limit is not None:
        from .budget import streaming_executable

        return streaming_executable(module, mesh, clients_per_step, memory_limit)
    return Executable(module, mesh)


def placement_spec(t: Type, mesh: Mesh | None, cardinality) -> PartitionSpec:
    """Default layout of a value of IR type ``t``: each placement level's member axis
    along the mesh axis of the same name, when the mesh has one whose size divides the
    placement's cardinality; everything else replicated. ``cardinality`` maps a
    placement name to its size (``module.cardinality``)."""
    axes: list[str | None] = []
    while isinstance(t, PlacedType):
        if t.placement != "server":
            p = t.placement
            usable = mesh is not None and p in mesh.axis_names
            axes.append(p if usable and cardinality(p) % mesh.shape[p] == 0 else None)
        t = t.member
    while axes and axes[-1] is None:
        axes.pop()
    return PartitionSpec(*axes)


def default_sharding(t: Type, mesh: Mesh, cardinality) -> NamedSharding:
    """The sharding given to an argument of IR type ``t`` that arrives without one."""
    return NamedSharding(mesh, placement_spec(t, mesh, cardinality))


class Executable:
    """A compiled Module. Call it like the program; inspect it with :meth:`as_text`,
    :meth:`cost`, :meth:`lower`."""

    def __init__(self, module: Module, mesh: Mesh | None, interpreter=XlaInterpreter):
        self.module = module
        self.mesh = mesh
        # Set by xla.compile(..., clients_per_step=...): the budget and how it was chosen.
        self.streaming: dict | None = None
        self._params = list(module.main.body.params)
        self._types = [runtime_type(v.type, module.cardinality) for v in self._params]
        self._jitted, self._rebuild = _program(module, mesh, interpreter)
        self._devices = None if mesh is None else set(mesh.devices.flat)
        self._lowered: dict[Any, jax.stages.Lowered] = {}
        self._compiled: dict[Any, jax.stages.Compiled] = {}

    def __repr__(self) -> str:
        where = "1 device" if self.mesh is None else f"mesh {dict(self.mesh.shape)}"
        return f"<fcir.interpreters.xla.Executable @{self.module.name} on {where}>"

    # -- arguments ------------------------------------------------------------------------

    @functools.cached_property
    def in_specs(self) -> tuple[jax.ShapeDtypeStruct, ...]:
        """One ``ShapeDtypeStruct`` per flat parameter, with the default sharding when
        there is a mesh: what :meth:`lower` uses when given no arguments."""
        specs = []
        for v, t in zip(self._params, self._types):
            sh = (
                None
                if self.mesh is None
                else default_sharding(v.type, self.mesh, self.module.cardinality)
            )
            specs.append(jax.ShapeDtypeStruct(t.shape, t.np_dtype, sharding=sh))
        return tuple(specs)

    def _flat_args(self, args: Sequence, *, abstract_ok: bool) -> list:
        leaves = jax.tree_util.tree_leaves(args)
        if len(leaves) != len(self._params):
            raise InterpreterError(
                f"@{self.module.name} takes {len(self._params)} array leaves, got {len(leaves)}"
            )
        out = []
        for i, (x, v, t) in enumerate(zip(leaves, self._params, self._types)):
            if not hasattr(x, "dtype"):
                x = jax.numpy.asarray(x)
            shape = tuple(np.shape(x))
            if shape != t.shape or dtype_name(x.dtype) != t.dtype:
                raise InterpreterError(
                    f"@{self.module.name} argument leaf {i} (%{i}: {v.type}) needs an array "
                    f"of {t}, got {dtype_name(x.dtype)}{list(shape)}"
                )
            if isinstance(x, jax.ShapeDtypeStruct):
                if not abstract_ok:
                    raise InterpreterError(
                        f"@{self.module.name} argument leaf {i} is abstract "
                        "(a ShapeDtypeStruct): lower() or as_text() it, call it with arrays"
                    )
                if self.mesh is not None and x.sharding is None:
                    x = self.in_specs[i]
            elif self.mesh is not None and not self._on_mesh(x):
                x = jax.device_put(x, default_sharding(v.type, self.mesh, self.module.cardinality))
            out.append(x)
        return out

    def _on_mesh(self, x) -> bool:
        sh = getattr(x, "sharding", None)
        return sh is not None and sh.device_set == self._devices

    # -- running --------------------------------------------------------------------------

    def __call__(self, *args):
        leaves = self._flat_args(args, abstract_ok=False)
        out = self._compile(leaves)(*leaves)
        return out if self._rebuild is None else self._rebuild.unflatten(list(out))

    def lower(self, *args) -> jax.stages.Lowered:
        """``jax.stages.Lowered`` for ``args`` (arrays or ``ShapeDtypeStruct``s), or for
        :attr:`in_specs` when no arguments are given."""
        return self._lower(self._flat_args(args, abstract_ok=True) if args else self.in_specs)

    def compiled(self, *args) -> jax.stages.Compiled:
        """``jax.stages.Compiled`` for ``args`` (or :attr:`in_specs`); calls, ``as_text``
        and ``cost`` with the same argument types share one compilation."""
        return self._compile(self._flat_args(args, abstract_ok=True) if args else self.in_specs)

    def _lower(self, leaves) -> jax.stages.Lowered:
        key = _signature(leaves)
        lowered = self._lowered.get(key)
        if lowered is None:
            with _mesh_context(self.mesh):
                lowered = self._lowered[key] = self._jitted.lower(*leaves)
        return lowered

    def _compile(self, leaves) -> jax.stages.Compiled:
        key = _signature(leaves)
        compiled = self._compiled.get(key)
        if compiled is None:
            compiled = self._compiled[key] = self._lower(leaves).compile()
        return compiled

    # -- inspecting -----------------------------------------------------------------------

    def as_text(self, dialect: str = "stablehlo", *args) -> str:
        """The program as text: ``"stablehlo"`` (the lowered MLIR module), ``"hlo"`` (the
        HLO module handed to XLA, before its optimizations) or ``"optimized_hlo"`` (what
        XLA runs: after fusion and, on a mesh, SPMD partitioning)."""
        if dialect not in DIALECTS:
            raise ValueError(f"as_text: dialect must be one of {DIALECTS}, got {dialect!r}")
        if dialect == "optimized_hlo":
            return self.compiled(*args).as_text()
        return self.lower(*args).as_text(dialect)

    def cost(self, *args) -> dict:
        """XLA's cost analysis and the per-round communication and compute report; see
        ``fcir.interpreters.xla.cost``. JSON-serializable."""
        from .cost import cost_report

        return cost_report(self, *args)


def _program(module: Module, mesh: Mesh | None, interpreter=XlaInterpreter):
    """(``main`` on flat argument leaves under jit, structure to rebuild outside or None).
    ``interpreter(mesh)`` makes the interpreter that traces ``main``."""
    structure = module.main.result_structure
    n = len(module.main.body.results)
    # Results leave jit in the program's flatten order, so the HLO's results are those
    # of jax.jit(original). A structure that flattens in another order (a custom node
    # rebuilt as a dict with unsorted keys) is rebuilt outside jit instead.
    inside = structure is not None and jax.tree_util.tree_leaves(
        structure.unflatten(list(range(n)))
    ) == list(range(n))

    def program(*leaves):
        interp = interpreter(mesh)
        interp.module = module
        outs = interp.run_region(module.main.body, leaves)
        return structure.unflatten(outs) if inside else tuple(outs)

    # The jit name becomes the HLO module's name: jit_<program>, as for jax.jit(program).
    program.__name__ = program.__qualname__ = module.name
    return jax.jit(program), (None if inside else structure)


def _signature(leaves) -> tuple:
    """What a compilation depends on: shape, dtype, layout and weak type per leaf (an
    uncommitted array goes where the computation runs, so its place does not count)."""
    return tuple(
        (
            x.shape,
            x.dtype,
            getattr(x, "sharding", None) if getattr(x, "committed", True) else None,
            getattr(x, "weak_type", False),
        )
        for x in leaves
    )


class _NoMesh:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _mesh_context(mesh: Mesh | None):
    # Explicit axes type values by the mesh in context; with Auto axes it changes nothing.
    return _NoMesh() if mesh is None else jax.set_mesh(mesh)
