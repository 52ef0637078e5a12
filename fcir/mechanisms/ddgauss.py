"""Distributed DP: the distributed discrete Gaussian mechanism (DDGauss) of Kairouz, Liu
and Steinke, "The Distributed Discrete Gaussian Mechanism for Federated Learning with
Secure Aggregation", ICML 2021 (arXiv:2102.06387), here called [KLS21].

The server never holds an individual or un-noised value: each client turns its update
into integers modulo ``2**bits`` that already carry its share of the noise, secure
aggregation sums them modulo ``2**bits``, and the server decodes the sum.

Client (``encode``), for a member's pytree with ``d`` elements in all:

1. flatten (as float32) and zero-pad to ``D = 2**ceil(log2 d)``; clip to global L2
   norm ``clip_norm`` (``fcir.mechanisms.clipping.clip_member``'s rule, as ``dp_*``, with the
   squared norm summed in a fixed pairwise order: ``_clip_rows``);
2. rotate: ``R x = H S x / sqrt(D)``,
   ``H`` the ``D x D`` Walsh-Hadamard matrix, ``S`` random signs. ``R`` is orthonormal
   and *public*, the same for every client (the server inverts it on the sum), drawn
   from the fixed seed ``ROTATION_SEED``; it spreads the update's energy evenly over the
   coordinates so that the modular sum rarely wraps;
3. scale by ``scale`` (integers per unit of the update) and round each coordinate at
   random to one of its two neighbouring integers, up with probability the fractional
   part (unbiased), *conditionally* ([KLS21] Section 4.1): the rounding is drawn again
   while the rounded vector's L2 norm exceeds ``DdpParams.norm_bound`` (see
   "Sensitivity with rounding");
4. add discrete Gaussian noise ``N_Z(0, local_stddev**2)`` per coordinate (integer
   inverse CDF, see "The discrete Gaussian sampler"), where
   ``local_stddev = noise_multiplier * clip_norm * scale / sqrt(n)``: the sum of the
   ``n`` clients' shares has variance ``(noise_multiplier * clip_norm * scale)**2``,
   i.e. std ``noise_multiplier * clip_norm`` in the update's units, as ``dp_sum``;
5. reduce modulo ``2**bits`` (``uint32`` values in ``[0, 2**bits)``).

Secure aggregation (``aggregate``): the sum modulo ``2**bits`` of the clients' vectors.

Server (``decode``): map the residues to the centred range ``[-2**(bits-1),
2**(bits-1))``, rotate back (``R^T y = S H y / sqrt(D)``), drop the padding, divide by
``scale`` (and ``ddp_mean`` by the cardinality ``n``).

**The scale and the overflow bound.** Decoding is exact unless a coordinate of the
integer sum leaves ``[-2**(bits-1), 2**(bits-1))``. Coordinate ``j`` of the sum is
``scale * (R w)_j + E_j + G_j`` with ``w`` the sum of the clipped updates
(``||w|| <= n * clip_norm``, the worst case of identical updates), ``E_j`` the rounding
errors (``|E_j| < n`` always) and ``G_j`` the noise. Over the random signs,
``(R w)_j = sum_l H_jl S_l w_l / sqrt(D)`` is sub-Gaussian with variance proxy
``||w||**2 / D`` (Hoeffding); a discrete Gaussian ``N_Z(0, s**2)`` is sub-Gaussian with
variance proxy ``s**2`` (Canonne, Kamath, Steinke 2020, "The Discrete Gaussian for
Differential Privacy"). So with ``v = (scale * clip_norm)**2 * (n**2 / D +
noise_multiplier**2)``,

    P(some coordinate wraps) <= 2 D exp(-(2**(bits-1) - n)**2 / (2 v)),

and ``scale`` is the largest value with that bound at ``OVERFLOW_TARGET`` (``2**-30``)
per release. ``DdpParams.overflow_bound`` is the bound computed for the op's parameters.
It assumes the updates do not depend on the public signs (they are fixed, not adapted
to; an adversarial client can at most spoil the sum, not learn from it).

**Sensitivity with rounding.** The privacy analysis needs a bound ``Delta_2`` on each
client's integer vector before noise. With ``c = scale * clip_norm`` (times a float32
margin for the clip and the rotation, ``(log2 D + 8) * 2**-23`` relative: the clipped
row's norm is within ``(log2 D / 2 + 4) * 2**-24`` of ``clip_norm``, each of the
``log2 D`` butterfly passes and the two roundings of the scaling add at most ``2**-24``
to the norm, ``(1.5 log2 D + 6) * 2**-24`` in all), [KLS21]
Theorem 1 gives two:

* any rounding to neighbouring integers moves each coordinate by less than 1:
  ``||q|| <= c + sqrt(D)``;
* randomized rounding exceeds ``sqrt(c**2 + D/4 + sqrt(2 log(1/beta)) (c + sqrt(D)/2))``
  with probability at most ``beta`` (the conditional form of [KLS21] Theorem 1, Section
  4.1), here ``beta = ROUNDING_BETA = exp(-1/2)``, TensorFlow Federated's default.

With conditional rounding (``params(..., conditional=True)``, what the ``ddp_*`` ops do)
a client redraws its rounding, each attempt from ``fold_in(fold_in(key, 0), attempt)``,
until ``||q|| <= norm_bound = min(both)``; ``delta2`` is that minimum, so the
guarantee does not depend on ``beta``, only the number of attempts does: each succeeds
with probability at least ``1 - beta`` (about 0.39; in practice nearly always the
first), and after ``MAX_ROUNDINGS`` (64) failed attempts, probability at most
``beta**64 = exp(-32) < 1.3e-14`` per client and release, the client rounds every
coordinate toward zero, whose norm is at most ``||scale R x|| <= c``. So ``||q|| <=
delta2`` always: the fallback costs a little bias, never privacy. The check is exact
(``within_norm_bound``): the squared norm of the integer vector in 64-bit integer
arithmetic (pairs of ``uint32`` words), against the integer ``floor(norm_bound**2)``
computed once on the host, so it passes exactly the vectors of norm at most
``norm_bound``, and it is an integer sum, the same in any order: every program that
encodes a client (reference, XLA, streamed, production) accepts the same attempt.
Without conditioning (``conditional=False``) ``delta2`` is the first bound.
The accountant (``fcir.privacy``) uses [KLS21] Proposition 14, see
``rdp_noise_multiplier``.

**Dropouts** (``min_clients``, ``m``). Each client adds ``N_Z(0, local_stddev**2)``
with ``local_stddev = noise_multiplier * clip_norm * scale / sqrt(m)``, so any ``m``
shares already carry the full noise; the accountant takes ``m`` shares (see
``rdp_noise_multiplier``) and a runtime that sums fewer than ``m`` replies refuses the
round. With all ``n`` replying the sum carries ``n / m`` times the variance, which the
scale's overflow bound allows for. Unset, ``m = n``: every client must reply.

**The discrete Gaussian sampler** draws from the law's inverse CDF in integers only:
the host tabulates ``T[k] = floor(2**96 P(|Y| <= k))`` for ``|Y|`` of ``N_Z(0, s**2)``
(``s`` the float64 ``local_stddev`` itself, an exact rational: nothing is rounded; the
pmf in 192-bit fixed point from ``decimal``'s ``exp``) out to ``R = 12.01 s + 2``, where
``P(|Y| >= R) < 2**-100``; each coordinate draws a uniform 96-bit integer ``W`` (three
``uint32`` words of ``jax.random.bits``) and a sign bit (a fourth word), and ``|Y|`` is
the number of thresholds at most ``W`` (a binary search of ``log2 R`` fixed steps, no
loop to exhaust). Its law is within ``sampler_tv(s) = R * 2**-95 + 2 P(|Y| >= R - 1)``
(about ``12 s * 2**-95``, 1e-24 at ``s = 5000``) in total variation of the discrete
Gaussian, the same on every backend; ``fcir.privacy.round_cost``'s
``delta_with_sampler`` adds it to δ. (Before, the sampler was Canonne, Kamath and
Steinke's rejection in float32, ``2**-24`` off per coordinate: a vacuous δ over a
realistic run.) The table costs ``12 s`` words of 12 bytes in the clients' program
(about 0.8 MB at ``s = 5000``).

Every function here is plain JAX (jit, vmap, eager alike) and deterministic for its
keys and its input's bits: no float reduction is left to XLA's choice of order (the
clip's norm is a fixed pairwise sum, the rounding's check an integer one; the rest is
elementwise), so the reference interpreter (client by client, eagerly), the XLA backend (all
clients in one batch, ``encode_batch``) and the streamed one (``k`` at a time) agree
bit for bit.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from fcir.errors import IRTypeError

from .clipping import clip_scale, pairwise_sum

__all__ = [
    "DdpParams",
    "attr_params",
    "MAX_BITS",
    "SAMPLER_BITS",
    "MIN_BITS",
    "MAX_ROUNDINGS",
    "OVERFLOW_TARGET",
    "ROTATION_SEED",
    "ROUNDING_BETA",
    "aggregate",
    "decode",
    "discrete_gaussian",
    "discrete_gaussian_batch",
    "encode",
    "encode_batch",
    "fwht",
    "params",
    "norm_bound_squared",
    "reach",
    "rdp_noise_multiplier",
    "sampler_tv",
    "within_norm_bound",
]

ROTATION_SEED = 0x5EED
OVERFLOW_TARGET = 2.0**-30
# Conditional randomized rounding ([KLS21] Section 4.1): the tail probability of one
# rounding's norm the bound is set at, and the attempts before the fallback.
ROUNDING_BETA = math.exp(-0.5)
MAX_ROUNDINGS = 64
# Integers stay below 2**24 in magnitude, so float32 holds every one exactly.
MIN_BITS, MAX_BITS = 2, 24


@dataclasses.dataclass(frozen=True)
class DdpParams:
    """Everything a ``ddp_*`` op derives from its attributes and operand shapes."""

    n: int  # clients
    dim: int  # elements of one member's pytree
    padded_dim: int  # D: power of two >= dim
    bits: int
    clip_norm: float
    noise_multiplier: float
    scale: float  # integers per unit of the update
    local_stddev: float  # per-client discrete Gaussian std, integer units
    delta2: float  # L2 sensitivity of one client's rounded vector, integer units
    overflow_bound: float  # P(the modular sum wraps) per release, upper bound
    conditional: bool = True  # conditional randomized rounding (redraw above norm_bound)
    norm_bound: float = math.inf  # what a rounded vector's L2 norm is checked against
    min_clients: int = 0  # the fewest shares whose sum carries the full noise (0: n)

    @property
    def shares(self) -> int:
        """How many clients' noise shares make the full noise: ``min_clients``, or
        ``n`` when the op declares none."""
        return self.min_clients or self.n

    @property
    def rounding_failure(self) -> float:
        """P(a client falls back to rounding toward zero) per release, upper bound:
        ``ROUNDING_BETA ** MAX_ROUNDINGS`` with conditional rounding, else 0."""
        return ROUNDING_BETA**MAX_ROUNDINGS if self.conditional else 0.0

    @property
    def modulus(self) -> int:
        return 1 << self.bits

    @property
    def tau(self) -> float:
        """[KLS21] Theorem 1: how far the sum of ``n`` discrete Gaussians is from one."""
        s2 = self.local_stddev**2
        return 10.0 * sum(math.exp(-2.0 * math.pi**2 * s2 * k / (k + 1)) for k in range(1, self.n))

    def to_json(self) -> dict:
        return {
            **dataclasses.asdict(self),
            "modulus": self.modulus,
            "tau": self.tau,
            "rounding_failure": self.rounding_failure,
        }


def _padded(d: int) -> int:
    return 1 << max(0, (d - 1).bit_length())


def params(
    dim: int,
    n: int,
    clip_norm: float,
    noise_multiplier: float,
    bits: int,
    what: str = "fcir.ddp.params",
    conditional: bool = True,
    min_clients: int | None = None,
) -> DdpParams:
    """The scale, noise and bounds of a ``ddp_*`` op (see the module docstring);
    ``conditional``: conditional randomized rounding, with its tighter ``delta2``;
    ``min_clients``: the fewest clients whose shares must carry the full noise (None:
    all ``n``; see "Dropouts" in the module docstring)."""
    if isinstance(bits, bool) or not isinstance(bits, int) or not MIN_BITS <= bits <= MAX_BITS:
        raise IRTypeError(f"{what}: bits must be an int in [{MIN_BITS}, {MAX_BITS}], got {bits!r}")
    m = n if min_clients is None else min_clients
    if isinstance(m, bool) or not isinstance(m, int) or not 1 <= m <= n:
        raise IRTypeError(
            f"{what}: min_clients must be an int in [1, {n}] (the cardinality), got "
            f"{min_clients!r}"
        )
    half = float(1 << (bits - 1))
    if half <= n:
        raise IRTypeError(
            f"{what}: bits={bits} leaves no room for the sum of {n} clients' values "
            f"(2**(bits-1) must exceed the cardinality {n}): use more bits"
        )
    D = _padded(dim)
    c, z = float(clip_norm), float(noise_multiplier)
    k = math.sqrt(2.0 * math.log(2.0 * D / OVERFLOW_TARGET))
    # With every one of the n clients replying the sum carries n / m times the noise's
    # variance: the overflow bound is for the most shares.
    zz = z * z * n / m
    spread = math.sqrt(n * n / D + zz)
    scale = (half - n) / (k * c * spread)
    v = (scale * c) ** 2 * (n * n / D + zz)
    bound = min(1.0, 2.0 * D * math.exp(-((half - n) ** 2) / (2.0 * v)))
    cm = scale * c * (1.0 + (math.log2(D) + 8) * 2.0**-23)
    if cm + math.sqrt(D) >= 2.0**31:
        # A rounded coordinate must fit int32, and a squared norm 64 bits
        # (within_norm_bound): both hold below 2**31.
        raise IRTypeError(
            f"{what}: noise_multiplier={noise_multiplier!r} with {n} clients and {D} "
            f"coordinates scales the updates past int32 (scale * clip_norm = {scale * c:.3g}): "
            "use fewer bits or more noise"
        )
    delta2, norm_bound = rounding_sensitivity(cm, D, conditional)
    return DdpParams(
        n=n,
        dim=dim,
        padded_dim=D,
        bits=bits,
        clip_norm=c,
        noise_multiplier=z,
        scale=scale,
        local_stddev=z * c * scale / math.sqrt(m),
        delta2=delta2,
        overflow_bound=bound,
        conditional=bool(conditional),
        norm_bound=norm_bound,
        min_clients=0 if min_clients is None else m,
    )


def rounding_sensitivity(c: float, D: int, conditional: bool = True) -> tuple[float, float]:
    """``(delta2, norm_bound)`` for a rotated, scaled vector of L2 norm at most ``c``
    with ``D`` coordinates ([KLS21] Theorem 1): ``c + sqrt(D)`` for plain randomized
    rounding (``norm_bound`` infinite: nothing is checked); with conditional rounding
    the smaller of that and ``sqrt(c**2 + D/4 + sqrt(2 log(1/beta)) (c + sqrt(D)/2))``,
    the norm the rounding is redrawn above (so both are that minimum)."""
    plain = c + math.sqrt(D)
    if not conditional:
        return plain, math.inf
    tight = math.sqrt(
        c * c + D / 4.0 + math.sqrt(2.0 * math.log(1.0 / ROUNDING_BETA)) * (c + math.sqrt(D) / 2.0)
    )
    bound = min(plain, tight)
    return bound, bound


def rdp_noise_multiplier(p: DdpParams) -> float:
    """The noise multiplier of the Gaussian mechanism whose RDP bounds this op's.

    [KLS21] Proposition 14 bounds the Rényi divergence of order ``alpha`` of the
    distributed discrete Gaussian sum by (among others) ``alpha/2 * (Delta_2 / (sqrt(n)
    s) + sqrt(D) * tau)**2``, ``s`` the local std and ``tau`` of Theorem 1, both in
    integer units: the RDP curve ``alpha / (2 z**2)`` of a Gaussian with noise
    multiplier ``z = 1 / (Delta_2 / (sqrt(n) s) + sqrt(D) tau)``. ``Delta_2 >= scale *
    clip_norm`` and ``tau >= 0``, so ``z <= noise_multiplier``: never less private
    than central DP claims. 0 when the op adds no noise.

    With ``min_clients`` ``m`` below ``n``, any ``n' >= m`` clients may be in the sum
    (the runtimes refuse fewer). Proposition 14 for ``n'`` shares has ``sqrt(n') s >=
    sqrt(m) s`` and ``tau(n') <= tau(n)`` (``tau`` sums ``n' - 1`` positive terms), so
    ``Delta_2 / (sqrt(m) s) + sqrt(D) tau(n)`` bounds the ratio for every ``n'`` in
    ``[m, n]``: the guarantee at ``min_clients``.
    """
    if p.noise_multiplier == 0:
        return 0.0
    ratio = p.delta2 / (math.sqrt(p.shares) * p.local_stddev) + math.sqrt(p.padded_dim) * p.tau
    return 1.0 / ratio


# --- the numerics ---------------------------------------------------------------------------


def fwht(x):
    """Unnormalized Walsh-Hadamard transform along the last axis (a power of two):
    ``H x`` with ``H H = D I``; log2(D) butterfly passes."""
    D = x.shape[-1]
    h = 1
    while h < D:
        y = x.reshape(*x.shape[:-1], D // (2 * h), 2, h)
        a, b = y[..., 0, :], y[..., 1, :]
        x = jnp.stack([a + b, a - b], axis=-2).reshape(*x.shape[:-1], D)
        h *= 2
    return x


@functools.lru_cache(maxsize=64)
def _sign_table(D: int) -> np.ndarray:
    # The raw stream of a NumPy BitGenerator is stable across NumPy versions (unlike
    # Generator methods), so every party and every version derives the same signs.
    words = np.random.PCG64(ROTATION_SEED).random_raw((D + 63) // 64).astype(np.uint64)
    bits = np.unpackbits(words.view(np.uint8), bitorder="little")[:D]
    out = np.where(bits == 1, np.float32(1), np.float32(-1)).astype(np.float32)
    out.flags.writeable = False
    return out


def _signs(D: int):
    """The public rotation's signs: a constant of the program (the bits of NumPy's PCG64
    raw stream seeded with ``ROTATION_SEED``), the same for every client and the server."""
    return jnp.asarray(_sign_table(D))


SAMPLER_BITS = 96  # the uniform integer each noise coordinate is drawn from
_TAIL_BITS = 104  # the table reaches past the point where P(|Y| > R) < 2**-104 (about)
_HOST_BITS = 192  # the fixed-point precision of the host's pmf


def reach(stddev: float) -> int:
    """``R``, where the sampler's table at ``stddev`` ends: every draw of
    ``discrete_gaussian`` is at most ``R - 1`` in magnitude."""
    return int(math.ceil(stddev * math.sqrt(2.0 * math.log(2.0) * _TAIL_BITS))) + 2


@functools.lru_cache(maxsize=32)
def _dg_table(stddev: float) -> tuple[np.ndarray, int, float]:
    """The inverse-CDF table of ``|Y|``, ``Y ~ N_Z(0, stddev**2)``: ``(T, R, tv)``.

    ``T[k] = floor(2**96 * P(|Y| <= k))`` for ``k`` in ``[0, R)``, as ``uint32[L, 3]``
    words (most significant first), ``L`` a power of two, padded with ``2**96 - 1``.
    ``stddev`` is the float64 it is, an exact rational: no rounding of ``sigma``. The
    pmf ``p_k = exp(-k**2 / (2 s**2))`` is computed on the host in ``_HOST_BITS``-bit
    fixed point from ``a = exp(-1 / (2 s**2))`` (``decimal``, 70 digits) by ``p_{k+1} =
    p_k a**(2k+1)``, the normaliser with the tail past ``R`` summed as a geometric
    bound. ``tv`` bounds the total variation between what ``discrete_gaussian`` draws
    and ``N_Z(0, stddev**2)``: ``R * 2**-95`` for the floors (each ``T[k]`` within one
    unit of ``2**96`` times the exact CDF, the host's error far below a unit) plus twice
    the mass from ``R - 1`` on, where the table ends (drawn as ``R - 1``), below
    ``2**-100``.
    """
    import decimal

    R = reach(stddev)
    one = 1 << _HOST_BITS
    with decimal.localcontext() as ctx:
        ctx.prec = 70
        s2 = decimal.Decimal(stddev) ** 2  # the float64 is a dyadic rational, squared to 70 digits
        a = int((-1 / (2 * s2)).exp() * one)
    p, step, a2 = one, a, a * a >> _HOST_BITS
    cums, total = [], 0
    for k in range(R):
        total += p if k == 0 else 2 * p
        cums.append(total)
        p = p * step >> _HOST_BITS
        step = step * a2 >> _HOST_BITS
    # Past R: p_{k+1} / p_k <= step / one for k >= R, so the tail is at most p / (1 - step).
    tail = 2 * (p * one // max(one - step, 1) + 1)
    z = total + tail
    T = [(c << SAMPLER_BITS) // z for c in cums[:-1]]
    L = 1 << max(1, (R - 1).bit_length())
    top = (1 << SAMPLER_BITS) - 1
    T += [top] * (L - len(T))
    words = np.array(
        [[(t >> 64) & 0xFFFFFFFF, (t >> 32) & 0xFFFFFFFF, t & 0xFFFFFFFF] for t in T], np.uint32
    )
    words.flags.writeable = False
    # P(|Y| >= R - 1 is misdrawn): the mass from R - 1 on, plus the host's slack.
    tail_mass = (2 * cums[-1] - 2 * cums[-2] + 2 * tail) / z if R > 1 else 1.0
    tv = R * 2.0**-95 + tail_mass
    return words, R, tv


def sampler_tv(stddev: float) -> float:
    """An upper bound on the total variation between one coordinate of
    ``discrete_gaussian(key, shape, stddev)`` and ``N_Z(0, stddev**2)`` (0 when
    ``stddev == 0``: no noise is drawn). About ``12 stddev * 2**-95``: 1e-24 at 5000."""
    return 0.0 if stddev == 0 else _dg_table(float(stddev))[2]


def _lt3(a, b):
    """``a < b`` for 96-bit integers as three uint32 words (most significant first)."""
    return (a[0] < b[0]) | ((a[0] == b[0]) & ((a[1] < b[1]) | ((a[1] == b[1]) & (a[2] < b[2]))))


def _lookup(table, idx):
    """``table[idx]`` (rows), with the indices' sharding on the rows: a mesh's explicit
    sharding (the clients' axis) cannot infer a gather's output sharding by itself."""
    spec = tuple(jax.typeof(idx).sharding.spec)
    spec += (None,) * (idx.ndim - len(spec))
    if not any(spec):
        return table[idx]
    return table.at[idx].get(out_sharding=jax.sharding.PartitionSpec(*spec, None))


def discrete_gaussian(key, shape, stddev: float):
    """int32 samples of the discrete Gaussian ``P(y) ∝ exp(-y**2 / (2 stddev**2))``
    (see the module docstring: integer inverse CDF, no float in any decision)."""
    return discrete_gaussian_batch(jnp.asarray(key)[None], shape, stddev)[0]


def discrete_gaussian_batch(keys, shape, stddev: float):
    """``discrete_gaussian`` for each key of ``keys`` (a leading axis): ``int32[len(keys),
    *shape]``, row ``i`` what ``discrete_gaussian(keys[i], ...)`` gives.

    Each coordinate draws four uint32 words from its key (``jax.random.bits``): three
    make a uniform 96-bit integer ``W``, whose rank among the host's thresholds
    ``T[k] = floor(2**96 P(|Y| <= k))`` is ``|Y|`` (a binary search of ``log2 L`` fixed
    steps, integer comparisons only), and the fourth's low bit the sign. Integer
    operations only, the same on every backend, in every batch."""
    shape = tuple(shape)
    n = keys.shape[0]
    if stddev == 0:
        return jnp.zeros((n, *shape), jnp.int32)
    words, R, _ = _dg_table(float(stddev))
    table = jnp.asarray(words)
    L = words.shape[0]
    raw = jax.vmap(lambda k: jax.random.bits(k, (4, *shape), jnp.uint32))(keys)
    # Slices, not integer indexing (a gather, which a mesh's sharded batch refuses).
    hi, mid, lo, sign = (jax.lax.index_in_dim(raw, j, axis=1, keepdims=False) for j in range(4))
    w = (hi, mid, lo)
    pos = jnp.zeros(raw.shape[:1] + shape, jnp.int32)
    step = L // 2
    while step >= 1:
        t = _lookup(table, pos + (step - 1))
        # T[pos + step - 1] <= W: at least pos + step thresholds are passed.
        passed = jnp.logical_not(_lt3(w, (t[..., 0], t[..., 1], t[..., 2])))
        pos = pos + jnp.where(passed, jnp.int32(step), jnp.int32(0))
        step //= 2
    mag = jnp.minimum(pos, jnp.int32(R - 1))
    negative = (sign & jnp.uint32(1)) == jnp.uint32(1)
    return jnp.where(negative, -mag, mag)


def _flat(leaves, D: int):
    flat = jnp.concatenate([jnp.ravel(leaf).astype(jnp.float32) for leaf in leaves])
    return jnp.pad(flat, (0, D - flat.shape[0]))


def encode(leaves, key, p: DdpParams):
    """One client's ``uint32[D]`` residues modulo ``2**bits``: clip, rotate, scale,
    round at random, add its discrete Gaussian share, wrap. ``key``: the client's."""
    return encode_batch([jnp.asarray(x)[None] for x in leaves], jnp.asarray(key)[None], p)[0]


def encode_batch(leaves, keys, p: DdpParams):
    """``encode`` for a batch of clients (a leading axis on every leaf and on ``keys``):
    ``uint32[k, D]``, row ``i`` bit for bit ``encode`` of client ``i``."""
    D = p.padded_dim
    flat = _clip_rows(jax.vmap(lambda *m: _flat(m, D))(*leaves), p.clip_norm)
    v = fwht(flat * _signs(D)) * jnp.float32(p.scale / math.sqrt(D))
    k_round = jax.vmap(lambda k: jax.random.fold_in(k, 0))(keys)
    k_noise = jax.vmap(lambda k: jax.random.fold_in(k, 1))(keys)
    q = round_batch(v, k_round, p)
    q = q + discrete_gaussian_batch(k_noise, (D,), p.local_stddev)
    return jnp.bitwise_and(q.astype(jnp.uint32), jnp.uint32(p.modulus - 1))


def _clip_rows(flat, clip_norm: float):
    """Each row (one client's flattened, zero-padded ``float32[D]``) scaled by ``min(1,
    clip_norm / norm)``, an all-zero row kept and a row with a non-finite entry zeroed
    (``fcir.mechanisms.clipping.clip_member``'s rule),
    the squared norm summed in ``fcir.mechanisms.clipping.pairwise_sum``'s fixed order: the clip is a float
    decision, and it must be the same in every program that encodes the row. The
    computed norm is within ``(log2 D / 2 + 2) * 2**-24`` relative of the true one, so
    the clipped row's norm is at most ``clip_norm * (1 + (log2 D / 2 + 4) * 2**-24)``
    (the margin ``params`` allows for it)."""
    # A row with a NaN or inf entry has a non-finite squared norm: it is encoded as the
    # all-zero row, never left to how a backend converts NaN to int.
    finite, factor = clip_scale(pairwise_sum(jnp.square(flat)), clip_norm)
    return jnp.where(finite[..., None], flat * factor[..., None], jnp.zeros_like(flat))


_LO16 = 0xFFFF


def _square_limbs(q):
    """``q**2`` exactly, as two ``uint32`` words ``(hi, lo)`` (``q**2 = hi * 2**32 +
    lo``), for ``int32`` ``q`` (``|q| < 2**31``): ``|q| = a * 2**16 + b`` with ``a <
    2**15``, ``b < 2**16``, so ``a**2``, ``2 a b`` and ``b**2`` all fit ``uint32``."""
    m = jnp.abs(q).astype(jnp.uint32)
    a, b = m >> 16, m & jnp.uint32(_LO16)
    ab2 = a * b * jnp.uint32(2)  # < 2**32
    bb = b * b
    lo = bb + ((ab2 & jnp.uint32(_LO16)) << 16)
    carry = (lo < bb).astype(jnp.uint32)
    return a * a + (ab2 >> 16) + carry, lo


def _sum_limbs(hi, lo):
    """The exact sum along the last axis (a power of two) of the 64-bit integers ``hi *
    2**32 + lo``, halving with a carry (an integer sum: the same in any order; no
    overflow while the total is below ``2**64``, which ``params`` guarantees)."""
    while hi.shape[-1] > 1:
        half = hi.shape[-1] // 2
        lo_a, lo_b = lo[..., :half], lo[..., half:]
        lo = lo_a + lo_b
        hi = hi[..., :half] + hi[..., half:] + (lo < lo_a).astype(jnp.uint32)
    return hi[..., 0], lo[..., 0]


def norm_bound_squared(p: DdpParams) -> int:
    """``floor(norm_bound**2)``, exactly (the float64 ``norm_bound`` as a rational): an
    integer vector's squared norm is at most ``norm_bound**2`` iff it is at most this."""
    from fractions import Fraction

    return math.floor(Fraction(p.norm_bound) ** 2)


def within_norm_bound(q, p: DdpParams):
    """``||q||**2 <= norm_bound**2`` for each row of ``int32`` ``q``, decided exactly:
    the squared norm in 64-bit integer arithmetic (``uint32`` word pairs), against
    ``norm_bound_squared(p)`` computed once on the host. Integer sums do not depend on
    their order, so every program that checks a row decides the same."""
    bound = norm_bound_squared(p)
    b_hi, b_lo = jnp.uint32(bound >> 32), jnp.uint32(bound & 0xFFFFFFFF)
    hi, lo = _sum_limbs(*_square_limbs(q))
    return jnp.logical_or(hi < b_hi, jnp.logical_and(hi == b_hi, lo <= b_lo))


def round_batch(v, keys, p: DdpParams):
    """Randomized rounding of each row of ``v`` (``float32[k, D]``, the scaled rotated
    updates) to ``int32``, row ``i`` with ``keys[i]``: each coordinate up with
    probability its fractional part. With ``p.conditional`` an attempt whose norm
    exceeds ``p.norm_bound`` is redrawn (attempt ``a`` from ``fold_in(key, a)``) and
    after ``MAX_ROUNDINGS`` attempts the row is rounded toward zero; the loop runs once
    over the batch, each row keeping its first accepted attempt, so a row's result
    depends on its key only (bit for bit whatever the batch)."""
    D = v.shape[-1]
    low = jnp.floor(v)
    frac = v - low
    base = low.astype(jnp.int32)

    def attempt(a):
        u = jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(k, a), (D,), jnp.float32))(
            keys
        )
        return base + (u < frac).astype(jnp.int32)

    if not p.conditional:
        return attempt(0)

    def ok(q):
        return within_norm_bound(q, p)

    def cond(state):
        a, _, done = state
        return jnp.logical_and(a < MAX_ROUNDINGS, jnp.logical_not(jnp.all(done)))

    def body(state):
        a, out, done = state
        q = attempt(a)
        take = jnp.logical_and(ok(q), jnp.logical_not(done))
        return a + 1, jnp.where(take[:, None], q, out), jnp.logical_or(done, take)

    # As in discrete_gaussian_batch: the first attempt outside the loop types the carry.
    q = attempt(0)
    acc = ok(q)
    toward_zero = jnp.trunc(v).astype(jnp.int32)
    init = (jnp.int32(1), jnp.where(acc[:, None], q, toward_zero), acc)
    return jax.lax.while_loop(cond, body, init)[1]


