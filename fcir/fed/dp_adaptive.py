"""``fcir.dp_mean_adaptive``: a DP mean whose clip norm follows a quantile of the
members' update norms (Andrew, Thakkar, McMahan, Ramaswamy, "Differentially Private
Learning with Adaptive Clipping", NeurIPS 2021).

No op of its own: the function composes ops every backend already runs, so the
reference and XLA interpreters, streaming (``clients_per_step``), the production
export and Flower run it unchanged, and the leak check and the accountant see two
ordinary central DP releases:

1. ``fed.broadcast`` sends the current clip ``C`` (a server value, the program's state:
   an input and an output of the round) to the members;
2. a ``fed.map`` computes, per member, its update divided by ``C`` and its bit
   ``b_i - 1/2`` with ``b_i = [norm <= C]``;
3. ``fed.dp_mean`` of the divided updates with ``clip_norm`` 1 and noise multiplier
   ``z_update`` (below), times ``C`` at the server: the update clipped to ``C``, noised
   with std ``z_update * C``, divided by ``n``, as the paper's DP-FedAvg computes it;
4. ``fed.dp_sum`` of the centred bits with ``clip_norm`` 1/2 and noise multiplier
   ``2 * count_stddev``: ``sum(b_i) - n/2`` plus noise of std ``count_stddev``
   (the paper's ``sigma_b``). The noised fraction ``b = sum / n + 1/2`` moves the
   clip geometrically: ``C' = C * exp(-learning_rate * (b - target_quantile))``.

Centring the bits halves their sensitivity (adding or removing a client moves the sum
by at most 1/2), so the count release is a Gaussian mechanism with noise multiplier
``2 * count_stddev``. Composed with the update's, one client's two releases are one
Gaussian mechanism with ``1/z^2 = 1/z_update^2 + 1/(2 count_stddev)^2``; the function
picks ``z_update = (z^-2 - (2 count_stddev)^-2)^(-1/2)`` so that this is the declared
``noise_multiplier`` z (the paper's Theorem 1), and ``fcir.privacy.epsilon`` of the
round is the ε of one Gaussian mechanism with z. The new clip is computed from a DP
release and server state only, so the leak check lets it through; a clip moved by an
un-noised count (``fcir.reduce_mean`` of the bits) is ``privacy/C1``.

``fcir.ddp_mean_adaptive`` is the same through distributed DP (``fed.ddp_mean`` and
``fed.ddp_sum``), each release's noise multiplier calibrated to be accounted as the
central one's.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from fcir.errors import PlacementError
from fcir.mechanisms import ddgauss
from fcir.mechanisms.clipping import pairwise_sum
from fcir.opkit import placement as api

from .base import public
from .broadcast import broadcast
from .ddp_mean import ddp_mean_p
from .ddp_sum import ddp_release, ddp_sum_p
from .dp_mean import dp_mean_p
from .dp_sum import dp_release, dp_sum_p
from .map import map_fn

__all__ = [
    "ddp_mean_adaptive",
    "default_count_stddev",
    "dp_mean_adaptive",
    "update_noise_multiplier",
]


def default_count_stddev(n: int) -> float:
    """The paper's choice of the count noise ``sigma_b``: ``n / 20`` for ``n`` clients
    per round (Andrew et al. 2021, Section 3)."""
    return n / 20.0


def update_noise_multiplier(
    noise_multiplier: float, count_stddev: float, what: str = "fcir.dp_mean_adaptive"
) -> float:
    """The update's noise multiplier ``(z^-2 - (2 sigma_b)^-2)^(-1/2)`` that, composed
    with the count release (noise multiplier ``2 sigma_b``), makes one Gaussian
    mechanism with ``noise_multiplier`` z. A PlacementError when ``2 sigma_b <= z``:
    the count alone would then cost at least the whole budget."""
    z, zb = float(noise_multiplier), 2.0 * float(count_stddev)
    if not zb > z:
        raise PlacementError(
            f"{what}: noise_multiplier={z:g} needs count_stddev > {z / 2:g} (the count "
            f"release's noise multiplier 2*count_stddev={zb:g} must exceed it, or the "
            "count alone spends the whole budget); pass a larger count_stddev (the paper "
            "uses clients/20) or a smaller noise_multiplier"
        )
    return 1.0 / math.sqrt(z**-2 - zb**-2)


def _static(what: str, name: str, value, low: float, high: float) -> float:
    """A Python number in ``[low, high]`` (the function's hyperparameters are attributes
    of the round, not traced values)."""
    ok = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)
    if not ok or not (low <= float(value) <= high):
        raise PlacementError(
            f"{what}: {name} must be a Python number in [{low:g}, {high:g}], got {value!r}"
        )
    return float(value)


def _member(c, *leaves):
    """One member: its leaves divided by the clip ``c``, and ``[norm <= c] - 1/2``."""
    acc = jnp.promote_types(c.dtype, jnp.float32)
    sq = pairwise_sum(
        jnp.stack([pairwise_sum(jnp.square(leaf.astype(acc)).reshape(-1)) for leaf in leaves])
    )
    # A NaN norm compares False: such a member counts as above the clip (dp_mean
    # already makes its update zero).
    bit = (jnp.sqrt(sq) <= c.astype(acc)).astype(c.dtype) - jnp.asarray(0.5, c.dtype)
    inv = 1.0 / c.astype(acc)
    return [(leaf.astype(acc) * inv).astype(leaf.dtype) for leaf in leaves], bit


def _adaptive(what, x, clip, noise_multiplier, gamma, eta, count_stddev, release):
    """The shared body: checks, the member map, the two releases through
    ``release(values, clip_norm, z_accounted, i)`` (``i`` 0 the update, 1 the count; the
    noise multiplier the accountant must count), the clip's update."""
    frame = api._current(what)
    name, n = frame.child(what)
    z = api._dp_static(what, "noise_multiplier", noise_multiplier, 0.0, True)
    gamma = _static(what, "target_quantile", gamma, 0.0, 1.0)
    eta = _static(what, "learning_rate", eta, 0.0, math.inf)
    sigma_b = default_count_stddev(n) if count_stddev is None else count_stddev
    sigma_b = api._dp_static(what, "count_stddev", sigma_b, 0.0, True)
    z_update = update_noise_multiplier(z, sigma_b, what)

    clip = jnp.asarray(clip)
    if clip.shape != () or not jnp.issubdtype(clip.dtype, jnp.floating):
        raise PlacementError(
            f"{what}: clip must be a float scalar at the server (the current clip norm), "
            f"got {clip.dtype}{list(clip.shape)}"
        )
    leaves, tree = api._flatten(x)
    if not leaves:
        raise PlacementError(f"{what}: x has no array leaves")
    api._check_placed(leaves, name, n, what)
    for leaf in leaves:
        if not jnp.issubdtype(leaf.dtype, jnp.floating):
            raise PlacementError(f"{what}: x's leaves must be floating point, got {leaf.dtype}")

    divided, bits = map_fn(_member, (broadcast(clip), *leaves))
    unit = release(divided, 1.0, z_update, 0)
    mean = [u * clip.astype(u.dtype) for u in unit]
    # clip_norm 1/2 with noise multiplier 2*sigma_b: noise of std sigma_b on the count.
    (count,) = release([bits], 0.5, 2.0 * sigma_b, 1)
    fraction = count / n + 0.5
    new_clip = clip * jnp.exp(-eta * (fraction - gamma)).astype(clip.dtype)
    return jax.tree_util.tree_unflatten(tree, mean), new_clip


