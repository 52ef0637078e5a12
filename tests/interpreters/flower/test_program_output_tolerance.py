"""docs/flower.md states how close a whole program's output file is to reference.run
(a scan of rounds: float rounding, not bit for bit); an in-process run holds to it."""

import pathlib
import re

import numpy as np
import pytest

pytest.importorskip("flwr", reason="the Flower tests need flwr (pip install -e '.[flower]')")

from flowerlib import files, inprocess, rounds  # noqa: E402

DOC = pathlib.Path(__file__).resolve().parents[3] / "docs" / "flower.md"


def _documented_tolerance() -> tuple[float, float]:
    text = " ".join(DOC.read_text().split())
    assert "holds exactly the program's results" not in text
    m = re.search(r"the `output` file holds the program's results: `reference\.run` of the "
                  r"whole program to float rounding, within `rtol ([0-9e.-]+)`, "
                  r"`atol ([0-9e.-]+)`", text)
    assert m is not None, "docs/flower.md no longer states the output's tolerance"
    return float(m.group(1)), float(m.group(2))


def test_a_scan_of_rounds_writes_reference_run_within_the_documented_tolerance(tmp_path):
    rtol, atol = _documented_tolerance()
    r = rounds.corpus_round("scan_rounds")
    app = rounds.export(r, tmp_path / "app")
    client = [x for x, c in zip(r.leaves, r.is_client) if c]
    nodes = files.write_nodes(
        tmp_path, [[np.asarray(x)[i] for x in client] for i in range(rounds.NODES)], 40
    )
    inprocess.run(app, nodes, {"output": str(tmp_path / "o.npz")})
    got = files.read_outputs(tmp_path / "o.npz")
    want = rounds.reference_outputs(r)
    assert [(g.dtype, g.shape) for g in got] == [(w.dtype, w.shape) for w in want]
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=rtol, atol=atol)
