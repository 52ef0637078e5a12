"""Client work compiled with IREE, and verified against XLA before it is written.

``--device-runtime iree`` exports a round's client parts for devices without jax: each
part's member-level code is exported with ``jax.export`` for CPU only (a multi-platform
export wraps the body in ``stablehlo.case``, which IREE miscompiles: docs/flower.md,
"Devices without JAX"), compiled by ``iree-compile`` into one ``.vmfb`` per device
target, and run on verification inputs against XLA running the same StableHLO:

- integers and booleans: bit for bit;
- f32, f64 (and complex): ``|iree - xla| <= rtol * |xla| + atol`` with rtol 1e-5 and
  atol 1e-5 * the largest ``|xla|`` of that result (one scale per result, so values
  that cancel to near zero are held to the result's own magnitude);
- bf16 and f16: within 1 ulp; NaN where XLA has NaN, the same infinities.

Verification inputs are seeded arrays of the part's types (two seeds) and, when given,
the round's own inputs. IREE's optimization levels are tried in turn (``O2``, its
default, then ``O3``, ``O1``, ``O0``): the first level at which every target compiles
and every module this host can run matches is kept. Otherwise ``ExportError`` names the
part and says to export with ``--device-runtime jax``: a wrong number never reaches a
device. Modules for another architecture are compiled from the same input at the
verified level and, where an emulator is set up, run and verified too: with
``FCIR_IREE_AARCH64_RUN_MODULE`` naming the aarch64 ``iree-run-module`` (from PyPI's
manylinux aarch64 iree-base-runtime wheel) and ``qemu-aarch64`` on PATH (Debian's
qemu-user; sysroot ``FCIR_QEMU_AARCH64_SYSROOT``, default /usr/aarch64-linux-gnu), the
aarch64 modules run under qemu on the same inputs. Otherwise the manifest says they
were not run.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile

import jax
import numpy as np

from fcir.errors import ExportError
from fcir.ir.types import dtype_name, runtime_type

from . import iree_runtime, lowering
from .splitting import part_interface

RUNTIMES = ("jax", "iree")
DEFAULT_TARGET = "llvm-cpu"
TARGETS = tuple(iree_runtime.ARCH)
# --iree-llvmcpu-target-triple of each target (llvm-cpu: the host's own).
TRIPLES = {
    "llvm-cpu": None,
    "x86_64-linux": "x86_64-unknown-linux-gnu",
    "aarch64-linux-android34": "aarch64-linux-android34",
    "aarch64-apple-ios17": "arm64-apple-ios17.0",
}
OPT_LEVELS = ("O2", "O3", "O1", "O0")
RTOL = 1e-5
ATOL_SCALE = 1e-5
ULPS = 1
SEEDS = (0, 1)
ENTRY = "main"


def host_arch() -> str:
    return iree_runtime.machine_arch(platform.machine())


def arch_of(target: str) -> str:
    return iree_runtime.ARCH[target] or host_arch()


def check_targets(targets) -> tuple[str, ...]:
    """``targets`` (``--device-target``), deduplicated in order; ExportError if unknown."""
    out: list[str] = []
    for t in targets or (DEFAULT_TARGET,):
        if t not in TRIPLES:
            raise ExportError(
                f"--device-target {t!r}: choose from {', '.join(TARGETS)} (default {DEFAULT_TARGET})"
            )
        if t not in out:
            out.append(t)
    return tuple(out)


# --- compiling ----------------------------------------------------------------------------


def cpu_export(fn, specs):
    """``fn`` exported with ``jax.export`` for CPU only (no ``stablehlo.case`` wrapper,
    no leading platform-index argument)."""
    with lowering._no_source_paths():
        return jax.export.export(jax.jit(fn, keep_unused=True), platforms=("cpu",))(*specs)


def compile_module(stablehlo: bytes, target: str, opt_level: str, extra_flags=()) -> bytes:
    """``iree-compile`` of portable StableHLO bytecode for ``target``."""
    try:
        import iree.compiler as ic
    except ImportError as e:
        raise ExportError(
            f"--device-runtime iree needs the IREE compiler: {e} (pip install -e '.[iree]' "
            "in the fcir checkout)"
        ) from None
    flags = [
        "--iree-hal-target-device=local",
        "--iree-hal-local-target-device-backends=llvm-cpu",
        "--iree-llvmcpu-target-cpu=generic",  # any CPU of the architecture, not this one
        f"--iree-opt-level={opt_level}",
    ]
    if TRIPLES[target]:
        flags.append(f"--iree-llvmcpu-target-triple={TRIPLES[target]}")
    flags += list(extra_flags)
    return ic.compile_str(stablehlo, input_type="stablehlo", extra_args=flags)


# --- verifying ----------------------------------------------------------------------------


def seeded_inputs(avals, seed: int) -> list[np.ndarray]:
    """Arrays of ``avals``' shapes and dtypes: floats standard normal, integers in
    [0, 4) (small enough to be valid indices and counts), booleans fair coins."""
    rng = np.random.default_rng(seed)
    out = []
    for a in avals:
        dt = np.dtype(a.dtype)
        shape = tuple(a.shape)
        if dt == np.bool_:
            x = rng.random(shape) < 0.5
        elif dt.kind in "iu":
            x = rng.integers(0, 4, size=shape)
        elif dt.kind == "c":
            x = rng.normal(size=shape) + 1j * rng.normal(size=shape)
        else:
            x = rng.normal(size=shape)
        out.append(np.asarray(x).astype(dt))
    return out


def _ordered(x: np.ndarray) -> np.ndarray:
    """16-bit float bits as integers ordered like the floats (adjacent floats differ by 1)."""
    bits = x.view(np.int16).astype(np.int32)
    return np.where(bits < 0, -32768 - bits, bits)


def mismatch(got: np.ndarray, want: np.ndarray) -> str | None:
    """Why ``got`` (IREE) is not ``want`` (XLA) under the stated tolerances; None if it is."""
    got, want = np.asarray(got), np.asarray(want)
    if got.dtype != want.dtype or got.shape != want.shape:
        return f"{got.dtype}{list(got.shape)} where XLA gives {want.dtype}{list(want.shape)}"
    if want.dtype.kind not in "fc" and want.dtype.name not in ("bfloat16", "float16"):
        bad = got != want
        if bad.any():
            i = np.argwhere(bad)[0]
            return f"{int(bad.sum())} element(s) differ, e.g. at {tuple(int(k) for k in i)}: {got[tuple(i)]} vs {want[tuple(i)]}"
        return None
    wide = want.astype(np.complex128 if want.dtype.kind == "c" else np.float64)
    g = got.astype(wide.dtype)
    nan_w, nan_g = np.isnan(wide), np.isnan(g)
    if (nan_w != nan_g).any():
        return "NaN where XLA has a number (or a number where XLA has NaN)"
    inf = np.isinf(wide)
    if (inf != np.isinf(g)).any() or (g[inf] != wide[inf]).any():
        return "infinities differ"
    ok = ~(nan_w | inf)
    if not ok.any():
        return None
    if want.dtype.itemsize == 2 and want.dtype.kind != "c":  # bf16, f16: ulps
        ulps = np.abs(_ordered(got) - _ordered(want))[ok]
        worst = int(ulps.max())
        return None if worst <= ULPS else f"off by {worst} ulp (allowed {ULPS})"
    err = np.abs(g - wide)[ok]
    scale = np.abs(wide)[ok]
    bound = RTOL * scale + ATOL_SCALE * scale.max()
    if (err > bound).any():
        k = int(np.argmax(err - bound))
        return (
            f"max error {float(err.max()):.3g} (value {complex(wide[ok][k]) if wide.dtype.kind == 'c' else float(wide[ok][k]):.6g}); "
            f"allowed rtol {RTOL:g}, atol {ATOL_SCALE:g} x max |value| = {ATOL_SCALE * float(scale.max()):.3g}"
        )
    return None


def reference(exported):
    """XLA running ``exported`` (the CPU-only StableHLO the module was compiled from)."""
    fn = jax.jit(exported.call)

    def run(*args):
        return [np.asarray(y) for y in fn(*args)]

    return run


def _value_type(shape, dtype) -> str:
    """``iree-run-module``'s name of a tensor type: ``2x3xf32``, ``4xbf16``, ``i32`` (0-d)."""
    dt = np.dtype(dtype)
    name = {"bool": "i1", "bfloat16": "bf16"}.get(dt.name)
    if name is None:
        kind = {"u": "ui", "i": "i", "f": "f"}[dt.kind]
        name = f"{kind}{8 * dt.itemsize}"
    return "x".join([*(str(d) for d in shape), name])


