"""Secure aggregation of int32 histograms with ``secure_sum(bitwidth=16)``.

Each client bins its items and weights each item by a multiplicity, so a client's
bins stay below 2**16 while the sum over clients exceeds it: the result wraps
modulo 2**16. A plain ``reduce_sum`` of the item counts rides along.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

import fcir

from .case import Case

NUM_CLIENTS = 6
ITEMS = 16
BINS = 8
BITWIDTH = 16


def client_histogram(values, multiplicity):
    one_hot = values[:, None] == jnp.arange(BINS, dtype=jnp.int32)
    hist = jnp.sum(jnp.where(one_hot, multiplicity[:, None], 0), axis=0, dtype=jnp.int32)
    return hist, jnp.sum(multiplicity > 0, dtype=jnp.int32)


@fcir.program(placements={"clients": NUM_CLIENTS})
def secure_histogram(values, multiplicity):
    hists, nonzero = fcir.map_fn(client_histogram, (values, multiplicity))
    return fcir.secure_sum(hists, bitwidth=BITWIDTH), fcir.reduce_sum(nonzero)


def make_args():
    rng = np.random.default_rng(9)
    values = rng.integers(0, BINS, (NUM_CLIENTS, ITEMS))
    # 16 items * 4095 < 2**16: no client's own bin can wrap.
    multiplicity = rng.integers(0, 4096, (NUM_CLIENTS, ITEMS))
    multiplicity[0, :4] = 0
    return jnp.asarray(values, jnp.int32), jnp.asarray(multiplicity, jnp.int32)


def oracle(values, multiplicity):
    values, multiplicity = np.asarray(values), np.asarray(multiplicity)
    hist = [0] * BINS
    nonzero = 0
    for i in range(NUM_CLIENTS):
        for v, m in zip(values[i], multiplicity[i]):
            hist[int(v)] += int(m)
            nonzero += int(m > 0)
    wrapped = np.asarray([h % 2**BITWIDTH for h in hist], np.int32)
    return jnp.asarray(wrapped), jnp.int32(nonzero)


CASE = Case(
    name="secure_histogram",
    fn=secure_histogram,
    make_args=make_args,
    oracle=oracle,
    grad_argnums=None,
)