@public
def dp_mean_adaptive(
    x,
    clip,
    noise_multiplier,
    key,
    *,
    target_quantile=0.5,
    learning_rate=0.2,
    count_stddev=None,
):
    """DP mean with adaptive clipping: ``(mean, new_clip)`` for a placed pytree ``x``.

    ``clip`` is the current clip norm, a float scalar at the server; carry it between
    rounds as the program's state (return ``new_clip`` and feed it back), so it is
    checkpointed, streamed and exported like a model. Each member's update is clipped
    to ``clip`` and the members' mean released with Gaussian noise; each member also
    contributes the bit "my update's L2 norm is at most ``clip``", whose noised count
    (std ``count_stddev``, default ``clients / 20``) moves the clip towards the
    ``target_quantile`` of the norms: ``new_clip = clip * exp(-learning_rate *
    (fraction - target_quantile))``.

    ``noise_multiplier`` is the round's total z: the update gets the larger
    ``update_noise_multiplier(z, count_stddev)`` so that the two releases together
    cost what one Gaussian mechanism with z costs (``fcir.privacy.epsilon`` reports
    that). The releases draw from ``jax.random.fold_in(key, 0)`` (update) and
    ``fold_in(key, 1)`` (count). Andrew et al., NeurIPS 2021; docs/privacy.md.
    """
    what = "fcir.dp_mean_adaptive"

    def release(values, clip_norm, z, i):
        prim = dp_mean_p if i == 0 else dp_sum_p
        return dp_release(prim, what, values, clip_norm, z, jax.random.fold_in(key, i))

    return _adaptive(
        what, x, clip, noise_multiplier, target_quantile, learning_rate, count_stddev, release
    )


@public
def ddp_mean_adaptive(
    x,
    clip,
    noise_multiplier,
    keys,
    *,
    bits=20,
    target_quantile=0.5,
    learning_rate=0.2,
    count_stddev=None,
):
    """``fcir.dp_mean_adaptive`` through distributed DP: ``(mean, new_clip)``.

    The update and the count are released by ``fcir.ddp_mean`` / ``fcir.ddp_sum``
    (``keys``: one PRNG key per member, client data; the releases draw from
    ``fold_in(k, 0)`` and ``fold_in(k, 1)`` of each member's key), each with the noise
    multiplier that ``fcir.privacy`` accounts as the central one
    (``fcir.mechanisms.ddgauss.noise_multiplier_for``: the rounding's share of the
    sensitivity taken into account), so the round's ε is again that of one Gaussian
    mechanism with ``noise_multiplier``. The count's sum is modulo ``2**bits`` like the
    update's."""
    what = "fcir.ddp_mean_adaptive"
    _, n = api._current(what).child(what)

    def release(values, clip_norm, z, i):
        prim = ddp_mean_p if i == 0 else ddp_sum_p
        dim = ddgauss.member_dim(np.shape(v)[1:] for v in values)
        z = ddgauss.noise_multiplier_for(z, dim, n, clip_norm, bits)
        member_keys = map_fn(lambda k: jax.random.fold_in(k, i), keys)
        return ddp_release(prim, what, values, clip_norm, z, member_keys, bits)

    return _adaptive(
        what, x, clip, noise_multiplier, target_quantile, learning_rate, count_stddev, release
    )
