"""What the Flower export and server app refuse: replacing a directory or file the
export did not write, and a Poisson-sampled ddp round before round one."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fcir

N = 4
HIER = {"silos": 2, "clients": 2}
W = jnp.asarray([0.5, -1.0, 2.0], jnp.float32)
KEY = jax.random.key(3)
X = jnp.asarray(np.random.default_rng(0).normal(size=(N, 3)), jnp.float32)


def private(fn, placements=HIER):
    return fcir.program(placements=placements, private=True)(fn)


def updates(w, x):
    return fcir.map_fn(lambda w, x: x - w, (fcir.broadcast(w), x))


@fcir.program(placements={"clients": 3})
def _mean_update(w, x):
    return fcir.reduce_mean(fcir.map_fn(lambda w, x: x - w, (fcir.broadcast(w), x)))


# --- `fcir export --target flower IN -o DIR` replaced whatever DIR was ----------------------


def test_flower_export_refuses_to_replace_a_directory_or_file_it_did_not_write(tmp_path):
    from fcir.interpreters import flower

    module = fcir.capture(_mean_update, jnp.zeros(2), jnp.ones((3, 2)))
    project = tmp_path / "project"  # e.g. `-o .` in the user's project
    project.mkdir()
    (project / "train.py").write_text("precious\n")
    ir_file = tmp_path / "round.fcir"  # e.g. `-o round.fcir`, the input itself
    ir_file.write_text(module.to_text())
    for target in (project, ir_file):
        with pytest.raises(fcir.ExportError, match="give -o a new or empty directory"):
            flower.export(module, target)
    assert (project / "train.py").read_text() == "precious\n"
    assert fcir.parse(ir_file.read_text()).to_text() == module.to_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["project", "round.fcir"]  # no leftovers
    # A new directory, an empty one, and an app written before are (re)written.
    (tmp_path / "empty").mkdir()
    for target in (tmp_path / "app", tmp_path / "empty", tmp_path / "app"):
        assert (flower.export(module, target) / "fcir_app" / "plan.json").is_file()


def test_a_flower_server_app_refuses_a_poisson_sampled_ddp_round_before_round_one():
    # With fraction < 1 a private app samples Poisson; for a ddp round its progress line
    # would otherwise claim every client's noise share. It now fails at start, saying why.
    pytest.importorskip("flwr", reason="the ServerApp needs flwr")
    import types

    from fcir.interpreters.flower.app import runtime, server_app

    def ddp_round(w, keys, x):
        return w + fcir.ddp_mean(updates(w, x), 1.0, 1.0, keys, bits=16)

    m = fcir.capture(private(ddp_round, {"clients": N}), W, jax.random.split(KEY, N), X)
    plan = {"privacy": {"ir": m.to_text(), "delta": 1e-5}}
    cfg = types.SimpleNamespace(fraction=0.5, poisson=True, clients=0, max_epsilon=None)
    with pytest.raises(runtime.AppError, match=r"^Poisson sampling q=0.5: .*sampled at rate 0.5"):
        server_app.Accounting(plan, cfg)
    every = types.SimpleNamespace(fraction=1.0, poisson=False, clients=0, max_epsilon=None)
    line = server_app.Accounting(plan, every).line(2)
    assert line.startswith(f"epsilon={fcir.privacy.epsilon(m, 2, 1e-5):.4g} after 2 round(s)")
