"""One process of a FedAvg round compiled by the XLA backend on a global 8-device mesh.

    python fedavg_worker.py --process-id I --num-processes N --local-devices D \\
        [--coordinator HOST:PORT] --out OUT.npz

Every process runs the same program on the same (deterministic) arguments; with
``--num-processes 2 --local-devices 4`` the 16 clients are sharded over 8 devices in two
processes that talk through gloo, with ``--num-processes 1 --local-devices 8`` over 8
devices of one process. Process 0 writes the round's outputs (gathered to every
process) to ``OUT.npz`` with the output leaves as ``arr_0, arr_1, ...`` and a few facts
about the run in ``meta``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

NUM_CLIENTS = 16
STEPS, BATCH, D_IN, HIDDEN, D_OUT = 2, 4, 8, 16, 4
LR = 0.05


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--process-id", type=int, default=0)
    p.add_argument("--num-processes", type=int, default=1)
    p.add_argument("--local-devices", type=int, default=8)
    p.add_argument("--coordinator", default=None, help="HOST:PORT of process 0")
    p.add_argument("--timeout", type=int, default=40, help="seconds to wait for peers")
    p.add_argument("--out", required=True)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    # Simulated CPU devices must be requested before jax is imported.
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "")
        + f" --xla_force_host_platform_device_count={args.local_devices}"
    )
    import jax

    if args.num_processes > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            args.coordinator,
            num_processes=args.num_processes,
            process_id=args.process_id,
            initialization_timeout=args.timeout,
        )
    import jax.numpy as jnp
    import numpy as np
    from fcir.interpreters import xla
    from jax.experimental import multihost_utils

    import fcir

    def mse(params, x, y):
        h = jax.nn.relu(x @ params["w1"] + params["b1"])
        return jnp.mean(jnp.square(h @ params["w2"] + params["b2"] - y))

    def client_update(params, x, y):
        def step(p, batch):
            loss, grads = jax.value_and_grad(mse)(p, *batch)
            return jax.tree.map(lambda w, g: w - LR * g, p, grads), loss

        trained, losses = jax.lax.scan(step, params, (x, y))
        return jax.tree.map(jnp.subtract, trained, params), jnp.mean(losses)

    @fcir.program(placements={"clients": NUM_CLIENTS})
    def fedavg_round(params, x, y):
        deltas, losses = fcir.map_fn(client_update, (fcir.broadcast(params), x, y))
        new = jax.tree.map(jnp.add, params, fcir.reduce_mean(deltas))
        return new, fcir.reduce_mean(losses)

    rng = np.random.default_rng(0)
    params = {
        "w1": rng.normal(size=(D_IN, HIDDEN)).astype(np.float32) * np.float32(0.3),
        "b1": np.zeros(HIDDEN, np.float32),
        "w2": rng.normal(size=(HIDDEN, D_OUT)).astype(np.float32) * np.float32(0.3),
        "b2": np.zeros(D_OUT, np.float32),
    }
    x = rng.normal(size=(NUM_CLIENTS, STEPS, BATCH, D_IN)).astype(np.float32)
    y = rng.normal(size=(NUM_CLIENTS, STEPS, BATCH, D_OUT)).astype(np.float32)

    mesh = jax.make_mesh(
        (jax.device_count(),), ("clients",), axis_types=(jax.sharding.AxisType.Auto,)
    )
    module = fcir.capture(fedavg_round, params, x, y)
    exe = xla.compile(module, mesh=mesh)
    start = time.perf_counter()
    out = exe(params, x, y)
    jax.block_until_ready(out)
    seconds = time.perf_counter() - start
    x_sharding = exe.in_specs[4].sharding
    leaves = [
        np.asarray(multihost_utils.process_allgather(v, tiled=True)) for v in jax.tree.leaves(out)
    ]
    meta = {
        "process_count": jax.process_count(),
        "device_count": jax.device_count(),
        "local_device_count": jax.local_device_count(),
        "client_data_spec": str(x_sharding.spec),
        "client_shards_here": len(
            x_sharding.addressable_devices_indices_map((NUM_CLIENTS, STEPS, BATCH, D_IN))
        ),
        "first_call_seconds": seconds,
    }
    if args.process_id == 0:
        np.savez(args.out, *leaves, meta=np.asarray(json.dumps(meta)))
    if args.num_processes > 1:
        multihost_utils.sync_global_devices("fcir fedavg worker done")
        jax.distributed.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
