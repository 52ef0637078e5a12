"""Cross-compiled client work (--device-target aarch64-...) run under qemu-aarch64 with
the aarch64 ``iree-run-module`` from PyPI's manylinux iree-base-runtime wheel, against
XLA on this host, with the export's own tolerances.

Emulation of the CPU, not a phone: what a device would run is this same ``.vmfb``
through IREE's runtime. Skips with the reason where qemu-user, an aarch64 sysroot
(Debian's libc6-arm64-cross, libstdc++6-arm64-cross) or the wheel is missing.
"""

from __future__ import annotations

import json
import pathlib
import shutil
import subprocess
import sys
import tempfile
import zipfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from productionlib import cases, iree_faults

import fcir

pytest.importorskip("iree.compiler", reason="needs iree-base-compiler (pip install 'fcir[iree]')")
from fcir.interpreters import production  # noqa: E402
from fcir.interpreters.production import iree, lowering  # noqa: E402

# Slow (docs/contributing.md), and JAX-independent: what a JAX version can change is the
# StableHLO that IREE compiles, which test_production_iree.py checks on both CI legs;
# this file runs such modules for another CPU under qemu.
pytestmark = [pytest.mark.slow, pytest.mark.jax_independent]

SYSROOT = pathlib.Path("/usr/aarch64-linux-gnu")
WHEEL = "iree-base-runtime==3.13.0"
AARCH64 = ("aarch64-linux-android34", "aarch64-apple-ios17")


@pytest.fixture(scope="module")
def aarch64_tool():
    """The aarch64 ``iree-run-module`` from PyPI's manylinux wheel (cached in the temp
    dir); skips where it, qemu-aarch64 or the sysroot is missing."""
    qemu = shutil.which("qemu-aarch64")
    if qemu is None:
        pytest.skip("qemu-aarch64 is missing: apt-get install qemu-user")
    if not (SYSROOT / "lib" / "libstdc++.so.6").is_file():
        pytest.skip(
            f"no aarch64 sysroot at {SYSROOT}: apt-get install libc6-arm64-cross "
            "libstdc++6-arm64-cross"
        )
    cache = pathlib.Path(tempfile.gettempdir()) / "fcir-iree-aarch64-runtime"
    tool = cache / "iree" / "_runtime_libs" / "iree-run-module"
    if not tool.is_file():
        cache.mkdir(exist_ok=True)
        p = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                WHEEL,
                "--no-deps",
                "--only-binary=:all:",
                "--platform",
                "manylinux_2_28_aarch64",
                "--python-version",
                "3.11",
                "-d",
                str(cache),
            ],
            capture_output=True,
            text=True,
            timeout=600,
        )
        wheels = sorted(cache.glob("iree_base_runtime-*aarch64*.whl"))
        if p.returncode != 0 or not wheels:
            pytest.skip(f"cannot download the aarch64 {WHEEL} wheel: {p.stderr[-300:]}")
        with zipfile.ZipFile(wheels[-1]) as z:
            z.extract("iree/_runtime_libs/iree-run-module", cache)
        tool.chmod(0o755)

    return str(tool)


@pytest.mark.parametrize("name", ["own:fedavg_pytree", "own:secure", "corpus:fedavg_mlp"])
def test_aarch64_modules_under_qemu_match_xla(name, aarch64_tool, tmp_path, monkeypatch):
    monkeypatch.delenv("FCIR_IREE_AARCH64_RUN_MODULE", raising=False)  # not verified at export
    plan = cases.plan(name)
    out = plan.write(tmp_path / "b", device_runtime="iree", device_targets=["llvm-cpu", *AARCH64])
    entry = json.loads((out / "manifest.json").read_text())["parts"]["client_work"]["iree"]
    fn, specs = lowering.flat_function(plan.code("client_work"))
    exported = iree.cpu_export(fn, specs)
    xla = iree.reference(exported)
    _, args = cases.fn_and_args(name)
    input_sets = [iree.seeded_inputs(exported.in_avals, s) for s in iree.SEEDS]
    input_sets += iree.round_client_inputs(plan, jax.tree_util.tree_leaves(args))[:2]
    monkeypatch.setenv("FCIR_IREE_AARCH64_RUN_MODULE", aarch64_tool)
    load = iree.emulator("aarch64", exported.out_avals)
    assert load is not None
    for target in AARCH64:
        assert entry["modules"][target]["arch"] == "aarch64"
        assert "not run at export" in entry["modules"][target]["verified"]
        run = load((out / entry["modules"][target]["file"]).read_bytes())
        for k, inputs in enumerate(input_sets):
            want = xla(*inputs)
            got = run(*inputs)
            assert len(got) == len(want)
            for j, (g, w) in enumerate(zip(got, want)):
                assert iree.mismatch(g, w) is None, (target, k, j, iree.mismatch(g, w))


