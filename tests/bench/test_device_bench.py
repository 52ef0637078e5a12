"""bench/device.sh --smoke runs on the CPU at tiny sizes (the CIFAR-10 FedAvg table with
clients_per_step=auto against DrJAX, and the FAX-scale round's cohorts at a tiny model
against the hand-written streamed round and DrJAX), so the accelerator script is ready
whenever a device is lent; and what the benchmarks record for a system that runs out of
the device's memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import benchrun
import jax
import pytest

from fcir.errors import InterpreterError

sys.path.insert(0, str(benchrun.ROOT / "bench"))
import _record  # noqa: E402  (bench/)

TPU_OOM = (
    "RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory "
    "space hbm. Used 20.27G of 15.75G hbm. Exceeded hbm capacity by 4.52G."
)


@pytest.mark.slow  # docs/contributing.md: left out of the fast tier
def test_device_script_smoke_mode(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["XLA_FLAGS"] = benchrun.CHEAP_CODEGEN  # LLVM at -O0, as the other smoke runs
    env["OUT_DIR"] = str(tmp_path)
    env["PYTHON"] = sys.executable  # this test's Python, whatever python is on PATH (CI's leg 1)
    result = subprocess.run(["bash", str(benchrun.ROOT / "bench" / "device.sh"), "--smoke"],
                            capture_output=True, text=True, timeout=1200, check=False,
                            env=env)  # fmt: skip
    out = result.stdout
    assert result.returncode == 0, out[-3000:] + result.stderr[-3000:]
    assert "failed" not in out and "cut short" not in out
    assert out.count("fcir/drjax") == 2 and "rounds/hour" in out and "fcir k=auto (" in out
    assert out.count("fcir/hand-written rounds/s") == 2 and "TFLOP/s" in out
    (sim,) = tmp_path.glob("simulate-smoke-*.json")
    (fax,) = tmp_path.glob("fax_round-smoke-*.json")
    sim = json.loads(sim.read_text())
    assert sim["systems"] == ["fcir", "fcir-k", "drjax"] and sim["out_of_memory"] == {}
    assert sim["fcir-k streaming"]["mode"] == "auto"
    cohorts = json.loads(fax.read_text())["cohorts"]
    assert list(cohorts) == ["1", "2"]
    for c in cohorts.values():
        fcir = c["programs"]["fcir"]
        assert fcir["status"] == "ok" and fcir["flops_per_call"] > 0 and fcir["temp_bytes"] > 0
        assert c["ratios"]["fcir/hand-written"]["median"] > 0
    assert cohorts["1"]["programs"]["fcir"]["streaming"]["mode"] == "auto"
    assert cohorts["2"]["programs"]["fcir"]["streaming"]["mode"] == "fixed"


def test_a_compile_that_runs_out_of_memory_is_recorded_with_what_it_asked_for():
    try:
        try:
            raise jax.errors.JaxRuntimeError(TPU_OOM)
        except RuntimeError as e:  # as xla.compile wraps it
            raise InterpreterError("@round: XLA could not compile the program") from e
    except InterpreterError as wrapped:
        record = _record.out_of_memory(wrapped)
    assert record["status"] == "out of memory"
    assert record["asked_bytes"] == int(20.27 * 2**30)
    assert _record.describe(record) == "out of memory (20.27 GiB asked)"
    assert _record.out_of_memory(jax.errors.JaxRuntimeError("INTERNAL: broken")) is None


def test_fax_round_records_a_program_that_does_not_fit_and_goes_on():
    import fax_round

    def does_not_fit():
        raise jax.errors.JaxRuntimeError(TPU_OOM)

    compiled, record = fax_round.compile_or_oom(does_not_fit)
    assert compiled is None and record["status"] == "out of memory"
    with pytest.raises(ValueError):
        fax_round.compile_or_oom(lambda: (_ for _ in ()).throw(ValueError("not memory")))
