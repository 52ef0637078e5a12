"""``fcir.ddp_sum`` / ``fcir.ddp_mean``: distributed DP through secure aggregation (the
frontend; ``fcir.mechanisms.ddgauss`` has the numerics and their bounds, ``docs/privacy.md`` the
trust model)."""

from __future__ import annotations

import jax
import numpy as np

from fcir.errors import PlacementError
from fcir.fed.ddp_mean import ddp_mean_p
from fcir.fed.ddp_sum import ddp_sum_p
from fcir.frontend.program import _check_placed, _current, _dp_static, _flatten
from fcir.mechanisms import ddgauss as ddp

__all__ = ["ddp_mean", "ddp_sum"]


def _ddp(prim, what: str, x, clip_norm, noise_multiplier, keys, bits):

    frame = _current(what)
    name, n = frame.child(what)
    clip = _dp_static(what, "clip_norm", clip_norm, 0.0, True)
    z = _dp_static(what, "noise_multiplier", noise_multiplier, 0.0, False)
    if isinstance(bits, (bool, np.bool_)) or not isinstance(bits, (int, np.integer)):
        raise PlacementError(f"{what}: bits must be a Python int, got {bits!r}")
    bits = int(bits)
    if not ddp.MIN_BITS <= bits <= ddp.MAX_BITS:
        raise PlacementError(
            f"{what}: bits must be in [{ddp.MIN_BITS}, {ddp.MAX_BITS}], got {bits}"
        )
    leaves, tree = _flatten(x)
    if not leaves:
        raise PlacementError(f"{what}: x has no array leaves")
    _check_placed(leaves, name, n, what)
    if not isinstance(keys, jax.Array) and not hasattr(keys, "aval"):
        keys = jax.numpy.asarray(keys)
    _check_placed([keys], name, n, f"{what} (keys: one PRNG key per member of '{name}')")
    out = prim.bind(
        *leaves, keys, placement=name, n=n, clip_norm=clip, noise_multiplier=z, bits=bits
    )
    return jax.tree_util.tree_unflatten(tree, out)


def ddp_sum(x, clip_norm, noise_multiplier, keys, bits=20):
    """Distributed DP sum: ``{T}@child -> T@p`` for a placed pytree ``x``, through a
    secure sum modulo ``2**bits``.

    ``keys`` holds one PRNG key per member (``jax.random.split(key, n)`` passed as client
    data, ``{key}@clients``). Each member clips its pytree to global L2 norm
    ``clip_norm``, rotates, scales and rounds it to integers at random and adds its share
    of discrete Gaussian noise, so that the sum carries noise of std ``noise_multiplier
    * clip_norm`` in the update's units; the server decodes the modular sum and never
    holds an individual or un-noised value (``fcir.mechanisms.ddgauss``). ``clip_norm``,
    ``noise_multiplier`` and ``bits`` are Python numbers (attributes of the op, read by
    ``fcir.privacy.epsilon``). Gradients treat the noise and the rounding as constants.
    """
    return _ddp(ddp_sum_p, "fcir.ddp_sum", x, clip_norm, noise_multiplier, keys, bits)


def ddp_mean(x, clip_norm, noise_multiplier, keys, bits=20):
    """``fcir.ddp_sum`` divided by the cardinality of the placement (noise included)."""
    return _ddp(ddp_mean_p, "fcir.ddp_mean", x, clip_norm, noise_multiplier, keys, bits)