def test_export_runs_aarch64_modules_under_qemu_when_set_up(aarch64_tool, tmp_path, monkeypatch):
    monkeypatch.setenv("FCIR_IREE_AARCH64_RUN_MODULE", aarch64_tool)
    out = cases.plan("own:weighted").write(
        tmp_path / "b", device_runtime="iree", device_targets=["llvm-cpu", *AARCH64]
    )
    entry = json.loads((out / "manifest.json").read_text())["parts"]["client_work"]["iree"]
    for target in AARCH64:
        assert entry["modules"][target]["verified"] == (
            f"ran and matched XLA on 2 input set(s) under qemu-aarch64 {aarch64_tool}"
        )


def test_an_aarch64_module_only_qemu_sees_wrong_is_an_export_error(
    aarch64_tool, tmp_path, monkeypatch
):
    """The host module is right, the Android one wrong: only running it under qemu at
    export catches that, and then nothing is written."""
    iree_faults.wrong_at(monkeypatch, set(iree.OPT_LEVELS), targets={"aarch64-linux-android34"})
    monkeypatch.setenv("FCIR_IREE_AARCH64_RUN_MODULE", aarch64_tool)
    with pytest.raises(fcir.ExportError, match="aarch64-linux-android34: input set 0.*max error"):
        cases.plan("own:weighted").write(
            tmp_path / "b",
            device_runtime="iree",
            device_targets=["llvm-cpu", "aarch64-linux-android34"],
        )
    assert not (tmp_path / "b").exists()


@fcir.program(placements={"clients": 3})
def bf16_round(w, x):
    """Clients compute in bfloat16 on bfloat16 values: bf16 in and out of the module."""
    y = fcir.map_fn(lambda w, x: (x * w, jnp.maximum(x, w) - w), (fcir.broadcast(w), x))
    return fcir.reduce_sum(y)


def test_a_bf16_part_runs_under_qemu_at_export_and_matches_xla_within_one_ulp(
    aarch64_tool, tmp_path, monkeypatch
):
    """bf16 values cross the emulator as raw bytes (.npy has no bfloat16), so aarch64
    modules of bf16 parts are run and verified at export like the others."""
    monkeypatch.setenv("FCIR_IREE_AARCH64_RUN_MODULE", aarch64_tool)
    w = jnp.asarray([0.5, -1.25, 3.0, 2.0], jnp.bfloat16)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(3, 5, 4)), jnp.bfloat16)
    plan = production.export(fcir.capture(bf16_round, w, x))
    out = plan.write(tmp_path / "b", device_runtime="iree", device_targets=["llvm-cpu", *AARCH64])
    entry = json.loads((out / "manifest.json").read_text())["parts"]["client_work"]["iree"]
    for target in AARCH64:
        assert entry["modules"][target]["verified"] == (
            f"ran and matched XLA on 2 input set(s) under qemu-aarch64 {aarch64_tool}"
        )
    fn, specs = lowering.flat_function(plan.code("client_work"))
    exported = iree.cpu_export(fn, specs)
    assert {a.dtype.name for a in [*exported.in_avals, *exported.out_avals]} == {"bfloat16"}
    run = iree.emulator("aarch64", exported.out_avals)(
        (out / entry["modules"]["aarch64-linux-android34"]["file"]).read_bytes()
    )
    args = iree.round_client_inputs(plan, [np.asarray(w), np.asarray(x)])[1]  # client 1's
    got, want = run(*args), iree.reference(exported)(*args)
    assert [g.dtype for g in got] == [w.dtype for w in want]
    for g, w_ in zip(got, want):
        assert iree.mismatch(g, w_) is None, iree.mismatch(g, w_)