def aggregate(encoded, p: DdpParams):
    """The secure sum: ``uint32[n, D] -> uint32[D]`` modulo ``2**bits`` (uint32 adds
    wrap modulo 2**32, a multiple of the modulus)."""
    total = jnp.sum(encoded, axis=0, dtype=jnp.uint32)
    return jnp.bitwise_and(total, jnp.uint32(p.modulus - 1))


def decode(total, p: DdpParams, like, mean: bool):
    """The server's leaves from the modular sum ``uint32[D]``: centre, rotate back,
    unscale (and divide by ``n`` for the mean). ``like``: the member leaves' shapes and
    dtypes (anything with ``.shape`` and ``.dtype``)."""
    D = p.padded_dim
    half = 1 << (p.bits - 1)
    centred = jnp.where(
        total >= jnp.uint32(half), total.astype(jnp.int32) - p.modulus, total.astype(jnp.int32)
    )
    y = fwht(centred.astype(jnp.float32)) * _signs(D)
    x = y * jnp.float32(1.0 / (math.sqrt(D) * p.scale * (p.n if mean else 1)))
    out, start = [], 0
    for leaf in like:
        size = int(np.prod(leaf.shape, dtype=np.int64))
        out.append(x[start : start + size].reshape(leaf.shape).astype(leaf.dtype))
        start += size
    return out


