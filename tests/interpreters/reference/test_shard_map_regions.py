"""A ``jax.shard_map`` with a collective (``psum`` over a ``model`` axis) inside the
client function, on every backend that runs a module from its IR.

The region of a ``jax.shard_map`` op is typed per shard and its collectives name axes
only the shard_map binds: traced on its own, as regions of other ops are, it failed with
"unbound axis name: model". The base interpreter runs it through ``jax.shard_map`` (so
the reference, the streamed XLA program, a module read back from text and the
production bundle run it) and binds the equation ``jax.jit`` of the program binds.

On one device here; tests/interpreters/reference/test_reference_on_a_mesh.py runs it
over a 2-device ``model`` axis.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from fcir.interpreters import production, reference, xla
from jax.sharding import AxisType, PartitionSpec

import fcir

CLIENTS = 4


def model_parallel_round(devices: int):
    """FedAvg whose client step splits the model over a ``model`` mesh of ``devices``
    with ``jax.shard_map`` and adds the partial products with ``psum``."""
    mesh = jax.make_mesh((devices,), ("model",), axis_types=(AxisType.Auto,))

    def local(w, x):
        def partial_product(w, x):  # rows of w and columns of x per device
            return jax.lax.psum(x @ w, "model")

        h = jax.shard_map(
            partial_product,
            mesh=mesh,
            in_specs=(PartitionSpec("model", None), PartitionSpec(None, "model")),
            out_specs=PartitionSpec(),
        )(w, x)
        return w - 0.1 * x.T @ jnp.tanh(h)

    @fcir.program(placements={"clients": CLIENTS})
    def round_(w, x):
        return fcir.reduce_mean(fcir.map_fn(local, (fcir.broadcast(w), x)))

    return round_


def model_parallel_args():
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.normal(size=(8, 2)), jnp.float32)
    x = jnp.asarray(rng.normal(size=(CLIENTS, 5, 8)), jnp.float32)
    return w, x


def _close(got, want):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)


def test_reference_runs_a_collective_in_a_shard_map_of_the_client_function():
    fn, args = model_parallel_round(1), model_parallel_args()
    _close(reference.run(fcir.capture(fn, *args), *args), jax.jit(fn)(*args))


def test_streaming_runs_a_collective_in_a_shard_map_of_the_client_function():
    fn, args = model_parallel_round(1), model_parallel_args()
    exe = xla.compile(fcir.capture(fn, *args), clients_per_step=2)
    _close(exe(*args), jax.jit(fn)(*args))


def test_a_module_read_back_from_text_rebuilds_the_shard_map_bitwise():
    fn, args = model_parallel_round(1), model_parallel_args()
    module = fcir.parse(str(fcir.capture(fn, *args)))  # rebuilt op by op, not the capture
    got, want = xla.compile(module)(*args), jax.jit(fn)(*args)
    assert np.asarray(got).tobytes() == np.asarray(want).tobytes()


def test_a_production_bundle_runs_a_collective_in_a_shard_map_over_one_device(tmp_path):
    fn, args = model_parallel_round(1), model_parallel_args()
    production.export(fcir.capture(fn, *args)).write(tmp_path)
    _close(production.run_bundle(tmp_path, *args), jax.jit(fn)(*args))
