"""``reduce_mean`` of int32 and bool values, whose result is float32.

Clients count labels per class (int32) and report whether they saw any flagged
example (bool); the server averages both, plus the raw int32 labels straight from
the program argument. Five clients, so the division is not by a power of two.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

import fcir

from .case import Case

NUM_CLIENTS = 5
EXAMPLES = 12
CLASSES = 4


def client_counts(labels, flags):
    per_class = jnp.sum(labels[:, None] == jnp.arange(CLASSES), axis=0, dtype=jnp.int32)
    return per_class, jnp.any(flags)


@fcir.program(placements={"clients": NUM_CLIENTS})
def int_mean(labels, flags):
    per_class, any_flag = fcir.map_fn(client_counts, (labels, flags))
    return {
        "class_counts": fcir.reduce_mean(per_class),
        "flagged_fraction": fcir.reduce_mean(any_flag),
        "label_mean": fcir.reduce_mean(labels),
    }


def make_args():
    rng = np.random.default_rng(11)
    labels = rng.integers(0, CLASSES, (NUM_CLIENTS, EXAMPLES))
    flags = rng.random((NUM_CLIENTS, EXAMPLES)) < 0.08
    return jnp.asarray(labels, jnp.int32), jnp.asarray(flags)


def oracle(labels, flags):
    labels, flags = np.asarray(labels), np.asarray(flags)
    class_totals = [0] * CLASSES
    flagged = 0
    label_totals = [0] * EXAMPLES
    for i in range(NUM_CLIENTS):
        for j, label in enumerate(labels[i]):
            class_totals[int(label)] += 1
            label_totals[j] += int(label)
        flagged += int(any(flags[i]))
    # Integer sums are exact; the mean is one float32 division per element.
    f32 = np.float32
    return {
        "class_counts": jnp.asarray([f32(t) / f32(NUM_CLIENTS) for t in class_totals]),
        "flagged_fraction": jnp.asarray(f32(flagged) / f32(NUM_CLIENTS)),
        "label_mean": jnp.asarray([f32(t) / f32(NUM_CLIENTS) for t in label_totals]),
    }


CASE = Case(
    name="int_mean",
    fn=int_mean,
    make_args=make_args,
    oracle=oracle,
    grad_argnums=None,
)
