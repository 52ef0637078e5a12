"""Central DP whose released bits are what the proof is about: the exact mode of
``fed.dp_sum`` / ``fed.dp_mean`` (``exact=True``, the op's ``gamma`` attribute).

A float sum plus float noise can be told from its neighbour by its low bits (Mironov,
"On Significance of the Least Significant Bits for Differential Privacy", CCS 2012):
the Gaussian mechanism's proof is about real numbers, and the floats released are not
those. Here every step after the clip is in integers, and the release is a
deterministic function of one integer vector whose law the proof is about:

1. each member's pytree is clipped as in float mode (``clip_member``: exact norm at
   most ``clip_norm``), then each entry is divided by the grid step ``gamma`` (a power
   of two: the division is exact in float32, or the quotient is below ``2**-126`` and
   rounds to 0) and rounded to the nearest integer (``to_grid``): ``q`` with
   ``|q_j - x_j / gamma| <= 1/2``, so ``||q||_2 <= clip_norm / gamma + sqrt(d) / 2``,
   ``d`` the member's number of elements: the L2 sensitivity ``delta2`` in grid units;
2. the ``q`` are summed in int32 (exact, in any order: every backend, streamed or not,
   has the same sum) and discrete Gaussian noise ``N_Z(0, stddev**2)``, ``stddev =
   noise_multiplier * clip_norm / gamma``, is added to each coordinate with the
   integer sampler of ``fcir.mechanisms.ddgauss`` (``discrete_gaussian``, leaf ``i``
   from ``fold_in(key, i)``): ``t``, an integer vector;
3. ``dp_mean`` takes ``k = floor(t / n + 1/2)`` in integers (``dp_sum``: ``k = t``),
   and the release is ``k * gamma`` (``release``): converted to float32 exactly (``|k|
   <= 2**24``, checked) and scaled by a power of two exactly, then rounded once to the
   leaf's dtype. A bf16 or f16 rounding of ``k * gamma`` keeps it a multiple of
   ``gamma`` (its unit in the last place is then a power of two at least ``gamma``),
   so every released float is a lattice point ``k' * gamma``, and a function of ``t``
   alone.

The discrete Gaussian with L2 sensitivity ``delta2`` and std ``stddev`` satisfies the
Rényi DP of the Gaussian mechanism with noise multiplier ``stddev / delta2`` (Canonne,
Kamath, Steinke, "The Discrete Gaussian for Differential Privacy", NeurIPS 2020,
Theorem 14 and Section 4: ``(delta2**2 / (2 stddev**2))``-concentrated DP); the release
is a post-processing of ``t``. So ε holds for the bits released, with the sampler's
total variation (``ddgauss.sampler_tv``, per coordinate) added to δ, as for ``ddp_*``.
``accounted_noise_multiplier = noise_multiplier / (1 + sqrt(d) gamma / (2 clip_norm))``.

``params`` refuses a ``gamma`` that is not a power of two, or with which ``|k|`` could
pass ``2**24`` (``n`` members' ``clip_norm / gamma + 1/2`` plus the sampler's reach) or
``|k| * gamma`` the leaf dtype's largest value: then the release would not be the
lattice point (or finite).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from fcir.errors import IRTypeError

from . import ddgauss

__all__ = [
    "K_MAX",
    "MAX_RATIO",
    "RHO",
    "LatticeParams",
    "default_gamma",
    "is_power_of_two",
    "noise",
    "noise_multiplier_for",
    "params",
    "release",
    "to_grid",
]

# The default grid's rounding adds at most RHO * clip_norm to the sensitivity ...
RHO = 2.0**-7
# ... unless that needs clip_norm / gamma above MAX_RATIO: the sampler's table has
# 12 * noise_multiplier * clip_norm / gamma rows, built on the host and held by the program.
MAX_RATIO = 2**13
# |k| at most this: every such integer is exact in float32 (and far inside int32).
K_MAX = 2**24


@dataclasses.dataclass(frozen=True)
class LatticeParams:
    """What an exact-mode ``fed.dp_*`` op derives from its attributes and shapes."""

    n: int
    dim: int  # elements of one member's pytree
    clip_norm: float
    noise_multiplier: float
    gamma: float
    stddev: float  # the discrete Gaussian's std, grid units
    delta2: float  # L2 sensitivity, grid units: clip_norm / gamma + sqrt(dim) / 2
    k_bound: int  # |t| (and |k|) at most this

    @property
    def accounted_noise_multiplier(self) -> float:
        """``stddev / delta2``: the Gaussian noise multiplier whose RDP this op's is."""
        return self.stddev / self.delta2 if self.noise_multiplier else 0.0