def emulator(arch: str, out_avals):
    """``module(vmfb)(*arrays) -> list`` running ``arch`` modules on this host through
    ``iree-run-module`` (under qemu for aarch64 on another host); None when not set up.

    Values go in and out as raw bytes with their types on the command line (npy for
    complex values, whose type the tool does not parse): .npy has no bfloat16."""
    if arch != "aarch64":
        return None
    tool = os.environ.get("FCIR_IREE_AARCH64_RUN_MODULE")
    if not tool or not pathlib.Path(tool).is_file():
        return None
    prefix: list[str] = []
    if host_arch() != "aarch64":
        qemu = shutil.which("qemu-aarch64")
        sysroot = os.environ.get("FCIR_QEMU_AARCH64_SYSROOT", "/usr/aarch64-linux-gnu")
        if qemu is None or not pathlib.Path(sysroot).is_dir():
            return None
        prefix = [qemu, "-L", sysroot]
    outs = [(tuple(a.shape), np.dtype(a.dtype)) for a in out_avals]

    def load(vmfb: bytes):
        def run(*args):
            with tempfile.TemporaryDirectory(prefix="fcir-iree-emu-") as d:
                d = pathlib.Path(d)
                (d / "m.vmfb").write_bytes(vmfb)
                cmd = [
                    *prefix,
                    tool,
                    "--device=local-sync",
                    f"--module={d / 'm.vmfb'}",
                    f"--function={ENTRY}",
                ]
                for i, x in enumerate(args):
                    x = np.asarray(x, order="C")  # (ascontiguousarray makes 0-d 1-d)
                    if x.dtype.kind == "c":
                        np.save(d / f"in{i}.npy", x)
                        cmd.append(f"--input=@{d / f'in{i}.npy'}")
                    else:
                        (d / f"in{i}.bin").write_bytes(x.tobytes())
                        cmd.append(f"--input={_value_type(x.shape, x.dtype)}=@{d / f'in{i}.bin'}")
                files = [
                    d / f"out{j}.{'npy' if t.kind == 'c' else 'bin'}"
                    for j, (_, t) in enumerate(outs)
                ]
                cmd += [f"--output=@{f}" for f in files]
                p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
                if p.returncode != 0:
                    raise RuntimeError((p.stderr or p.stdout).strip()[-500:])
                return [
                    np.load(f)
                    if t.kind == "c"
                    else np.frombuffer(f.read_bytes(), dtype=t).reshape(shape).copy()
                    for f, (shape, t) in zip(files, outs)
                ]

        return run

    load.description = f"{' '.join(os.path.basename(x) for x in prefix[:1])} {tool}".strip()
    return load


