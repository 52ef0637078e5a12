"""--device-runtime iree for production bundles: client work compiled by IREE at export,
verified against XLA (a module that disagrees never gets written), run by run-plan."""

from __future__ import annotations

import json
import pathlib

import jax
import ml_dtypes
import numpy as np
import pytest
from fcir.interpreters import production
from productionlib import cases, iree_faults

import fcir
from fcir.cli import main

pytest.importorskip("iree.compiler", reason="needs iree-base-compiler (pip install 'fcir[iree]')")
pytest.importorskip("iree.runtime", reason="needs iree-base-runtime (pip install 'fcir[iree]')")

from fcir.interpreters.production import iree  # noqa: E402

pytestmark = pytest.mark.slow  # docs/contributing.md: left out of the fast tier

ROUNDS_PY = pathlib.Path(__file__).parents[2] / "productionlib" / "rounds.py"
# Small rounds covering float training, weights, integer secure sums and booleans.
ROUNDS = ("own:fedavg_pytree", "own:weighted", "own:secure", "own:minmax", "own:server_side")


def _leaves(name):
    _, args = cases.fn_and_args(name)
    return jax.tree_util.tree_leaves(args)


def _write(name, tmp_path, **kw):
    return cases.plan(name).write(tmp_path / "b", device_runtime="iree", **kw)


@pytest.mark.parametrize("name", ROUNDS)
def test_iree_bundle_runs_client_work_through_iree_to_reference_values(name, tmp_path, monkeypatch):
    out = _write(name, tmp_path)
    manifest = json.loads((out / "manifest.json").read_text())
    entry = manifest["parts"]["client_work"]["iree"]
    assert manifest["device_runtime"] == "iree"
    assert entry["entry"] == "jit_fn.main"
    assert entry["modules"]["llvm-cpu"]["verified"].startswith("ran and matched XLA")
    bundle = production.Bundle(out)
    # Client work must not touch its jax.export artifact on the IREE path.
    compiled = bundle.compiled
    monkeypatch.setattr(
        bundle, "compiled", lambda p: pytest.fail(p) if p == "client_work" else compiled(p)
    )
    got = bundle.run_flat(_leaves(name), device_runtime="iree")
    module = cases.captured(name)
    got = fcir.frontend.pytrees.unflatten_results(module.main, got)
    cases.assert_close(got, cases.expected(name), name=name)


def test_iree_modules_are_compiled_for_cpu_only_without_the_platform_case(tmp_path):
    """The module's main takes exactly the part's leaves: no leading platform index (the
    multi-platform stablehlo.case export that IREE miscompiles)."""
    plan = cases.plan("own:fedavg_pytree")
    fn, specs = production.lowering.flat_function(plan.code("client_work"))
    exported = iree.cpu_export(fn, specs)
    assert exported.platforms == ("cpu",)
    assert "stablehlo.case" not in exported.mlir_module()
    assert len(exported.in_avals) == len(specs)


def test_a_module_that_disagrees_with_xla_is_an_export_error_and_nothing_is_written(
    tmp_path, monkeypatch
):
    seen = iree_faults.wrong_at(monkeypatch, set(iree.OPT_LEVELS))
    with pytest.raises(fcir.ExportError) as e:
        _write("own:fedavg_pytree", tmp_path)
    msg = str(e.value)
    assert "client_work" in msg and "--device-runtime jax" in msg
    assert all(f"{level}:" in msg for level in iree.OPT_LEVELS)  # every level was tried
    assert "max error" in msg and "allowed rtol 1e-05" in msg  # wrong numbers, not a crash
    assert seen == list(iree.OPT_LEVELS)
    assert not (tmp_path / "b").exists()


def test_a_wrong_level_is_skipped_for_the_next_that_matches(tmp_path, monkeypatch):
    iree_faults.wrong_at(monkeypatch, {"O2"})
    out = _write("own:fedavg_pytree", tmp_path)
    entry = json.loads((out / "manifest.json").read_text())["parts"]["client_work"]["iree"]
    assert entry["opt_level"] == "O3"


def test_a_wrong_reference_also_fails_verification(tmp_path, monkeypatch):
    """The verifier compares against XLA: perturb XLA's answer and the export refuses."""
    original = iree.reference

    def shifted(exported):
        ref = original(exported)
        return lambda *a: [
            y + np.asarray(1e-3, y.dtype) if y.dtype.kind == "f" else y for y in ref(*a)
        ]

    monkeypatch.setattr(iree, "reference", shifted)
    with pytest.raises(fcir.ExportError, match="client_work.*--device-runtime jax"):
        _write("own:fedavg_pytree", tmp_path)


def test_a_compile_failure_at_every_level_is_an_export_error(tmp_path, monkeypatch):
    original = iree.compile_module
    monkeypatch.setattr(
        iree, "compile_module", lambda s, t, lv, extra_flags=(): original(b"garbage", t, lv)
    )
    with pytest.raises(fcir.ExportError, match="does not compile.*--device-runtime jax"):
        _write("own:weighted", tmp_path)


def test_the_round_inputs_are_verified_too(tmp_path, monkeypatch):
    name = "own:fedavg_pytree"
    out = _write(name, tmp_path, inputs=_leaves(name))
    entry = json.loads((out / "manifest.json").read_text())["parts"]["client_work"]["iree"]
    assert entry["input_sets"] == len(iree.SEEDS) + cases.rounds.CLIENTS


def test_round_inputs_of_the_wrong_type_are_an_export_error(tmp_path):
    leaves = _leaves("own:fedavg_pytree")
    leaves[0] = np.asarray(leaves[0]).astype(np.float16)
    with pytest.raises(fcir.ExportError, match="--inputs arr_0"):
        _write("own:fedavg_pytree", tmp_path, inputs=leaves)


