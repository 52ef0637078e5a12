"""bench/scale.py --smoke runs end to end (fresh processes, both sides, both forms of
the layer stack, the cost table), so the FAX-scale benchmark cannot rot; and its two
forms of the layer stack are one model."""

from __future__ import annotations

import importlib.util
import os
import sys

import benchrun
import jax
import numpy as np
import pytest
from corpus import transformer

import fcir

pytestmark = pytest.mark.slow  # docs/contributing.md: left out of the fast tier

BENCH = benchrun.ROOT / "bench"


def load_scale():
    """Imports bench/scale.py as the script sees it (bench/ on sys.path)."""
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location("bench_scale", BENCH / "scale.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCH))
    return module


def test_scale_benchmark_smoke_mode(tmp_path):
    out, data = benchrun.run_smoke("scale", tmp_path)
    assert "fcir/drjax total" in out and "2NT/1024" in out
    assert data["smoke"] and data["cores"] == os.cpu_count() and len(data["load_average"]) == 2
    assert set(data["versions"]) >= {"jax", "jaxlib", "numpy", "drjax"}
    # Both forms of the layer stack: a Python loop (unrolled) and a lax.scan.
    assert set(data["lowering"]) == {"unrolled", "scan"}
    assert "layers as a Python loop (unrolled)" in out
    assert "layers as a lax.scan (scan)" in out
    for form in data["lowering"].values():
        samples = form["samples"]
        assert len(samples["fcir"]) == len(samples["drjax"]) == 1
        assert all(s["total_s"] > 0 for side in samples.values() for s in side)
    rows = {row["config"]: row for row in data["cost_table"]}
    assert set(rows) == {"350M", "1B", "8B"}
    for row in rows.values():
        # Tokens and 6NT follow from the sizes; XLA's count of the same round is close
        # to 6NT (attention and the optimizer add, the embedding gather has no matmul).
        assert row["tokens"] == row["clients"] * row["tokens_per_client"]
        assert row["flops_6nd"] == 6 * row["params"] * row["tokens"]
        assert 0.5 < row["flops_xla"] / row["flops_6nd"] < 2.0
    # The paper's figures are 2 N T / 1024 for its nominal sizes.
    assert abs(rows["8B"]["paper_2nd_over_1024"] / rows["8B"]["paper_flops"] - 1) < 1e-3


def test_unrolled_and_scan_forms_compute_the_same_round():
    # The unrolled form is the corpus model with its layers a list of per-layer dicts
    # (transformer.logits_fn's Python loop): from the same weights, the same new
    # weights and loss, to float rounding (its loss negates after the mean).
    scale = load_scale()
    params, tokens = transformer.make_args()
    n = transformer.LAYERS
    per_layer = [jax.tree.map(lambda w, i=i: w[i], params["layers"]) for i in range(n)]
    model = {"heads": transformer.HEADS}
    clients = transformer.NUM_CLIENTS
    scan_round = scale.make_round("scan", clients, model, fcir)
    unrolled_round = scale.make_round("unrolled", clients, model, fcir)
    (scan_params, scan_loss) = jax.jit(scan_round)(params, tokens)
    (new_params, loss) = jax.jit(unrolled_round)({**params, "layers": per_layer}, tokens)
    assert isinstance(new_params["layers"], list) and len(new_params["layers"]) == n
    restacked = jax.tree.map(lambda *ws: np.stack(ws), *new_params["layers"])
    for got, want in zip(
        jax.tree.leaves({**new_params, "layers": restacked}), jax.tree.leaves(scan_params)
    ):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(loss, scan_loss, rtol=1e-6)
    assert not np.allclose(scan_params["layers"]["wqkv"], params["layers"]["wqkv"])
    # The unrolled round keeps its own name in fcir's text.
    module = fcir.capture(unrolled_round, {**params, "layers": per_layer}, tokens)
    assert module.to_text().startswith("fcir.module @fedavg_transformer_unrolled ")