def is_power_of_two(x) -> bool:
    return isinstance(x, float) and math.isfinite(x) and x > 0 and math.frexp(x)[0] == 0.5


def default_gamma(clip_norm: float, dim: int) -> float:
    """The largest power of two with ``sqrt(dim) * gamma / 2 <= RHO * clip_norm``, but no
    smaller than the power of two at or above ``clip_norm / MAX_RATIO``."""
    fine = 2.0 ** math.floor(math.log2(2.0 * RHO * clip_norm / math.sqrt(max(dim, 1))))
    coarse = 2.0 ** math.ceil(math.log2(clip_norm / MAX_RATIO))
    return max(fine, coarse)


def params(
    dim: int,
    n: int,
    clip_norm: float,
    noise_multiplier: float,
    gamma: float,
    dtypes,
    what: str = "fcir.mechanisms.lattice.params",
) -> LatticeParams:
    """The noise, sensitivity and bound of an exact-mode op (module docstring);
    IRTypeError when ``gamma`` cannot give lattice releases in ``dtypes``."""
    if not is_power_of_two(gamma):
        raise IRTypeError(f"{what}: gamma must be a power of two (a float), got {gamma!r}")
    c, z = float(clip_norm), float(noise_multiplier)
    stddev = z * c / gamma
    per_member = math.floor(c / gamma + 0.5)
    k_bound = n * per_member + (ddgauss.reach(stddev) - 1 if stddev > 0 else 0)
    if k_bound > K_MAX:
        raise IRTypeError(
            f"{what}: gamma={gamma!r} is too fine for {n} members clipped to {c:g} with "
            f"noise multiplier {z:g}: the integers reach {k_bound}, past 2**24 (float32 "
            "could not hold every lattice point): use a larger gamma (a power of two)"
        )
    for dt in dtypes:
        fi = jnp.finfo(dt)
        if gamma < float(fi.tiny) or gamma < 2.0**-126 or k_bound * gamma >= float(fi.max):
            raise IRTypeError(
                f"{what}: gamma={gamma!r} gives releases up to {k_bound * gamma:.4g} on a "
                f"grid of {gamma!r}, which {np.dtype(dt).name} cannot hold (largest "
                f"{float(fi.max):.4g}, smallest normal {float(fi.tiny):.4g}): choose another "
                "gamma or release in float32 (x.astype(jnp.float32))"
            )
    delta2 = c / gamma + math.sqrt(dim) / 2.0
    return LatticeParams(n, dim, c, z, float(gamma), stddev, delta2, k_bound)


def to_grid(clipped, gamma: float):
    """``round(x / gamma)`` as int32, ``x`` (clipped members) in float32: exact division
    by a power of two, ties to even (any rounding to nearest keeps ``|error| <= 1/2``)."""
    scaled = clipped.astype(jnp.float32) * jnp.float32(1.0 / gamma)
    return jnp.round(scaled).astype(jnp.int32)


def noise(key, i: int, shape, p: LatticeParams):
    """Leaf ``i``'s integer noise, drawn with ``fold_in(key, i)`` (as float mode's)."""
    return ddgauss.discrete_gaussian(jax.random.fold_in(key, i), tuple(shape), p.stddev)


def release(t, n: int, mean: bool, gamma: float, dtype):
    """``k * gamma`` in ``dtype`` from the noised integer sum ``t``: ``k = t`` for a sum,
    ``floor(t / n + 1/2)`` (integers: ``(2 t + n) // (2 n)``) for a mean."""
    k = jnp.floor_divide(2 * t + n, 2 * n) if mean else t
    return (k.astype(jnp.float32) * jnp.float32(gamma)).astype(dtype)


def noise_multiplier_for(target: float, clip_norm: float, dim: int, gamma: float) -> float:
    """The ``noise_multiplier`` of an exact-mode op that ``fcir.privacy`` accounts as
    the Gaussian mechanism with noise multiplier ``target``: ``target * (1 + sqrt(dim)
    * gamma / (2 clip_norm))`` (``accounted_noise_multiplier`` inverted)."""
    return target * (1.0 + math.sqrt(dim) * gamma / (2.0 * clip_norm))
