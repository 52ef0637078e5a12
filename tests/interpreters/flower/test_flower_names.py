"""An exported round's outputs carry the program's own names (dict keys, namedtuple
fields) into the ServerApp's progress line, its metrics file and the MetricRecord in
its context state; outputs without a name keep their position (``arr_4``,
test_flower_app.py)."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
from flowerlib import inprocess

import fcir

pytest.importorskip("flwr", reason="the Flower tests need flwr (pip install 'fcir[flower]')")

from fcir.interpreters import flower  # noqa: E402


@fcir.program(placements={"clients": 2}, client_data=("x",))
def named_round(params, x):
    def local(p, x):
        new = {"w": p["w"] - 0.5 * jnp.mean(x, 0)}
        return new, jnp.sum(new["w"] ** 2)

    new, loss = fcir.map_fn(local, (fcir.broadcast(params), x))
    return {"params": fcir.reduce_mean(new), "train_loss": fcir.reduce_mean(loss)}


def test_an_exported_round_logs_and_records_its_metrics_by_the_program_s_names(tmp_path, capsys):
    params = {"w": np.ones(2, np.float32)}
    x = np.arange(2 * 3 * 2, dtype=np.float32).reshape(2, 3, 2) / 10
    module = fcir.capture(named_round, params, x)
    app = flower.export(module, tmp_path / "app", inputs=[params["w"]])
    nodes = {}
    for i in range(2):
        np.savez(tmp_path / f"n{i}.npz", x[i])
        nodes[11 + i] = {"partition-id": i, "data-path": str(tmp_path / f"n{i}.npz")}
    metrics = tmp_path / "metrics.json"
    grid = inprocess.run(app, nodes, {"num-server-rounds": 2, "state": "0=0", "metrics-file": str(metrics)})
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if "[fcir] round" in line]
    assert len(lines) == 2 and all(" train_loss=" in line for line in lines)
    assert "arr_1=" not in out
    saved = json.loads(metrics.read_text())
    assert sorted(saved) == ["round", "train_loss"]
    record = grid.context.state["fcir.metrics"]
    assert np.allclose(record["train_loss"], saved["train_loss"])
    assert saved["train_loss"][1] < saved["train_loss"][0]


def evaluate_member(params, x):
    return {"test_loss": jnp.sum((params["w"] - jnp.mean(x, 0)) ** 2)}


@fcir.program(placements={"clients": 2}, client_data=("x",), evaluate=evaluate_member)
def evaluated_round(params, x):
    return named_round.__wrapped__(params, x)


def test_an_exported_round_runs_its_evaluation_in_flower_s_evaluate_stage(tmp_path, capsys):
    """The program's evaluation after each round on the nodes' evaluation data, by name
    on the progress line and in the metrics, the same as the evaluation program on the
    reference backend for the round's outputs."""
    from fcir.interpreters import reference

    params = {"w": np.ones(2, np.float32)}
    x = np.arange(12, dtype=np.float32).reshape(2, 3, 2) / 10
    x_test = np.arange(16, dtype=np.float32).reshape(2, 4, 2)[:, ::-1] / 7
    module = fcir.capture(evaluated_round, params, x)
    ev = fcir.capture(fcir.evaluation(evaluated_round), params, x_test)
    app = flower.export(module, tmp_path / "app", inputs=[params["w"]], evaluation=ev)
    nodes = {}
    for i in range(2):
        np.savez(tmp_path / f"n{i}.npz", x[i])
        np.savez(tmp_path / f"t{i}.npz", x_test[i])
        nodes[11 + i] = {"partition-id": i, "data-path": str(tmp_path / f"n{i}.npz"),
                         "eval-data-path": str(tmp_path / f"t{i}.npz")}
    metrics, out = tmp_path / "metrics.json", tmp_path / "out.npz"
    inprocess.run(app, nodes, {"num-server-rounds": 2, "state": "0=0", "metrics-file": str(metrics),
                               "output": str(out)})
    lines = [line for line in capsys.readouterr().out.splitlines() if "[fcir] round" in line]
    assert all("evaluate: 2/2 clients replied test_loss=" in line for line in lines), lines
    saved = json.loads(metrics.read_text())
    assert sorted(saved) == ["round", "test_loss", "train_loss"]
    with np.load(out) as f:
        final = {"w": f["arr_0"]}
    want = float(reference.run(ev, final, x_test)["test_loss"])
    assert np.isclose(saved["test_loss"][1], want, rtol=1e-6)


def test_fcir_export_takes_the_evaluation_the_program_declares(tmp_path, capsys):
    import textwrap

    from fcir.cli import main

    (tmp_path / "r.py").write_text(textwrap.dedent("""
        import jax.numpy as jnp
        import fcir

        def ev(w, x):
            return {"test_loss": jnp.sum((w - jnp.mean(x, 0)) ** 2)}

        @fcir.program(placements={"clients": 2}, client_data=("x",), evaluate=ev)
        def r(w, x):
            return {"w": fcir.reduce_mean(fcir.map_fn(lambda w, x: w - jnp.mean(x, 0),
                                                      (fcir.broadcast(w), x)))}
    """))
    assert main(["export", "--target", "flower", f"{tmp_path / 'r.py'}:r", "--args", "f32[2]",
                 "f32[2,3,2]", "-o", str(tmp_path / "app")]) == 0, capsys.readouterr().err
    plan = json.loads((tmp_path / "app/fcir_app/plan.json").read_text())
    assert [o["name"] for o in plan["evaluate"]["outputs"]] == ["test_loss"]
    assert [s["shape"] for s in plan["evaluate"]["client_inputs"]] == [[3, 2]]
