"""The client budget of a streamed executable: a given ``k``, or one chosen for memory.

``xla.compile(module, mesh, clients_per_step=k)`` builds the executable with
:class:`~.streaming.StreamingInterpreter`. With ``clients_per_step="auto"`` the budget
is chosen from a memory limit (``memory_limit`` bytes per device, or the device's
memory: ``bytes_limit`` of ``Device.memory_stats()`` on accelerators, the host's RAM
shared by its devices on CPU) by compiling a few candidates. A candidate *fits* when it
compiles and XLA's memory analysis of it predicts a peak (arguments + outputs +
temporaries - aliased bytes) within the limit. It does not fit when the predicted peak
is over the limit, or when compiling it runs out of memory: an accelerator's compiler
checks the program against the device's memory and refuses it (on a TPU,
``RESOURCE_EXHAUSTED: ... Ran out of memory in memory space hbm. Used 20.27G of
15.75G hbm``, raised at compile time as ``jax.errors.JaxRuntimeError``); the bytes it
says it asked for count as that candidate's peak. Any other compile error propagates.

The search keeps the compiles few, and each near the limit (a compile far over an
accelerator's memory is the slow kind: its compiler tries hard to make it fit):

1. compile k = 1 and k = 2; the peak is close to linear in k (each step holds k
   members' intermediates), so the two give the bytes per member;
2. compile the largest k that the line through them says fits (all members, if the
   line never reaches the limit), and keep it if it fits;
3. once a candidate did not fit, the search narrows between the largest k that fits
   and the smallest that does not: the next candidate is where the line between their
   peaks meets the limit (halfway where the compiler gave no figure), until that line
   says nothing more fits, or after eight compiles.

So a program that fits only k = 2 costs two compiles, one that fits every member three.
The chosen ``k``, the peak XLA predicts for it, every candidate compiled with its peak,
and the candidates that ran out of memory with the bytes their compile asked for go into
``exe.streaming`` and the cost report (``exe.cost()["streaming"]``).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re

import jax

from fcir.errors import InterpreterError

from .cost import memory_stats, predicted_peak
from .executable import Executable
from .streaming import StreamingInterpreter, members_per_step

__all__ = [
    "allocator_limit",
    "device_memory",
    "members_per_device",
    "memory_stats",
    "predicted_peak",
    "streaming_executable",
]

PROBE = 2  # the second k compiled: with k = 1, the bytes per member
MOST_COMPILES = 8  # then the largest k that fitted is taken


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


def allocator_limit(device) -> int | None:
    """Bytes ``device``'s allocator may hold (``bytes_limit`` of its memory stats), or
    None where JAX does not say (CPU)."""
    try:
        stats = device.memory_stats() or {}
    except Exception:  # noqa: BLE001  some backends raise instead of returning None
        return None
    limit = stats.get("bytes_limit")
    return int(limit) if limit else None


def device_memory(mesh) -> int:
    """Bytes one device may use: its allocator's limit, or on CPU the host's RAM divided
    among the devices the program runs on (they share it)."""
    devices = list(mesh.devices.flat) if mesh is not None else [jax.devices()[0]]
    limit = allocator_limit(devices[0])
    if limit is not None:
        return limit
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
    device = device_memory(mesh)
    limit = memory_limit if memory_limit is not None else device
    executables: dict[int, Executable] = {}

    def compile_k(k: int) -> Probe:
        exe = executables[k] = Executable(module, mesh, interpreter(k))
        try:
            return Probe(peak=predicted_peak(exe.compiled()))
        except InterpreterError as e:
            oom = out_of_memory(e.__cause__ or e)
            if oom is None:
                raise  # not a question of memory: the user must see it
            return oom

    search = search_budget(compile_k, members_per_device(module, mesh), limit)
    if search.k is None:
        one = search.tried[1]
        raise InterpreterError(_none_fits(one, device, memory_limit)) from one.error
    k = search.k
    exe = executables[k]
    exe.streaming = {
        "clients_per_step": k,
        "mode": "auto",
        "memory_limit_bytes": int(limit),
        "predicted_peak_bytes": search.tried[k].peak,
        "candidates": {
            str(c): p.peak for c, p in sorted(search.tried.items()) if p.message is None
        },
        "out_of_memory": {
            str(c): p.peak for c, p in sorted(search.tried.items()) if p.message is not None
        },
    }
    return exe


@dataclasses.dataclass(frozen=True)
class Probe:
    """One candidate compiled: its peak bytes per device (XLA's memory analysis), or,
    when compiling it ran out of memory, the bytes the compiler said it asked for (None
    if its message says not) and the compiler's ``message``."""

    peak: int | None
    message: str | None = None
    error: BaseException | None = dataclasses.field(default=None, compare=False, repr=False)


@dataclasses.dataclass(frozen=True)
class Search:
    k: int | None  # None: not even k = 1 fits
    tried: dict[int, Probe]


def search_budget(compile_k, top: int, limit: int) -> Search:
    """The budget search of the module docstring: ``compile_k(k)`` compiles candidate
    ``k`` and returns its :class:`Probe`; ``top`` is the largest useful k; ``limit`` the
    bytes a device may use."""
    tried: dict[int, Probe] = {}

    def fits(k: int) -> bool:
        if k not in tried:
            tried[k] = compile_k(k)
        p = tried[k]
        return p.message is None and p.peak <= limit

    if not fits(1):
        return Search(None, tried)
    lo, hi = 1, top + 1  # the largest k known to fit; the smallest known not to
    if top >= PROBE:
        if fits(PROBE):
            lo = PROBE
        else:
            hi = PROBE
    while hi - lo > 1 and len(tried) < MOST_COMPILES:
        k = _next_candidate(tried, lo, hi, limit)
        if k is None:
            break  # the line says lo is the most that fits
        if fits(k):
            lo = k
            if hi > top:
                break  # nothing ran out yet: the line's largest is kept, no creeping up
        else:
            hi = k
    return Search(lo, tried)


def _next_candidate(tried: dict[int, Probe], lo: int, hi: int, limit: int) -> int | None:
    """Between ``lo`` (fits) and ``hi`` (does not, or past the last member): the largest
    k the line through ``lo``'s peak and the nearest other figure says fits (None when
    that is ``lo`` itself); halfway when no figure gives a slope."""
    if hi in tried:  # a candidate that did not fit
        if tried[hi].peak is None:
            return (lo + hi) // 2
        other = hi
    else:  # the line through the fits below
        other = max((c for c in tried if c < lo and tried[c].message is None), default=None)
        if other is None:
            return (lo + hi) // 2
    slope = (tried[other].peak - tried[lo].peak) / (other - lo)
    if slope <= 0:
        return hi - 1
    k = lo + int((limit - tried[lo].peak) // slope)
    return None if k <= lo else min(k, hi - 1)


# A compile that ran out of the device's memory: JAX raises the compiler's status as
# jax.errors.JaxRuntimeError (a RuntimeError), its text starting with the status code.
_OOM_STATUS = "RESOURCE_EXHAUSTED"
_UNITS = {"": 1, "B": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40, "P": 2**50}
# What it asked for, in the forms XLA's compilers and allocators word it: TPU "Used
# 20.27G of 15.75G hbm", "the total memory required for HLO temporaries (38.73G)
# exceeds available HBM" (the temporaries alone: a little under the peak) or "TPU
# TensorCore Hbm usage: 34.82G, SparseCore Hbm usage 174.10G, exceeding ..." (sizes in
# XLA's binary units), the GPU allocator's "trying to allocate 123456 bytes".
_ASKED = (
    re.compile(r"Used (\d+(?:\.\d+)?)([KMGTP]?)i?B? of \d"),
    re.compile(r"required for HLO temporaries \((\d+(?:\.\d+)?)([KMGTP]?)i?B?\)"),
    re.compile(
        r"Hbm usage:? (\d+(?:\.\d+)?)([KMGTP]?)i?B?, SparseCore Hbm usage:? "
        r"(\d+(?:\.\d+)?)([KMGTP]?)i?B?"
    ),
    re.compile(r"allocate (\d[\d,]*) bytes"),
)


def out_of_memory(error: BaseException) -> Probe | None:
    """The :class:`Probe` of a compile that raised ``error``, if that says the device's
    memory ran out; None for any other error."""
    text = str(error)
    if not isinstance(error, RuntimeError) or _OOM_STATUS not in text.split(":", 1)[0]:
        return None
    return Probe(peak=_asked_bytes(text), message=text.strip().splitlines()[0][:300], error=error)


def _asked_bytes(text: str) -> int | None:
    for pattern in _ASKED:
        m = pattern.search(text)
        if m is None:
            continue
        groups = m.groups()
        if len(groups) == 1:
            return int(groups[0].replace(",", ""))
        pairs = zip(groups[::2], groups[1::2])
        return int(sum(float(n) * _UNITS[unit] for n, unit in pairs))
    return None


def _none_fits(one: Probe, device: int, memory_limit: int | None) -> str:
    if memory_limit is not None:
        where = f"the limit is memory_limit={memory_limit:,} bytes (the device has {device:,})"
    else:
        where = f"the device has {device:,} bytes"
    if one.message is None:
        need = f"needs {one.peak:,} bytes per device (XLA memory analysis)"
    elif one.peak is not None:
        need = (
            f"needs {one.peak:,} bytes per device: compiling it ran out of memory ({one.message})"
        )
    else:
        need = (
            "ran out of memory compiling, and the compiler's message does not say how "
            f"many bytes it asked for ({one.message})"
        )
    return (
        f"xla.compile(clients_per_step='auto'): one member per step already {need}; "
        f"{where}; shard the program over more devices, or make the member computation "
        f"smaller"
        + ("; or raise memory_limit" if memory_limit is not None and memory_limit < device else "")
    )
