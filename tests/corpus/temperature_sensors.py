"""DrJAX's README example: which fraction of sensor readings lies above a threshold.

The server broadcasts a threshold; each client computes the fraction of its own
readings above it; the server averages the fractions. Exercises a scalar broadcast,
a comparison and bool->float cast in the client, and ``reduce_mean``.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

import fcir

from .case import Case

NUM_CLIENTS = 8
READINGS = 16
DRJAX_EXPRESSIBLE = True


def fraction_above(threshold, readings):
    return jnp.mean((readings > threshold).astype(jnp.float32))


def build(api=fcir):
    @api.program(placements={"clients": NUM_CLIENTS})
    def temperature_sensors(threshold, readings):
        at_clients = api.broadcast(threshold)
        fractions = api.map_fn(fraction_above, (at_clients, readings))
        return api.reduce_mean(fractions)

    return temperature_sensors


def make_args():
    rng = np.random.default_rng(1)
    readings = rng.normal(20.0, 5.0, (NUM_CLIENTS, READINGS))
    return jnp.float32(21.5), jnp.asarray(readings, jnp.float32)


def oracle(threshold, readings):
    readings, threshold = np.asarray(readings), np.float32(threshold)
    total = np.float32(0)
    for i in range(NUM_CLIENTS):
        above = sum(1 for r in readings[i] if r > threshold)
        total += np.float32(above) / np.float32(READINGS)
    return jnp.asarray(total / np.float32(NUM_CLIENTS))


CASE = Case(
    name="temperature_sensors",
    fn=build(),
    make_args=make_args,
    oracle=oracle,
    grad_argnums=None,  # a step function of the threshold: its gradient is identically 0
)
