"""The client budget of a streamed executable: a given ``k``, or one chosen for memory.

``xla.compile(module, mesh, clients_per_step=k)`` builds the executable with
:class:`~.streaming.StreamingInterpreter`. With ``clients_per_step="auto"`` the budget
is chosen from a memory limit (``memory_limit`` bytes per device, or the device's
memory: ``bytes_limit`` of ``Device.memory_stats()`` on accelerators, the host's RAM
shared by its devices on CPU) with XLA's memory analysis of the compiled program,
whose predicted peak is arguments + outputs + temporaries - aliased bytes:

1. compile with k = 1 and with a second, larger k; the peak is close to linear in k
   (each step holds k members' intermediates), so the two give the bytes per member;
2. compile the largest k that line says fits; while XLA's analysis of that program
   says it does not fit, shrink k by a quarter.

The chosen ``k``, the peak XLA predicts for it and every candidate tried go into
``exe.streaming`` and the cost report (``exe.cost()["streaming"]``).
"""

from __future__ import annotations

import functools
import os

import jax

from fcir.errors import InterpreterError

from .cost import memory_stats, predicted_peak
from .executable import Executable
from .streaming import StreamingInterpreter, members_per_step

__all__ = [
    "device_memory",
    "members_per_device",
    "memory_stats",
    "predicted_peak",
    "streaming_executable",
]

PROBE = 8  # the second k compiled to measure the bytes per member


def streaming_executable(
    module, mesh, clients_per_step, memory_limit, interpreter=None
) -> Executable:
    """``xla.compile``'s streamed executable (arguments as ``xla.compile`` got them).
    ``interpreter(k)``: the interpreter factory for budget ``k`` (default: a
    :class:`StreamingInterpreter`; ``members="loop"`` passes its own)."""
    interpreter = interpreter or _interpreter
    if clients_per_step is None:
        raise InterpreterError(
            "xla.compile: memory_limit is only used with clients_per_step='auto'; pass "
            "clients_per_step='auto' (or drop memory_limit)"
        )
    if clients_per_step == "auto":
        return _auto(module, mesh, memory_limit, interpreter)
    if memory_limit is not None:
        raise InterpreterError(
            f"xla.compile: memory_limit needs clients_per_step='auto', got "
            f"clients_per_step={clients_per_step!r}"
        )
    try:
        k = members_per_step(clients_per_step)
    except InterpreterError as e:
        raise InterpreterError(f"xla.compile: {e}") from None
    exe = Executable(module, mesh, interpreter(k))
    exe.streaming = {"clients_per_step": clients_per_step, "mode": "fixed"}
    return exe


@functools.cache
def _interpreter(k: int):
    """One factory per k: executables of a module with the same budget share a trace."""
    return functools.partial(StreamingInterpreter, clients_per_step=k)


def device_memory(mesh) -> int:
    """Bytes one device may use: its allocator's limit, or on CPU the host's RAM divided
    among the devices the program runs on (they share it)."""
    devices = list(mesh.devices.flat) if mesh is not None else [jax.devices()[0]]
    stats = devices[0].memory_stats() or {}
    if "bytes_limit" in stats:
        return int(stats["bytes_limit"])
    ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return int(ram // len(devices))


def members_per_device(module, mesh) -> int:
    """The most members of one placement a device holds: the largest useful k."""
    most = 1
    for name, n in module.placements:
        d = 1
        if mesh is not None and name in mesh.axis_names and n % mesh.shape[name] == 0:
            d = mesh.shape[name]
        most = max(most, n // d)
    return most


def _auto(module, mesh, memory_limit, interpreter) -> Executable:
    if memory_limit is not None and (
        isinstance(memory_limit, bool) or not isinstance(memory_limit, int) or memory_limit < 1
    ):
        raise InterpreterError(
            f"xla.compile: memory_limit must be a positive number of bytes, got {memory_limit!r}"
        )
    limit = memory_limit if memory_limit is not None else device_memory(mesh)
    top = members_per_device(module, mesh)
    tried: dict[int, tuple[Executable, int]] = {}

    def peak(k: int) -> int:
        if k not in tried:
            exe = Executable(module, mesh, interpreter(k))
            tried[k] = (exe, predicted_peak(exe.compiled()))
        return tried[k][1]

    if peak(1) > limit:
        raise InterpreterError(
            f"xla.compile(clients_per_step='auto'): one member per step already needs "
            f"{peak(1):,} bytes per device (XLA memory analysis), over the limit of "
            f"{limit:,}; raise memory_limit, shard the program over more devices, or "
            f"make the member computation smaller"
        )
    k = 1
    if top > 1:
        probe = min(PROBE, top)
        per_member = (peak(probe) - peak(1)) / (probe - 1)
        k = top if per_member <= 0 else int(min(top, 1 + (limit - peak(1)) // per_member))
        k = max(k, 1)
        while k > 1 and peak(k) > limit:
            k = max(1, (k * 3) // 4)
    exe, chosen_peak = tried[k][0], peak(k)
    exe.streaming = {
        "clients_per_step": k,
        "mode": "auto",
        "memory_limit_bytes": int(limit),
        "predicted_peak_bytes": chosen_peak,
        "candidates": {str(c): p for c, (_, p) in sorted(tried.items())},
    }
    return exe
