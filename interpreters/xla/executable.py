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

The call path: ``exe(*args)`` goes straight to one ``jax.jit`` function over the
argument pytree, so JAX's C++ dispatch runs a warm call without entering Python, as
fast as ``jax.jit`` of the original program. The argument checks (leaf count, shapes,
dtypes, members per placement) run where that function is traced, i.e. only on a
cache miss, and raise the same InterpreterError / PlacementError as before. One check
runs at every call, in Python: a program whose ``fed.ddp_*`` op takes its keys from an
argument copies those keys to the host and refuses a repeat (``fed.ddp_*/C3``). Whatever
JAX itself rejects before tracing (an abstract ``ShapeDtypeStruct``, arrays on devices
outside the mesh) goes to the slow path, which checks and lays out the arguments in
Python. On a mesh, leaves that are not jax.Arrays on its devices take the slow path too
(one look at each leaf's sharding per call), so they get the default layout.

One jitted function per (module, mesh), shared by every Executable of the module:
compiling a module twice, or asking it for several formats, traces it once per
argument signature (:func:`trace_count`).
"""

from __future__ import annotations

import contextlib
import functools
import statistics
import time
import weakref
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from fcir import gcpause
from fcir.base_interpreter import check_leaf
from fcir.errors import FcirError, InterpreterError, PlacementError
from fcir.frontend import jaxpr_cache as captured
from fcir.frontend import pytrees
from fcir.ir import Module
from fcir.ir.types import PlacedType, Type, runtime_type
from fcir.jaxcompat import core
from fcir.privacy import keys as dp_keys

from . import zeros
from .cost import cost_report
from .interpreter import XlaInterpreter

__all__ = ["Executable", "default_sharding", "placement_spec", "trace_count"]

DIALECTS = ("stablehlo", "hlo", "optimized_hlo")


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

    def __init__(self, module: Module, mesh: Mesh | None, interpreter=None):
        self.module = module
        self.mesh = mesh
        # Set by xla.compile(..., clients_per_step=...): the budget and how it was chosen.
        self.streaming: dict | None = None
        self._params = list(module.main.body.params)
        self._types = [runtime_type(v.type, module.cardinality) for v in self._params]
        self._program = _program(module, mesh, interpreter)
        self._jitted, self._rebuild = self._program.jitted, self._program.rebuild
        # Explicit axes type values by the mesh in context: calls and lowerings run in it.
        self._context = mesh is not None and jax.sharding.AxisType.Explicit in mesh.axis_types
        self._devices = None if mesh is None else set(mesh.devices.flat)
        self._mesh_shardings: set = set()  # shardings seen on the mesh's devices
        # No mesh, results in jit's own pytree, no mesh context: straight to jit.
        self._direct = mesh is None and self._rebuild is None
        self._lowered: dict[Any, jax.stages.Lowered] = {}
        self._compiled: dict[Any, jax.stages.Compiled] = {}
        # (flat argument index, op) of the fed.ddp_* ops whose keys are an argument: the
        # one place the members' keys are concrete (inside jit they are traced).
        self._ddp_keys = dp_keys.ddp_key_arguments(module)
        # Wall seconds of the calls made through timed(), per argument types.
        self._timings: dict[tuple, list[float]] = {}

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
        pytrees.check_arguments(self.module, tuple(args), "xla executable")
        leaves = jax.tree_util.tree_leaves(args)
        if len(leaves) != len(self._params):
            raise InterpreterError(
                f"@{self.module.name} takes {len(self._params)} array leaves, got {len(leaves)}"
            )
        out = []
        for i, (x, v, t) in enumerate(zip(leaves, self._params, self._types)):
            if not hasattr(x, "dtype"):
                x = jax.numpy.asarray(x)
            check_leaf(self.module, i, v, t, tuple(np.shape(x)), x.dtype, PlacementError)
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
            elif self._context and self._relabelled(x):
                # One of its own results returned outside jax.set_mesh (_on_auto_axes):
                # back on the Explicit mesh, the same layout.
                x = jax.device_put(x, NamedSharding(self.mesh, core.typeof(x).sharding.spec))
            out.append(x)
        return out

    def _relabelled(self, x) -> bool:
        """Whether ``x`` is typed on this mesh's axes with other axis types (``Auto``
        where the mesh has ``Explicit``): JAX refuses to mix the two in one trace."""
        mesh = core.typeof(x).sharding.mesh
        if mesh.empty or mesh == self.mesh.abstract_mesh:
            return False
        return mesh.axis_names == self.mesh.axis_names and mesh.axis_sizes == self.mesh.axis_sizes

    def _on_mesh(self, x) -> bool:
        sh = getattr(x, "sharding", None)
        return sh is not None and sh.device_set == self._devices

    # -- running --------------------------------------------------------------------------

    def __call__(self, *args, **kwargs):
        # The fast path: no Python between here and JAX's C++ dispatch but this frame.
        if kwargs:
            return self(self._keywords(args, kwargs, "call"))
        if self._ddp_keys:
            self._check_member_keys(args)
        if self._direct:
            try:
                return self._jitted(*args)
            except FcirError:
                raise  # a check failed while tracing: already the clear message
            except Exception as e:  # noqa: BLE001  JAX rejected the arguments as given
                return self._call_slow(args, e)
        return self._call_on_mesh(args)

    def _check_member_keys(self, args) -> None:
        """Refuses members' keys with a duplicate (``fed.ddp_*/C3``) before the call:
        a host copy of ``n`` keys, for programs with a ``fed.ddp_*`` op only."""
        leaves = jax.tree_util.tree_leaves(args)
        if len(leaves) != len(self._params):
            return  # the argument checks say what is wrong
        for i, op in self._ddp_keys:
            dp_keys.check_member_keys(op, leaves[i])

    def _keywords(self, args, kwargs, what: str):
        """``(args, kwargs)`` as capture flattened them, checked against the names the
        module was captured with: one positional pytree for the positional paths."""
        return pytrees.call_arguments(self.module, args, kwargs, f"xla executable {what}")

    def _call_on_mesh(self, args):
        """The fast path on a mesh: one look at each leaf's sharding first."""
        if self._rebuild is None and not self._context and self._laid_out(args):
            try:
                return self._jitted(*args)
            except FcirError:
                raise
            except Exception as e:  # noqa: BLE001
                return self._call_slow(args, e)
        return self._call_slow(args, None)

    def _laid_out(self, args) -> bool:
        """On a mesh, whether every leaf is a jax.Array on the mesh's devices: anything
        else (numpy, host values in a multi-process run, arrays on one device) gets the
        default layout on the slow path, not the layout jax.jit would pick."""
        if self.mesh is None:
            return True
        seen = self._mesh_shardings
        for x in jax.tree_util.tree_leaves(args):
            sh = getattr(x, "sharding", None)
            if sh not in seen:
                if not (isinstance(x, jax.Array) and self._on_mesh(x)):
                    return False
                seen.add(sh)
        return True

    def _call_slow(self, args, error: Exception | None):
        """Checks the arguments in Python (raising the clear FcirError) and moves those
        that are not on the mesh; then calls. ``error`` is what the fast path raised:
        raised again when the checks pass and no argument needed moving."""
        leaves = self._flat_args(args, abstract_ok=False)
        if error is not None and all(a is b for a, b in zip(leaves, jax.tree.leaves(args))):
            with _xla_errors(self.module, "run"):
                raise error
        laid_out = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(args), leaves)
        # Read before entering the mesh: whether the caller set one.
        retype = self._context and self._outside_mesh()
        with _xla_errors(self.module, "run"), _mesh_context(self.mesh if self._context else None):
            out = self._jitted(*laid_out)
        if retype:
            out = jax.tree.map(self._on_auto_axes, out)
        return out if self._rebuild is None else self._rebuild.unflatten(list(out))

    @staticmethod
    def _outside_mesh() -> bool:
        """Whether this call has no mesh in context and no ``jax.jit`` around it.

        On a mesh with Explicit axes the results are typed by it, and JAX differentiates
        such values only inside ``jax.set_mesh``: outside, the cotangent of a loss built
        from them is laid out over the mesh on one device ("Length of device assignment
        1 is not equal to the size of the mesh 8", as for any JAX array placed on the
        mesh). Under ``jax.jit`` the jit holds the mesh; inside ``jax.set_mesh`` the
        types are the caller's."""
        return jax.sharding.get_abstract_mesh().empty and not core.unsafe_am_i_under_a_jit()

    @functools.cached_property
    def _auto_mesh(self) -> Mesh:
        """The executable's mesh with every axis ``Auto``: the same devices and layout,
        types that do not name the mesh."""
        auto = (jax.sharding.AxisType.Auto,) * len(self.mesh.axis_names)
        return Mesh(self.mesh.devices, self.mesh.axis_names, axis_types=auto)

    def _on_auto_axes(self, x):
        """Result ``x`` as the same layout over :attr:`_auto_mesh` (a relabelling; its
        transpose puts the cotangent back on the Explicit mesh for the backward pass)."""
        return jax.device_put(x, NamedSharding(self._auto_mesh, core.typeof(x).sharding.spec))

    def lower(self, *args, **kwargs) -> jax.stages.Lowered:
        """``jax.stages.Lowered`` for ``args`` (arrays or ``ShapeDtypeStruct``s, and the
        keyword arguments the module was captured with), or for :attr:`in_specs` when
        no arguments are given."""
        if kwargs:
            args = (self._keywords(args, kwargs, "lower"),)
        if not args:
            return self._lower(self.in_specs)
        leaves = self._flat_args(args, abstract_ok=True)
        return self._lower(leaves, jax.tree_util.tree_structure(args))

    def compiled(self, *args, **kwargs) -> jax.stages.Compiled:
        """``jax.stages.Compiled`` for ``args`` (and the captured keyword arguments; or
        :attr:`in_specs`); calls, ``as_text`` and ``cost`` with the same argument types
        share one compilation."""
        if kwargs:
            args = (self._keywords(args, kwargs, "compiled"),)
        if not args:
            return self._compile(self.in_specs)
        leaves = self._flat_args(args, abstract_ok=True)
        return self._compile(leaves, jax.tree_util.tree_structure(args))

    def _lower(self, leaves, treedef=None) -> jax.stages.Lowered:
        """Lowered for flat ``leaves`` passed as the pytree ``treedef`` (flat when None):
        the same pytree as the calls' shares their trace."""
        key = _signature(leaves)
        lowered = self._lowered.get(key)
        if lowered is None:
            args = leaves if treedef is None else jax.tree_util.tree_unflatten(treedef, leaves)
            # Tracing and lowering a large program make millions of long-lived objects
            # and next to no garbage: no collector passes over them meanwhile.
            with (
                _xla_errors(self.module, "lower"),
                _mesh_context(self.mesh if self._context else None),
                gcpause.tenured(),
            ):
                lowered = self._lowered[key] = self._jitted.lower(*args)
        return lowered

    def _compile(self, leaves, treedef=None) -> jax.stages.Compiled:
        key = _signature(leaves)
        compiled = self._compiled.get(key)
        if compiled is None:
            lowered = self._lower(leaves, treedef)
            with _xla_errors(self.module, "compile"):
                compiled = self._compiled[key] = lowered.compile()
        return compiled

    # -- inspecting -----------------------------------------------------------------------

    def as_text(self, dialect: str = "stablehlo", *args, **kwargs) -> str:
        """The program as text: ``"stablehlo"`` (the lowered MLIR module), ``"hlo"`` (the
        HLO module handed to XLA, before its optimizations) or ``"optimized_hlo"`` (what
        XLA runs: after fusion and, on a mesh, SPMD partitioning)."""
        if dialect not in DIALECTS:
            raise InterpreterError(
                f"as_text: dialect must be one of {', '.join(DIALECTS)}, got {dialect!r}"
            )
        if dialect == "optimized_hlo":
            return self.compiled(*args, **kwargs).as_text()
        return self.lower(*args, **kwargs).as_text(dialect)

    def timed(self, *args, **kwargs):
        """``self(*args)``, waited for (``jax.block_until_ready``), its wall seconds
        recorded for :meth:`cost` (``timing``, ``flops_per_second``). The first timed
        call of an argument signature runs the program once untimed before, so that
        compiling it is not timed."""
        key = self._timing_key(args, kwargs)
        if key not in self._timings:
            jax.block_until_ready(self(*args, **kwargs))
            self._timings[key] = []
        start = time.perf_counter()
        out = jax.block_until_ready(self(*args, **kwargs))
        self._timings[key].append(time.perf_counter() - start)
        return out

    def timing(self, *args, **kwargs) -> dict | None:
        """The calls :meth:`timed` timed with arguments of these types (or of
        :attr:`in_specs`' types): their count, median and fastest seconds; None if none."""
        seconds = self._timings.get(self._timing_key(args, kwargs))
        if not seconds:
            return None
        return {
            "calls": len(seconds),
            "median_seconds": statistics.median(seconds),
            "min_seconds": min(seconds),
        }

    def _timing_key(self, args, kwargs) -> tuple:
        if kwargs:
            args = (self._keywords(args, kwargs, "timed"),)
        leaves = jax.tree_util.tree_leaves(args) if args else self.in_specs
        return tuple(
            (tuple(np.shape(x)), str(getattr(x, "dtype", type(x).__name__))) for x in leaves
        )

    def cost(self, *args, **kwargs) -> dict:
        """XLA's cost analysis and the per-round communication and compute report for
        ``args`` (and the captured keyword arguments; or :attr:`in_specs`); see
        ``fcir.interpreters.xla.cost``. JSON-serializable."""
        if kwargs:
            args = (self._keywords(args, kwargs, "cost"),)
        return cost_report(self, *args)


