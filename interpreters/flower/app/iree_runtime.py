"""Client work as IREE modules (``.vmfb``): loading one, picking this device's, calling it.

Imports only numpy and ``iree.runtime`` (iree-base-runtime): this is what a device
without jax runs. It is copied verbatim into apps exported with ``--device-runtime
iree``, and ``fcir run-plan --device-runtime iree`` uses the same code for bundles.

A module's entry is ``<module>.main`` (``jit_fn.main`` for fcir's parts); it takes one
client's values as numpy arrays, leaf by leaf, and returns its results the same way.
"""

from __future__ import annotations

import platform
import sys
import threading

import numpy as np

DRIVER = "local-sync"  # one thread, no device queue: what a phone's app would embed

# Target name -> the CPU architecture its module runs on (None: the exporting host's).
ARCH = {
    "llvm-cpu": None,
    "x86_64-linux": "x86_64",
    "aarch64-linux-android34": "aarch64",
    "aarch64-apple-ios17": "aarch64",
}
# The target a device of this (system, arch) runs when the app carries it.
NATIVE = {
    ("linux", "x86_64"): "x86_64-linux",
    ("android", "aarch64"): "aarch64-linux-android34",
    ("ios", "aarch64"): "aarch64-apple-ios17",
}


class DeviceRuntimeError(RuntimeError):
    """No module fits this device, or a module does not load or run."""


def machine_arch(name: str | None = None) -> str:
    m = (name or platform.machine()).lower()
    return {"amd64": "x86_64", "x64": "x86_64", "arm64": "aarch64", "armv8": "aarch64"}.get(m, m)


def system_name() -> str:
    if hasattr(sys, "getandroidapilevel"):
        return "android"
    s = platform.system().lower()
    return "ios" if s in ("ios", "ipados") else s


def pick_target(modules: dict, host_arch: str, requested: str | None = None) -> str:
    """Which of ``modules`` (target -> entry with ``arch``) this device runs.

    ``requested`` (node config ``device-target``) wins when given; otherwise the
    target native to this system and architecture, then any module of this
    architecture. ``host_arch`` is the exporting host's (what ``llvm-cpu`` means).
    """
    if requested:
        if requested not in modules:
            raise DeviceRuntimeError(
                f"node config device-target={requested!r}: the app carries modules for "
                f"{', '.join(sorted(modules))}; export with --device-target {requested}"
            )
        return requested
    arch = machine_arch()
    native = NATIVE.get((system_name(), arch))
    if native in modules:
        return native
    for name in sorted(modules):  # "llvm-cpu" sorts before the named targets
        if (modules[name].get("arch") or machine_arch(host_arch)) == arch:
            return name
    carried = ", ".join(f"{k} ({v.get('arch')})" for k, v in sorted(modules.items()))
    raise DeviceRuntimeError(
        f"no module for this device ({system_name()}, {arch}): the app carries {carried}; "
        "export with --device-target for it, or set node config device-target"
    )


class Module:
    """One loaded ``.vmfb``: ``module(*arrays) -> list of numpy arrays``."""

    def __init__(self, vmfb: bytes, entry: str = "main"):
        import iree.runtime as rt

        try:
            self._config = rt.Config(DRIVER)
            self._context = rt.SystemContext(config=self._config)
            vm = rt.VmModule.copy_buffer(self._config.vm_instance, vmfb)
            self._context.add_vm_module(vm)
            self._fn = self._context.modules[vm.name][entry]
        except Exception as e:  # noqa: BLE001  (the runtime raises RuntimeError/ValueError)
            raise DeviceRuntimeError(f"cannot load the IREE module: {e}") from None
        self.name = f"{vm.name}.{entry}"
        self._lock = threading.Lock()  # a local-sync context is not for concurrent calls

    def __call__(self, *args) -> list[np.ndarray]:
        arrays = [np.asarray(a, order="C") for a in args]  # (ascontiguousarray makes 0-d 1-d)
        with self._lock:
            out = self._fn(*arrays)
        if out is None:
            return []
        if not isinstance(out, (tuple, list)):
            out = (out,)
        # Copies: the results must outlive the runtime buffers they were read from.
        return [np.array(o.to_host() if hasattr(o, "to_host") else o) for o in out]


_MODULES: dict = {}


def call(part: dict, env: dict, read, requested: str | None = None) -> None:
    """Runs ``part`` (a plan entry: params, results, and ``iree``: the modules) on
    ``env``'s values with this device's module; ``read(key)`` gives a module's bytes."""
    if not part["results"]:
        return
    entry = part["iree"]
    target = pick_target(entry["modules"], entry["host_arch"], requested)
    key = entry["modules"][target]["file"]
    if key not in _MODULES:
        _MODULES[key] = Module(read(key))
    outs = _MODULES[key](*(env[tuple(p)] for p in part["params"]))
    env.update(zip((tuple(r) for r in part["results"]), outs))
