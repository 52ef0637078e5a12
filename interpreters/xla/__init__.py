"""The XLA backend: a Module as one jit-compiled, sharded XLA program.

::

    from fcir.interpreters import xla

    exe = xla.compile(module, mesh=None)      # mesh: jax.sharding.Mesh or None
    exe = xla.compile(module, mesh, clients_per_step=k)  # or "auto": members k at a time
    exe = xla.compile(module, members="loop")  # members one after another (CPU, convs)
    exe(*args)                                # pytree in, pytree out (like reference.run)
    exe.as_text("stablehlo"); exe.as_text("hlo"); exe.as_text("optimized_hlo")
    report = exe.cost()                       # XLA cost analysis + per-round report
    print(xla.format_cost(report))
    state, metrics = xla.simulate(round_fn, state, cohorts, rounds)  # over a population

How it works, and why it is short: the base :class:`fcir.Interpreter` gives every op
its JAX meaning by binding the op's primitive. Run under ``jax.jit`` tracing, it
rebuilds the captured jaxpr, so ``xla.compile(fcir.capture(f, *args))(*args)`` is
bitwise what ``jax.jit(f)(*args)`` computes, with the same HLO and the same flops.
:class:`XlaInterpreter` overrides two ops, ``fed.broadcast`` and ``fed.map``, to add
the sharding constraints of ``fcir.opkit.sharding`` when a mesh is given; every other op
falls back to the base class. That is the pattern for any backend that maps the IR
onto JAX (``interpreter.py``); :mod:`.executable` wraps it in ``jax.jit`` and
:mod:`.cost` reads XLA's cost analysis, per program and per fed.map region. Without a
mesh, a module straight from ``fcir.capture`` (unedited) skips the rebuild and reuses
the captured jaxpr (``fcir.frontend.jaxpr_cache``). A warm ``exe(*args)`` is JAX's C++ dispatch
alone; the argument checks run when the program is traced (``.executable``). One
rewrite comes first where the IR, the same on every JAX, computes a zero the running
JAX's own trace does not (a second-order derivative op's cotangent under JAX 0.12):
:mod:`.zeros` removes it and the adds of it, as JAX's symbolic zeros do.

Streaming (``clients_per_step``): :mod:`.streaming` plans each ``fed.map`` with the
reductions it feeds into a loop over chunks of ``k`` members per device with running
accumulators; :mod:`.memory_budget` validates ``k`` or picks it from XLA's memory analysis.

Member loop (``members="loop"``): :mod:`.members` runs each ``fed.map``'s members one
after another in a compiled loop, every convolution in XLA:CPU's canonical layout
(XLA canonicalizes only the entry computation's; one inside a loop otherwise runs
30-70x slower). ``xla.simulate`` picks it on CPU for convolutional clients.

Sharding (DrJAX's rules): a value placed at ``p`` has its member axis sharded along
the mesh axis named ``p``; ``Auto`` axes get ``with_sharding_constraint`` with the
other dimensions unconstrained, ``Explicit`` axes get ``reshard``; a mesh without an
axis named ``p`` gets no constraint and a warning on the ``fcir`` logger. Hierarchical
placements take one mesh axis each: ``{"silos": 2, "clients": 4}`` runs on a mesh with
axes ``("silos", "clients")``. Everything else about the layout is XLA's propagation,
starting from the arguments' shardings (see :func:`default_sharding`).
"""

from .build import compile
from .cost import cost_report, format_cost
from .executable import Executable, default_sharding, placement_spec, trace_count
from .interpreter import XlaInterpreter
from .simulation import device_budget, simulate

__all__ = [
    "Executable",
    "XlaInterpreter",
    "compile",
    "cost_report",
    "default_sharding",
    "device_budget",
    "format_cost",
    "placement_spec",
    "simulate",
    "trace_count",
]
