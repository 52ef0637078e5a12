"""The device side of ``--device-runtime iree`` (interpreters/production/iree_runtime.py):
a ``.vmfb`` loaded and called through IREE's native extension, every dtype fcir's parts
carry coming back as XLA gives it, and a fresh process that imports neither jax nor the
``iree.runtime`` package (whose ``__init__`` was two thirds of a first client step)."""

from __future__ import annotations

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("iree.compiler", reason="needs iree-base-compiler (pip install 'fcir[iree]')")
pytest.importorskip("iree.runtime", reason="needs iree-base-runtime (pip install 'fcir[iree]')")

from fcir.interpreters.production import (
    iree,  # noqa: E402
    iree_runtime,  # noqa: E402
)

pytestmark = pytest.mark.slow  # docs/contributing.md: left out of the fast tier


def _compiled(fn, specs):
    exported = iree.cpu_export(fn, specs)
    return exported, iree.compile_module(bytes(exported.mlir_module_serialized), "llvm-cpu", "O2")


def _every_dtype(f32, i32, u8, b, f16, u32, i8, bf16, c64):
    return (
        f32 * 2.0,
        i32 + 1,  # 0-d
        u8 ^ jnp.uint8(3),  # unsigned: signless inside IREE
        jnp.logical_not(b),
        f16 * f16,
        u32 + jnp.uint32(1),
        i8 - jnp.int8(1),
        (bf16.astype(jnp.float32) * 3.0).astype(jnp.bfloat16),
        c64 * c64,
        jnp.sum(f32),  # 0-d float
    )


EVERY = [
    jax.ShapeDtypeStruct((2, 3), jnp.float32),
    jax.ShapeDtypeStruct((), jnp.int32),
    jax.ShapeDtypeStruct((4,), jnp.uint8),
    jax.ShapeDtypeStruct((5,), jnp.bool_),
    jax.ShapeDtypeStruct((2,), jnp.float16),
    jax.ShapeDtypeStruct((3,), jnp.uint32),
    jax.ShapeDtypeStruct((2, 2), jnp.int8),
    jax.ShapeDtypeStruct((4,), jnp.bfloat16),
    jax.ShapeDtypeStruct((3,), jnp.complex64),
]


def test_a_module_returns_every_dtype_and_shape_as_xla_does():
    exported, vmfb = _compiled(_every_dtype, EVERY)
    module = iree_runtime.Module(vmfb)
    assert module.name == "jit__every_dtype.main"
    for seed in (0, 1):
        args = iree.seeded_inputs(exported.in_avals, seed)
        got, want = module(*args), iree.reference(exported)(*args)
        assert [(g.dtype, g.shape) for g in got] == [(w.dtype, w.shape) for w in want]
        for g, w in zip(got, want):
            assert iree.mismatch(g, w) is None, (g.dtype, iree.mismatch(g, w))
        assert all(g.flags.owndata or g.base is not None for g in got)


def test_result_dtypes_read_iree_s_declaration_with_its_unsigned_encodings():
    decl = (
        "sync func @main(%input0: tensor<4xi8> {iree.abi.encoding = tensor<4xui8>}) -> "
        "(%output0: tensor<2x3xf32>, %output1: tensor<i32>, %output2: tensor<4xi8> "
        "{iree.abi.encoding = tensor<4xui8>}, %output3: tensor<5xi1>, %output4: "
        "tensor<3xcomplex<f64>>, %output5: tensor<bf16>, %output6: tensor<7x1xf16>)"
    )
    assert iree_runtime.result_dtypes(decl) == [
        "float32",
        "int32",
        "uint8",
        "bool",
        "complex128",
        "bfloat16",
        "float16",
    ]
    assert iree_runtime.result_dtypes("") == []


def test_results_outlive_the_call_and_modules_share_one_device():
    exported, vmfb = _compiled(
        lambda x: (x + 1.0, x * x), [jax.ShapeDtypeStruct((3,), jnp.float32)]
    )
    a, b = iree_runtime.Module(vmfb), iree_runtime.Module(vmfb)
    first = a(np.arange(3, dtype=np.float32))
    b(np.full(3, 7.0, np.float32))
    a(np.full(3, -1.0, np.float32))
    np.testing.assert_array_equal(first[0], [1.0, 2.0, 3.0])
    np.testing.assert_array_equal(first[1], [0.0, 1.0, 4.0])
    assert a._r is b._r  # one instance, device and HAL module per process


def test_a_module_without_the_entry_is_a_device_runtime_error():
    _, vmfb = _compiled(lambda x: (x + 1.0,), [jax.ShapeDtypeStruct((3,), jnp.float32)])
    with pytest.raises(iree_runtime.DeviceRuntimeError, match="no function 'step'"):
        iree_runtime.Module(vmfb, "step")
    with pytest.raises(iree_runtime.DeviceRuntimeError, match="cannot load the IREE module"):
        iree_runtime.Module(b"not a module")


# The device's process: iree_runtime.py on its own (as an app carries it), jax, fcir and
# the iree.runtime package refused.
_CHILD = r"""
import importlib.abc, importlib.util, sys
BLOCKED = ("jax", "jaxlib", "fcir", "iree.runtime")
class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name in BLOCKED or name.split(".")[0] in BLOCKED:
            raise ImportError(f"this device refuses {name}")
sys.meta_path.insert(0, Refuse())
import numpy as np
src, vmfb, x = sys.argv[1:]
spec = importlib.util.spec_from_file_location("iree_runtime", src)
ir = importlib.util.module_from_spec(spec); spec.loader.exec_module(ir)
module = ir.Module(open(vmfb, "rb").read())
(y,) = module(np.load(x))
np.save(x + ".out.npy", y)
loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("jax", "fcir", "ml_dtypes"))
loaded += [m for m in sys.modules if m.startswith("iree.runtime")]
assert not loaded, loaded
print("ok")
"""


def test_a_fresh_device_process_loads_no_iree_runtime_package_nor_jax(tmp_path):
    exported, vmfb = _compiled(
        lambda x: (jnp.tanh(x) * 2.0,), [jax.ShapeDtypeStruct((2, 5), jnp.float32)]
    )
    (tmp_path / "m.vmfb").write_bytes(vmfb)
    x = np.random.default_rng(0).normal(size=(2, 5)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    p = subprocess.run(
        [
            sys.executable,
            "-c",
            _CHILD,
            iree_runtime.__file__,
            str(tmp_path / "m.vmfb"),
            str(tmp_path / "x.npy"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr[-3000:]
    (want,) = iree.reference(exported)(x)
    assert iree.mismatch(np.load(tmp_path / "x.npy.out.npy"), want) is None
