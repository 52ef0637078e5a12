"""The cost report's "flops accounted for" never exceeds the HLO's count: work in a
client's function that no member's data reaches (a 1 / batch_size) runs once in the
vmapped program, and is counted once."""

import pathlib

import jax
import jax.numpy as jnp
import pytest
from fcir.interpreters import xla

import fcir
from fcir.frontend.loading import example_args, load_function

ROOT = pathlib.Path(__file__).resolve().parents[3]


@fcir.program(placements={"clients": 8})
def _round(w, x, y):
    def local(w, x, y):
        def step(w, xy):
            x, y = xy
            grad = jax.grad(lambda w: jnp.mean((x @ w - y) ** 2))(w)
            return w - (0.5 / 8.0) * grad, None  # constants alone: once in the program

        return jax.lax.scan(step, w, (x, y))[0]

    return fcir.reduce_mean(fcir.map_fn(local, (fcir.broadcast(w), x, y)))


def test_member_independent_work_is_counted_once_as_the_program_runs_it():
    args = jnp.zeros((16, 1)), jnp.ones((8, 4, 8, 16)), jnp.ones((8, 4, 8, 1))
    report = xla.compile(fcir.capture(_round, *args)).cost()
    assert report["flops_accounted"] == report["hlo_flops"]


@pytest.mark.parametrize("target", ["examples/fedavg.py:fedavg_round"])
def test_the_readme_examples_cost_accounts_for_the_hlo_exactly(target):
    fn, module = load_function(str(ROOT / target))
    args = example_args(target.rpartition(":")[2], module, fn)
    report = xla.compile(fcir.capture(fn, *args)).cost()
    assert report["flops_accounted"] == report["hlo_flops"]
    line = next(x for x in xla.format_cost(report).splitlines() if "accounted" in x)
    n = f"{report['hlo_flops']:,.0f}"
    assert f"flops accounted for: {n} of {n} in the unoptimized HLO" in line