class _Program:
    """``main`` under one ``jax.jit`` over the argument pytree, for one (module, mesh).

    Traced on a cache miss only: that is where the arguments are checked, so a warm
    call is JAX's C++ dispatch alone. ``traces`` counts the traces (tests pin reuse)."""

    def __init__(self, module: Module, mesh: Mesh | None, interpreter=None):
        func = module.main
        params = list(func.body.params)
        types = [runtime_type(v.type, module.cardinality) for v in params]
        inside, self.rebuild = _result_builder(func)
        self.traces = 0
        # The module holds its programs (weakly keyed): the program holds it weakly.
        ref = weakref.ref(module)
        # What XLA compiles: the module less the zeros JAX's own trace would not compute
        # (zeros.py; the module itself when it has none, nearly always).
        lowered = zeros.without_structural_zeros(module)
        if lowered is module:
            lowered = None

        def program(*args):
            self.traces += 1
            module = ref()
            pytrees.check_arguments(module, args, "xla executable")
            leaves = jax.tree_util.tree_leaves(args)
            if len(leaves) != len(params):
                raise InterpreterError(
                    f"@{module.name} takes {len(params)} array leaves, got {len(leaves)}"
                )
            for i, (x, v, t) in enumerate(zip(leaves, params, types)):
                check_leaf(module, i, v, t, tuple(x.shape), x.dtype, PlacementError)
            # Without a mesh the interpreter rebuilds exactly the captured jaxpr: when
            # the module is capture's, unchanged, take that jaxpr instead of tracing
            # every op again (checked at each trace).
            plain = mesh is None and interpreter is None and lowered is None
            closed = captured.captured_jaxpr(module) if plain else None
            if closed is not None:
                return inside(core.jaxpr_as_fun(closed)(*leaves))
            run = lowered or module
            interp = (interpreter or XlaInterpreter)(mesh)
            interp.module = run
            return inside(interp.run_region(run.main.body, leaves))

        # The jit name becomes the HLO module's name: jit_<program>, as for jax.jit(program).
        program.__name__ = program.__qualname__ = module.name
        self.jitted = jax.jit(program)


