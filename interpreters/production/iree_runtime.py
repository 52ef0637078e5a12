"""Client work as IREE modules (``.vmfb``): loading one, picking this device's, calling it.

Imports only numpy and ``iree.runtime`` (iree-base-runtime): this is what a device
without jax runs. It is copied verbatim into apps exported with ``--device-runtime
iree``, and ``fcir run-plan --device-runtime iree`` uses the same code for bundles.

A module's entry is ``<module>.main`` (``jit_fn.main`` for fcir's parts); it takes one
client's values as numpy arrays, leaf by leaf, and returns its results the same way.

Cold start is what a device pays per Flower message (each message starts a fresh
ClientApp process), so this module talks to IREE's native extension
(``iree._runtime.libs._runtime``, the library ``iree.runtime`` itself wraps) rather than
importing the ``iree.runtime`` package: that package's ``__init__`` imports its
benchmark, I/O, tokenizer and array helpers (``inspect``, ``logging``, ``tempfile``,
``ml_dtypes``...), two thirds of a first client step's time (measured: 9.9 ms import and
setup with ``iree.runtime.Config``, 3.4 ms with the extension, on an idle 2-core x86_64
host; docs/flower.md, "Devices without JAX"). The instance, the ``local-sync`` device
and the HAL module are made once per process and shared by every loaded module;
``ml_dtypes`` is imported only for a bf16 value. iree-base-runtime is pinned to 3.13
(the app's dependencies), the release this was written and tested against.
"""

from __future__ import annotations

import platform
import re
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


# numpy dtype name -> IREE element type name (HalElementType); bool is IREE's i8 bool.
_ELEMENT = {
    "bool": "BOOL_8",
    "int8": "SINT_8",
    "int16": "SINT_16",
    "int32": "SINT_32",
    "int64": "SINT_64",
    "uint8": "UINT_8",
    "uint16": "UINT_16",
    "uint32": "UINT_32",
    "uint64": "UINT_64",
    "float16": "FLOAT_16",
    "bfloat16": "BFLOAT_16",
    "float32": "FLOAT_32",
    "float64": "FLOAT_64",
    "complex64": "COMPLEX_64",
    "complex128": "COMPLEX_128",
}
_RUNTIME: dict = {}  # the process's extension, instance, device, HAL module, type tables
_RUNTIME_LOCK = threading.Lock()


def _runtime() -> dict:
    """IREE's native extension and this process's instance, device and HAL module,
    made on first use (see the module doc)."""
    with _RUNTIME_LOCK:
        if not _RUNTIME:
            try:
                from iree._runtime.libs import _runtime as rt
            except ImportError as e:
                raise DeviceRuntimeError(
                    f"this device has no IREE runtime ({e}): pip install "
                    "'iree-base-runtime>=3.13,<3.14'"
                ) from None
            device = rt.get_cached_hal_driver(DRIVER).create_default_device()
            instance = rt.VmInstance()
            element = {name: getattr(rt.HalElementType, e) for name, e in _ELEMENT.items()}
            _RUNTIME.update(
                rt=rt,
                device=device,
                instance=instance,
                hal=rt.create_hal_module(instance, device),
                element=element,
                dtype_of={int(e): name for name, e in element.items()},
            )
        return _RUNTIME


def _dtype(name: str) -> np.dtype:
    if name == "bfloat16":  # not numpy's: ml_dtypes (an iree-base-runtime dependency)
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


_TENSOR = r"tensor<((?:[^<>]|<[^<>]*>)*)>"
_RESULT = re.compile(rf"%output\d+: {_TENSOR}(?: {{iree\.abi\.encoding = {_TENSOR}}})?")


def _element_name(mlir: str) -> str | None:
    """numpy's name of an MLIR element type (``f32``, ``ui8``, ``i1``, ``complex<f32>``)."""
    m = re.fullmatch(r"(u?)i(\d+)|(b?)f(\d+)|complex<f(\d+)>", mlir)
    if m is None:
        return None
    if m.group(2):
        bits = int(m.group(2))
        return "bool" if bits == 1 else f"{'uint' if m.group(1) else 'int'}{bits}"
    if m.group(4):
        return "bfloat16" if m.group(3) else f"float{m.group(4)}"
    return f"complex{2 * int(m.group(5))}"


