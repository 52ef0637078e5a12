"""bench/population.py --smoke runs end to end (the ragged population against the
padded layout's bytes, both paddings' rounds timed alternately, the device loop over
dense and ragged populations), so the skewed
population benchmark cannot rot; and its figures are what they say."""

from __future__ import annotations

import benchrun
import pytest

pytestmark = pytest.mark.slow  # docs/contributing.md: left out of the fast tier


def test_population_benchmark_smoke_mode(tmp_path):
    out, data = benchrun.run_smoke("population", tmp_path)
    assert "padded to longest" in out and "round time bucket/population" in out
    sizes, cfg = data["host_bytes"], data["config"]
    example = sizes["bytes_an_example"]
    assert example == 16 * 4 + 4
    n = sizes["clients"]
    assert sizes["ragged"] == sizes["examples"] * example + n * 4 + (n + 1) * 8  # + offsets
    assert sizes["padded"] == sizes["clients"] * (sizes["longest"] * example + 4)
    memory = data["round_memory"]
    assert set(memory["population"]["length"]) == {sizes["longest"]}
    assert max(memory["bucket"]["length"]) <= sizes["longest"]
    for padding in ("population", "bucket"):
        assert len(data["timing"]["round_s"][padding]) == cfg["reps"]
        assert len(data["losses"][padding]) == cfg["rounds"]
        lengths, cohort = memory[padding]["length"], memory[padding]["cohort_bytes"]
        assert cohort == [cfg["cohort"] * (n * example + 4) for n in lengths]
    for case in ("cifar", "lognormal"):
        times = data["device_loop"][case]["round_s"]
        assert {k: len(v) for k, v in times.items()} == {"dense": 1, "ragged": 1}
