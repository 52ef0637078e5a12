"""Federated programs that more than one Flower test file exports, on ``NODES`` clients:
rounds of several exchanges, a private round and server loops of rounds."""

from __future__ import annotations

import jax
import jax.numpy as jnp

import fcir

from .rounds import NODES

CLIP, Z = 0.5, 1.1  # private_fedavg's clip norm and noise multiplier


@fcir.program(placements={"clients": NODES})
def mean_then_variance(scale, x):
    """Two exchanges: the mean is broadcast back to compute the variance around it."""
    mean = fcir.reduce_mean(
        fcir.map_fn(lambda s, x: s * jnp.mean(x, axis=0), (fcir.broadcast(scale), x))
    )
    var = fcir.reduce_mean(
        fcir.map_fn(lambda m, x: jnp.mean(jnp.square(x - m), axis=0), (fcir.broadcast(mean), x))
    )
    return {"mean": mean, "spread": jnp.sqrt(var) * scale, "var": var}


def private_fedavg(dp):
    """A private round of linear regression ``(w, b, key, x, y)``: one SGD step's update
    per client, aggregated by ``dp`` (``fcir.dp_mean`` or ``fcir.dp_sum``) at CLIP, Z."""

    @fcir.program(placements={"clients": NODES}, private=True)
    def round_(w, b, key, x, y):
        return _fedavg_step(dp, w, b, key, x, y)

    return round_


def _fedavg_step(dp, w, b, key, x, y):
    def local(w, b, x, y):
        def loss(p):
            return jnp.mean(jnp.square(x @ p[0] + p[1] - y))

        gw, gb = jax.grad(loss)((w, b))
        return {"b": -0.5 * gb, "w": -0.5 * gw}

    upd = fcir.map_fn(local, (fcir.broadcast(w), fcir.broadcast(b), x, y))
    d = dp(upd, CLIP, Z, key)
    return w + d["w"], b + d["b"]


def private_fedavg_rounds(dp):
    """``private_fedavg`` that counts its rounds ``(w, b, r, key, x, y) -> (w', b', r + 1)``:
    the round number is state (fed back by the pytree paths) and folded into the key,
    so each round of a Flower run draws fresh noise."""

    @fcir.program(placements={"clients": NODES}, private=True)
    def round_(w, b, r, key, x, y):
        w, b = _fedavg_step(dp, w, b, jax.random.fold_in(key, r), x, y)
        return w, b, r + 1

    return round_


@fcir.program(placements={"clients": NODES})
def reverse_scan_two_exchanges(w, lrs, x):
    """A reverse scan over a server xs (a per-round learning rate) with a fori_loop-style
    counter in its carry and two exchanges per iteration (the mean is broadcast back for
    a spread), then server code after the loop."""

    def one_round(carry, lr):
        w, step = carry
        mean = fcir.reduce_mean(
            fcir.map_fn(lambda w, x: jnp.mean(x, axis=0) - w, (fcir.broadcast(w), x))
        )
        w = w + lr * mean
        spread = fcir.reduce_mean(
            fcir.map_fn(lambda w, x: jnp.mean(jnp.square(x - w)), (fcir.broadcast(w), x))
        )
        return (w, step + 1), spread

    (w, steps), spreads = jax.lax.scan(one_round, (w, jnp.int32(0)), lrs, reverse=True)
    return {"w": w * 2.0, "steps": steps, "spreads": spreads, "last": spreads[0]}


@fcir.program(placements={"clients": NODES})
def train_until(w, target, x):
    """A while_loop over rounds: its condition (at the server, between rounds) reads the
    carry; returns ``(w, loss, rounds run)``."""

    def cond(c):
        w, loss, i = c
        return jnp.logical_and(loss > target, i < 10)

    def body(c):
        w, _, i = c
        grads, losses = fcir.map_fn(
            lambda w, x: jax.value_and_grad(lambda w: jnp.mean(jnp.square(x - w)))(w)[::-1],
            (fcir.broadcast(w), x),
        )
        return w - 0.3 * fcir.reduce_mean(grads), fcir.reduce_mean(losses), i + 1

    w, loss, i = jax.lax.while_loop(cond, body, (w, jnp.float32(jnp.inf), jnp.int32(0)))
    return w, loss, i