def member_dim(shapes) -> int:
    """``d``: the number of elements of one member's pytree."""
    return int(sum(int(np.prod(s, dtype=np.int64)) for s in shapes))


def op_params(module, op) -> DdpParams:
    """The parameters of a ``fed.ddp_*`` op of ``module`` (cardinality from the module,
    dimension from the operands' member types)."""
    n = module.cardinality(op.operands[0].type.placement)
    dim = member_dim(v.type.member.shape for v in op.operands[:-1])
    return attr_params(op.attrs, dim, n, op.name)


def attr_params(attrs, dim: int, n: int, what: str) -> DdpParams:
    """``params`` from a ``fed.ddp_*`` op's attributes (``min_clients`` optional)."""
    return params(
        dim,
        n,
        attrs["clip_norm"],
        attrs["noise_multiplier"],
        attrs["bits"],
        what,
        min_clients=attrs.get("min_clients"),
    )


def noise_multiplier_for(
    target: float,
    dim: int,
    n: int,
    clip_norm: float,
    bits: int,
    tol: float = 1e-9,
    conditional: bool = True,
    min_clients: int | None = None,
) -> float:
    """The ``noise_multiplier`` of a ``ddp_*`` op that fcir.privacy accounts exactly as
    central DP with noise multiplier ``target`` (the same ε for any rounds, delta and
    accountant "rdp"): ``rdp_noise_multiplier`` is increasing in the noise multiplier,
    so bisection finds it. IRTypeError when ``bits`` cannot reach ``target`` (the
    rounding's share of the sensitivity stays too large)."""

    def accounted(z):
        p = params(
            dim, n, clip_norm, z, bits, "fcir.ddp.noise_multiplier_for", conditional, min_clients
        )
        return rdp_noise_multiplier(p)

    lo, hi = float(target), float(target)
    while accounted(hi) < target:
        hi *= 2
        if hi > 1e6 * max(target, 1.0):
            raise IRTypeError(
                f"fcir.mechanisms.ddgauss: bits={bits} cannot match central DP's noise multiplier "
                f"{target:g} for {dim} elements and {n} clients: use more bits"
            )
    while hi - lo > tol * hi:
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if accounted(mid) < target else (lo, mid)
    return hi