def _result_builder(func):
    """(``outs -> results`` applied inside jit, Structure to rebuild outside or None).

    Results leave jit in the program's flatten order, so the HLO's results are those
    of jax.jit(original). A structure that flattens in another order (a custom node
    rebuilt as a dict with unsorted keys) is rebuilt outside jit instead. In the
    capturing process the program's own treedef rebuilds its classes (fcir.frontend.pytrees)."""
    treedef = pytrees.result_treedef(func)
    if treedef is not None:
        return treedef.unflatten, None
    structure = func.result_structure
    n = len(func.body.results)
    if structure is not None and jax.tree_util.tree_leaves(
        structure.unflatten(list(range(n)))
    ) == list(range(n)):
        return structure.unflatten, None
    return tuple, structure


_PROGRAMS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _program(module: Module, mesh: Mesh | None, interpreter=None) -> _Program:
    """The one _Program of (``module``, ``mesh``, ``interpreter``): Executables of a
    module share traces, unless the module was edited in place since (its traces would
    be stale). ``interpreter(mesh)`` (a hashable factory; None: XlaInterpreter) makes
    the interpreter that traces ``main``."""
    per_mesh = _PROGRAMS.setdefault(module, {})
    program, parts = per_mesh.get((mesh, interpreter), (None, None))
    if program is None or not captured.unchanged(module, parts):
        program = _Program(module, mesh, interpreter)
        per_mesh[(mesh, interpreter)] = (program, captured.snapshot(module))
    return program


