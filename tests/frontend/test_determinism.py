"""Guarantee 4: the same program captured in two fresh processes with different
``PYTHONHASHSEED`` gives byte-identical canonical text and serialized protobuf."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow  # docs/contributing.md: left out of the fast tier

# Run in a fresh interpreter: a program with dicts, sets of names, pytree classes, regions,
# PRNG keys, bf16, large constants, a hierarchy, and its gradient.
CAPTURE_SCRIPT = textwrap.dedent(
    """
    import collections, dataclasses, pathlib, sys
    import jax, jax.numpy as jnp, numpy as np
    import fcir

    Batch = collections.namedtuple("Batch", ["x", "y"])

    @jax.tree_util.register_dataclass
    @dataclasses.dataclass
    class Params:
        w: jax.Array
        b: jax.Array

    TABLE = np.linspace(-1, 1, 64, dtype=np.float32).reshape(8, 8)

    @fcir.program(placements={"clients": 3})
    def round_fn(params, batch, key):
        def local(p, b, k):
            noise = jax.random.normal(jax.random.fold_in(k, 1), p.w.shape, jnp.bfloat16)
            h = jnp.tanh(b.x @ TABLE) @ (p.w + noise.astype(jnp.float32)) + p.b
            loss = jnp.mean((h - b.y) ** 2)
            h = jax.lax.cond(loss > 1, lambda: h * 0.5, lambda: h)
            c, _ = jax.lax.scan(lambda c, r: (c + r.sum(), None), 0.0, h)
            stats = {"zeta": c, "alpha": loss, "mid": (h > 0).sum(), "beta": jnp.int8(3)}
            return Params(p.w * 0.9, p.b - c * 1e-3), stats

        p, stats = fcir.map_fn(local, (fcir.broadcast(params), batch, fcir.broadcast(key)))
        return {"params": fcir.reduce_mean(p), "stats": fcir.reduce_sum(stats),
                "worst": fcir.reduce_max(stats["alpha"])}

    @fcir.program(placements={"silos": 2, "clients": 2})
    def hierarchical(model, data):
        def silo(m, d):
            u = fcir.map_fn(lambda a, b: {"s": a * b.sum(), "t": b.max()}, (fcir.broadcast(m), d))
            return fcir.reduce_mean(u)
        return fcir.reduce_sum(fcir.map_fn(silo, (fcir.broadcast(model), data)))

    def loss(params, batch, key):
        out = round_fn(params, batch, key)
        return jnp.sum(out["params"].w ** 2) + out["stats"]["alpha"]

    params = Params(jnp.full((8, 1), 0.1), jnp.zeros((1,)))
    batch = Batch(jnp.ones((3, 4, 8)), jnp.zeros((3, 4, 1)))
    key = jax.random.key(0)
    modules = [
        fcir.capture(round_fn, params, batch, key),
        fcir.capture(hierarchical, jnp.ones(2), jnp.ones((2, 2, 3))),
        fcir.capture(jax.grad(loss), params, batch, key, name="grad_round"),
        fcir.capture(round_fn, params, batch, key, locations=True),
    ]
    out = pathlib.Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    for i, m in enumerate(modules):
        (out / f"{i}.fcir").write_text(m.to_text())
        (out / f"{i}.full.fcir").write_text(m.to_text(full_constants=True, locations=True))
        (out / f"{i}.pb").write_bytes(m.serialize())
    """
)


def test_capture_is_identical_across_processes_and_hash_seeds(tmp_path: pathlib.Path):
    script = tmp_path / "capture_script.py"
    script.write_text(CAPTURE_SCRIPT)
    procs = []
    for seed in ("0", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed, JAX_PLATFORMS="cpu")
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script), str(tmp_path / f"seed{seed}")],
                env=env,
                cwd=tmp_path,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
    a, b = tmp_path / "seed0", tmp_path / "seed12345"
    names = sorted(f.name for f in a.iterdir())
    assert len(names) == 12 and names == sorted(f.name for f in b.iterdir())
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    # The files are real programs, not empty output.
    text = (a / "0.fcir").read_text()
    assert "fed.map" in text and "jax.cond" in text and 'sha256"' in text
    assert "loc(" not in text and 'loc("capture_script.py:' in (a / "3.full.fcir").read_text()
