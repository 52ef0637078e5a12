"""Rounds whose client function lays values out over several devices do not export.

Each part of a production round runs on one device (a client's phone, a server task);
``jax.export`` of a part holding a ``with_sharding_constraint`` over a 4-device mesh is
a function for 4 devices, which ``run_bundle`` could only call with 4 ("Function fn was
exported for 4 devices and is called in a context with 1 devices"). ``export`` refuses
it, naming the op and what to do.

``test_on_8_simulated_devices`` runs the other tests of this file in a fresh process
with 8 simulated CPU devices (tests/eight_devices.py).
"""

from __future__ import annotations

import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from eight_devices import Child
from fcir.interpreters import production, reference
from fcir.interpreters.production import checks
from jax.sharding import AxisType, NamedSharding, PartitionSpec

import fcir

HERE = pathlib.Path(__file__).resolve()
EIGHT_DEVICES = Child(HERE, "FCIR_PRODUCTION_MULTI_DEVICE_TESTS")
on_8_devices = EIGHT_DEVICES.on_8_devices
test_on_8_simulated_devices = EIGHT_DEVICES.waiting_test()
sys.path.insert(0, str(HERE.parent.parent / "reference"))
from test_shard_map_regions import model_parallel_args, model_parallel_round  # noqa: E402


def _constrained_round():
    mesh = jax.make_mesh((4,), ("model",), axis_types=(AxisType.Auto,))

    def local(w, x):
        w = jax.lax.with_sharding_constraint(w, NamedSharding(mesh, PartitionSpec("model")))
        return w - 0.1 * x.T @ (x @ w)

    @fcir.program(placements={"clients": 4})
    def round_(w, x):
        return fcir.reduce_mean(fcir.map_fn(local, (fcir.broadcast(w), x)))

    return round_


@on_8_devices
def test_a_sharding_constraint_over_four_devices_is_refused_at_export():
    fn, args = _constrained_round(), model_parallel_args()
    module = fcir.capture(fn, *args)
    want = jax.jit(fn)(*args)
    np.testing.assert_allclose(reference.run(module, *args), want, rtol=1e-5, atol=1e-6)
    pattern = (
        rf"jax\.sharding_constraint \(op 1/0/0, defining %\d+\): {checks.MULTI_DEVICE}: "
        r".* a mesh of 4 devices.*xla\.compile\(module, mesh=mesh\)"
    )
    with pytest.raises(fcir.ExportError, match=pattern):
        production.export(module)


@on_8_devices
def test_a_shard_map_over_two_devices_is_refused_at_export():
    fn, args = model_parallel_round(2), model_parallel_args()
    with pytest.raises(fcir.ExportError, match=rf"jax\.shard_map .*{checks.MULTI_DEVICE}"):
        production.export(fcir.capture(fn, *args))


@on_8_devices
def test_a_layout_over_one_device_still_exports_and_runs(tmp_path):
    fn, args = model_parallel_round(1), model_parallel_args()
    production.export(fcir.capture(fn, *args)).write(tmp_path)
    got = production.run_bundle(tmp_path, *args)
    np.testing.assert_allclose(got, jax.jit(fn)(*args), rtol=1e-6, atol=1e-6)
    assert jnp.shape(got) == (8, 2)