def trace_count(module: Module, mesh: Mesh | None = None) -> int:
    """How many times ``module`` was traced for ``mesh`` in this process (once per
    argument signature; compiling again or emitting more formats does not trace)."""
    per_mesh = _PROGRAMS.get(module, {})
    return per_mesh[(mesh, None)][0].traces if (mesh, None) in per_mesh else 0


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


@contextlib.contextmanager
def _xla_errors(module: Module, step: str):
    """Turns what JAX or XLA raises while lowering, compiling or running a checked module
    (a lowering rule refusing an attribute, memory exhausted) into an InterpreterError
    that names the program; errors the interpreter raised while tracing an op already
    name that op and pass through."""
    try:
        yield
    except FcirError:
        raise
    except Exception as e:
        text = str(e).strip()
        raise InterpreterError(
            f"@{module.name}: XLA could not {step} the program: {type(e).__name__}: {text[:2000]}"
        ) from e


class _NoMesh:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _mesh_context(mesh: Mesh | None):
    # Explicit axes type values by the mesh in context; with Auto axes it changes nothing.
    if mesh is None or jax.sharding.get_abstract_mesh() == mesh.abstract_mesh:
        return _NoMesh()  # none, or the caller's jax.set_mesh already set it
    try:
        return jax.set_mesh(mesh)
    except ValueError:  # called inside a trace (jax.grad, jax.jit of exe): set_mesh refuses
        return jax.sharding.use_abstract_mesh(mesh.abstract_mesh)