def test_unknown_device_target_is_an_export_error(tmp_path):
    with pytest.raises(fcir.ExportError, match="--device-target 'riscv'"):
        _write("own:weighted", tmp_path, device_targets=["riscv"])


def test_cross_targets_are_compiled_one_module_each(tmp_path):
    targets = ["llvm-cpu", "aarch64-linux-android34", "aarch64-apple-ios17"]
    out = _write("own:weighted", tmp_path, device_targets=targets)
    entry = json.loads((out / "manifest.json").read_text())["parts"]["client_work"]["iree"]
    assert sorted(entry["modules"]) == sorted(targets)
    for t in targets:
        data = (out / entry["modules"][t]["file"]).read_bytes()
        assert data[:2] == b"PK" and b"module.fb" in data[:64]  # a vmfb: zip around a flatbuffer
    assert entry["modules"]["aarch64-apple-ios17"]["arch"] == "aarch64"
    a = (out / entry["modules"]["aarch64-linux-android34"]["file"]).read_bytes()
    h = (out / entry["modules"]["llvm-cpu"]["file"]).read_bytes()
    assert a != h


def test_run_plan_iree_on_a_jax_bundle_says_to_export_with_iree():
    bundle = production.Bundle(cases.bundle("own:weighted"))
    with pytest.raises(production.BundleError, match="--device-runtime iree"):
        bundle.run_flat(_leaves("own:weighted"), device_runtime="iree")


# --- the tolerances -----------------------------------------------------------------------


def test_integers_must_match_exactly():
    assert iree.mismatch(np.array([1, 2], np.int32), np.array([1, 2], np.int32)) is None
    assert "differ" in iree.mismatch(np.array([1, 3], np.int32), np.array([1, 2], np.int32))
    assert iree.mismatch(np.array([True]), np.array([False]))


def test_f32_within_rtol_1e5_of_the_result_scale():
    want = np.array([1000.0, 1.0, 0.0], np.float32)
    assert iree.mismatch(want * np.float32(1 + 5e-6), want) is None
    assert iree.mismatch(want + np.float32(5e-3), want) is None  # atol = 1e-5 * 1000
    assert iree.mismatch(want * np.float32(1 + 1e-4), want)
    assert iree.mismatch(np.array([np.nan], np.float32), np.array([1.0], np.float32))
    assert iree.mismatch(np.array([np.nan], np.float32), np.array([np.nan], np.float32)) is None
    assert iree.mismatch(want.astype(np.float64), want)  # dtype differs


def test_bf16_within_one_ulp():
    bf = ml_dtypes.bfloat16
    x = np.array([1.0, -1.0, 0.0, 3.0e5], bf)
    bits = x.view(np.uint16)
    up1 = np.where(x.astype(np.float32) < 0, bits - 1, bits + 1).astype(np.uint16).view(bf)
    up2 = np.where(x.astype(np.float32) < 0, bits - 2, bits + 2).astype(np.uint16).view(bf)
    assert iree.mismatch(up1, x) is None
    assert "2 ulp" in iree.mismatch(up2, x)
    # -0.0 and the smallest positive bf16 are one ulp apart across zero
    assert iree.mismatch(np.array([-0.0], bf), np.array([0.0], bf)) is None


# --- the command line ---------------------------------------------------------------------


def _fcir(*args):
    return main([str(a) for a in args])


def test_cli_export_and_run_plan_with_iree(tmp_path, capsys):
    name = "fedavg_pytree"
    leaves = _leaves(f"own:{name}")
    np.savez(tmp_path / "in.npz", *[np.asarray(x) for x in leaves])
    out = tmp_path / "b"
    rc = _fcir(
        "export",
        "--target",
        "production",
        f"{ROUNDS_PY}:{name}",
        "-o",
        out,
        "--device-runtime",
        "iree",
        "--inputs",
        tmp_path / "in.npz",
    )
    assert rc == 0, capsys.readouterr().err
    assert "client_work as IREE modules" in capsys.readouterr().out
    for runtime in ("iree", "jax"):
        rc = _fcir(
            "run-plan",
            out,
            "--inputs",
            tmp_path / "in.npz",
            "-o",
            tmp_path / f"{runtime}.npz",
            "--device-runtime",
            runtime,
        )
        assert rc == 0, capsys.readouterr().err
    a, b = np.load(tmp_path / "iree.npz"), np.load(tmp_path / "jax.npz")
    assert sorted(a.files) == sorted(b.files)
    for k in a.files:
        np.testing.assert_allclose(a[k], b[k], rtol=1e-5, atol=1e-6)


def test_cli_device_target_needs_iree(tmp_path, capsys):
    rc = _fcir(
        "export",
        "--target",
        "production",
        f"{ROUNDS_PY}:weighted",
        "-o",
        tmp_path / "b",
        "--device-target",
        "x86_64-linux",
    )
    err = capsys.readouterr().err
    assert rc != 0
    assert "--device-target goes with --device-runtime iree" in err
    assert "Traceback" not in err


def test_cli_device_targets_are_the_exporters_and_unknown_ones_are_usage_errors(tmp_path):
    from fcir.interpreters.production import cli

    assert cli.DEVICE_TARGETS == iree.TARGETS
    with pytest.raises(SystemExit) as e:
        _fcir(
            "export",
            "--target",
            "production",
            f"{ROUNDS_PY}:weighted",
            "-o",
            tmp_path / "b",
            "--device-runtime",
            "iree",
            "--device-target",
            "riscv64",
        )
    assert e.value.code == 2