def _check(module, ref, input_sets) -> str | None:
    for k, args in enumerate(input_sets):
        want = ref(*args)
        try:
            got = module(*args)
        except Exception as e:  # noqa: BLE001  (the runtime raises assorted errors)
            return f"input set {k}: the module failed: {e}"
        if len(got) != len(want):
            return f"input set {k}: {len(got)} results where XLA gives {len(want)}"
        for j, (g, w) in enumerate(zip(got, want)):
            why = mismatch(g, w)
            if why:
                return f"input set {k}, result {j}: {why}"
    return None


@dataclasses.dataclass
class Compiled:
    """A part's verified modules: target -> .vmfb bytes, and how they were verified."""

    modules: dict[str, bytes]
    opt_level: str
    entry: str
    verified_on: dict[str, int]  # target -> number of input sets it matched XLA on
    input_sets: int
    emulated: dict[str, str] = dataclasses.field(default_factory=dict)  # target -> how

    def manifest(self, files: dict[str, str]) -> dict:
        """The manifest / plan entry: each target's file (or key), arch and verification."""
        return {
            "runtime": "iree",
            "entry": self.entry,
            "host_arch": host_arch(),  # what llvm-cpu was compiled for
            "opt_level": self.opt_level,
            "tolerance": {"rtol": RTOL, "atol_times_max_abs": ATOL_SCALE, "ulps_16bit": ULPS},
            "input_sets": self.input_sets,
            "modules": {
                t: {
                    "file": files[t],
                    "arch": arch_of(t),
                    "verified": (
                        f"ran and matched XLA on {self.verified_on[t]} input set(s)"
                        + (f" under {self.emulated[t]}" if t in self.emulated else "")
                        if t in self.verified_on
                        else f"compiled at {self.opt_level}, where the host's module matched; "
                        f"not run at export ({arch_of(t)} is not this host's {host_arch()}; "
                        "set FCIR_IREE_AARCH64_RUN_MODULE to run aarch64 modules under qemu)"
                    ),
                }
                for t in self.modules
            },
        }