def result_dtypes(declaration: str) -> list[str | None]:
    """The numpy dtype names of a function's results, from IREE's ABI declaration
    (``iree.abi.declaration`` reflection): a result's element type, or its
    ``iree.abi.encoding`` where it has one (unsigned integers run as signless ones)."""
    _, _, results = declaration.partition(") -> (")
    out = []
    for m in _RESULT.finditer(results):
        tensor = m.group(2) or m.group(1)
        out.append(_element_name(re.sub(r"^(?:[0-9?]+x)*", "", tensor)))  # drop the dims
    return out


class Module:
    """One loaded ``.vmfb``: ``module(*arrays) -> list of numpy arrays``."""

    def __init__(self, vmfb: bytes, entry: str = "main"):
        r = _runtime()
        rt = r["rt"]
        try:
            # copy_buffer: the bytes come out of base64 (no file to mmap), and a copy
            # is aligned as the VM needs; for modules of 1-160 KB it takes microseconds.
            vm = rt.VmModule.copy_buffer(r["instance"], vmfb)
            self._context = rt.VmContext(r["instance"], modules=[r["hal"], vm])
            self._fn = vm.lookup_function(entry)
        except Exception as e:  # noqa: BLE001  (the runtime raises RuntimeError/ValueError)
            raise DeviceRuntimeError(f"cannot load the IREE module: {e}") from None
        if self._fn is None:
            raise DeviceRuntimeError(f"the IREE module {vm.name} has no function {entry!r}")
        self.name = f"{vm.name}.{entry}"
        names = result_dtypes(self._fn.reflection.get("iree.abi.declaration", ""))
        self._results = [None if n is None else _raw(_dtype(n)) for n in names]
        self._rt = rt
        self._element = r["element"]
        self._dtype_of = r["dtype_of"]
        self._allocate = r["device"].allocator.allocate_buffer_copy
        self._device = r["device"]
        self._memory, self._usage = rt.MemoryType.DEVICE_LOCAL, rt.BufferUsage.DEFAULT
        self._r = r
        self._lock = threading.Lock()  # a local-sync context is not for concurrent calls

    def _buffer(self, x: np.ndarray):
        try:
            element = self._element[x.dtype.name]
        except KeyError:
            raise DeviceRuntimeError(f"IREE modules take no {x.dtype.name} values") from None
        return self._allocate(
            memory_type=self._memory,
            allowed_usage=self._usage,
            device=self._device,
            buffer=x.view(np.uint16) if element == self._element["bfloat16"] else x,  # bits
            element_type=element,
        )

    def _array(self, view, types) -> np.ndarray:
        """A result as numpy: of the declared dtype (``types``: it and the numpy type
        its bytes are read as), else of the buffer's element type."""
        if types is None:
            name = self._dtype_of.get(int(view.element_type))
            if name is None:
                raise DeviceRuntimeError(f"an IREE result of element type {view.element_type}")
            types = _raw(_dtype(name))
        dtype, raw = types
        # A copy: the result must outlive the runtime buffer it was read from.
        return np.array(view.map().asarray(view.shape, raw)).view(dtype)

    def __call__(self, *args) -> list[np.ndarray]:
        rt = self._rt
        arrays = [np.asarray(a, order="C") for a in args]  # (ascontiguousarray makes 0-d 1-d)
        with self._lock:
            ins = rt.VmVariantList(len(arrays))
            for x in arrays:
                ins.push_ref(self._buffer(x))
            outs = rt.VmVariantList(len(self._results) or 1)
            self._context.invoke(self._fn, ins, outs)
            views = [outs.get_as_object(i, rt.HalBufferView) for i in range(outs.size)]
            types = self._results if len(self._results) == len(views) else [None] * len(views)
            return [self._array(v, t) for v, t in zip(views, types)]


def _raw(dtype: np.dtype) -> tuple[np.dtype, np.dtype]:
    """``dtype`` and the numpy type of the same width its bytes are read as (the
    extension's own dtype table has no bfloat16)."""
    return dtype, dtype if dtype.kind in "bc" else np.dtype(f"u{dtype.itemsize}")


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