def compile_verified(part: str, fn, specs, targets, extra_inputs=()) -> Compiled:
    """``fn`` (a part's member-level code) compiled for ``targets`` and verified; see the
    module doc. ``extra_inputs``: more input sets (the round's own values) to verify on."""
    targets = check_targets(targets)
    exported = cpu_export(fn, specs)
    stablehlo = bytes(exported.mlir_module_serialized)
    input_sets = [seeded_inputs(exported.in_avals, s) for s in SEEDS] + [
        [np.asarray(x) for x in xs] for xs in extra_inputs
    ]
    ref = reference(exported)
    failures = []
    entry = f"jit_fn.{ENTRY}"
    for level in OPT_LEVELS:
        modules, verified, why = {}, {}, None
        for t in targets:
            try:
                modules[t] = compile_module(stablehlo, t, level)
            except ExportError:
                raise
            except Exception as e:  # noqa: BLE001  (CompilerToolError carries the log)
                why = f"{t} does not compile: {_first_error(e)}"
                break
        emulated: dict[str, str] = {}
        if why is None:
            for t in targets:
                if arch_of(t) != host_arch():
                    emu = emulator(arch_of(t), exported.out_avals)
                    if emu is None:
                        continue
                    emulated[t] = emu.description
                    module = emu(modules[t])
                else:
                    try:
                        module = iree_runtime.Module(modules[t], ENTRY)
                    except iree_runtime.DeviceRuntimeError as e:
                        why = f"{t}: {e}"
                        break
                    entry = module.name
                why = _check(module, ref, input_sets)
                if why:
                    why = f"{t}: {why}"
                    break
                verified[t] = len(input_sets)
        if why is None and not any(arch_of(t) == host_arch() for t in targets):
            # Nothing this host can run: verify a host module at this level instead.
            try:
                module = iree_runtime.Module(compile_module(stablehlo, DEFAULT_TARGET, level))
                why = _check(module, ref, input_sets)
            except Exception as e:  # noqa: BLE001
                why = f"host check: {_first_error(e)}"
        if why is None:
            return Compiled(modules, level, entry, verified, len(input_sets), emulated)
        failures.append(f"{level}: {' '.join(why.split())[:400]}")
    raise ExportError(
        f"--device-runtime iree: {part} cannot be compiled with IREE to match XLA at any "
        f"optimization level ({'; '.join(failures)}); export it with --device-runtime jax"
    )


def _first_error(e: Exception) -> str:
    text = str(e)
    for line in text.splitlines():
        if "error:" in line:
            return line.strip()[:300]
    return text.strip().splitlines()[0][:300] if text.strip() else type(e).__name__


def round_client_inputs(plan, leaves) -> list[list[np.ndarray]]:
    """client_work's inputs for each client on the round's argument ``leaves`` (what
    ``fcir run-plan`` takes): the client arguments' rows and what server_prepare
    broadcasts, computed by XLA."""
    params = plan.round.main.body.params
    if len(leaves) != len(params):
        raise ExportError(
            f"--inputs: @{plan.round.name} takes {len(params)} argument leaves, got {len(leaves)}"
        )
    env = {}
    for i, (v, x) in enumerate(zip(params, leaves)):
        t = runtime_type(v.type, plan.round.cardinality)
        got = f"{dtype_name(np.asarray(x).dtype)}[{','.join(str(d) for d in np.shape(x))}]"
        if got != str(t):
            raise ExportError(f"--inputs arr_{i}: needs an array of {t}, got {got}")
        env[("arg", str(i))] = np.asarray(x)
    interface = part_interface(plan)
    ins, outs = interface["server_prepare"]
    fn, _ = lowering.flat_function(plan.code("server_prepare"))
    if outs:
        env.update(zip(outs, jax.jit(fn)(*(env[p] for p in ins))))
    clients = plan.round.placements[0][1] if plan.round.placements else 0
    sets = []
    for c in range(clients):
        row = []
        for g, n in interface["client_work"][0]:
            row.append(
                env[("arg", n)][c] if g == "arg" else np.asarray(env[("broadcast_input", n)])
            )
        sets.append(row)
    return sets


def client_modules(
    plan, name: str, client: dict, artifacts: dict, targets, server_inputs=None
) -> tuple[dict, dict]:
    """A Flower app's client step with IREE modules (``name@target`` artifacts, verified)
    in place of client work's jax.export artifact ``name``: (step entry, artifacts).

    ``server_inputs`` (leaf index -> array): the server's real inputs; with seeded
    client data they give each client's broadcast values to verify on as well."""
    artifacts = {k: v for k, v in artifacts.items() if k != name}
    if not client["results"]:
        return client, artifacts
    fn, specs = lowering.flat_function(plan.code("client_work"))
    extra = ()
    if server_inputs is not None:
        leaves = []
        for i, v in enumerate(plan.round.main.body.params):
            if i in server_inputs:
                leaves.append(np.asarray(server_inputs[i]))
            else:  # a client argument: seeded rows, one per client
                t = runtime_type(v.type, plan.round.cardinality)
                leaves.append(seeded_inputs([jax.ShapeDtypeStruct(t.shape, t.np_dtype)], 2)[0])
        extra = round_client_inputs(plan, leaves)
    compiled = compile_verified(name, fn, specs, targets, extra)
    keys = {t: f"{name}@{t}" for t in compiled.modules}
    artifacts.update({keys[t]: data for t, data in compiled.modules.items()})
    client = {k: v for k, v in client.items() if k != "artifact"}
    client["iree"] = compiled.manifest(keys)
    return client, artifacts
