"""``fed.ddp_sum``: distributed DP through secure aggregation (the distributed discrete
Gaussian of KLS21; the numerics and their bounds are ``fcir.mechanisms.ddgauss``'s, the frontend
``ddp_release``, the trust model docs/privacy.md).

``({T1}@child, ..., {Tk}@child, {K}@child) -> (T1, ..., Tk)``: the placed leaves of one
pytree, then one PRNG key per member (``K`` is ``key<...>[]`` or ``u32[2]``), results
local to the current placement. Attributes: ``clip_norm``, ``noise_multiplier`` (as
``fed.dp_*``) and ``bits``, the width of the secure sum. ``fed.ddp_mean``
(``fcir.fed.ddp_mean``) shares the primitive's impl, abstract evaluation and derivative.
"""

from __future__ import annotations

import functools

import jax
import numpy as np

from fcir.errors import PlacementError
from fcir.ir.types import PlacedType, TensorType
from fcir.mechanisms import ddgauss as ddp
from fcir.opkit import autodiff as AD
from fcir.opkit import placement as api
from fcir.opkit import primitives as P

from .base import FedOp, public
from .dp_sum import (
    DpSum,
    check_leaves_then_key,
    check_noise_and_values,
    define_dp,
    dp_jvp,
    float_members,
)

__all__ = ["DdpSum", "ddp_release", "ddp_sum", "ddp_sum_p", "define_ddp"]


class DdpSum(FedOp):
    """Distributed discrete Gaussian sum (``fcir.mechanisms.ddgauss``): each member clips, rotates,
    quantizes and noises its pytree into integers modulo ``2**bits`` with its own key;
    the secure sum of those is decoded where the result lives."""

    name = "fed.ddp_sum"
    kind = "ddp"
    multiple_results = True
    attributes = {"clip_norm": float, "noise_multiplier": float, "bits": int}
    # Present only when declared below the cardinality (``fcir.mechanisms.ddgauss``,
    # "Dropouts"): the fewest clients whose noise shares the release must carry.
    optional_attributes = {"min_clients": int}
    constraints = {
        "C1": "takes k >= 1 value operands followed by one keys operand, and gives k results",
        "C2": "value operands must be placed at the placement directly below the current one",
        "C3": "the last operand must hold one PRNG key (key<...>[] or u32[2]) per member, "
        "placed like the values and not all-equal (every member needs its own key)",
        "C4": "value operands must be floating-point tensors",
        "C5": "attribute 'clip_norm' must be a finite float > 0 and 'noise_multiplier' a "
        "finite float >= 0",
        "C6": "result i must be operand i's member type, local to the current placement",
        "C7": f"attribute 'bits' must be an int in [{ddp.MIN_BITS}, {ddp.MAX_BITS}]",
        "C8": "attribute 'min_clients', when present, must be an int in [1, n) "
        "(n the cardinality of the placement summed over; absent means n)",
    }
    placement_constraints = frozenset({"C2", "C3"})

    @classmethod
    def placed_operands(cls, n_operands: int) -> range:
        return range(n_operands)  # the keys are placed at the members too

    @classmethod
    def verify(cls, op, ctx):
        check_leaves_then_key(cls, op)
        keys = op.operands[-1].type
        if not isinstance(keys, PlacedType) or not (
            isinstance(keys.member, TensorType)
            and DpSum.is_key(keys.member.dtype, keys.member.shape)
        ):
            cls.fail("C3", f"keys operand has type {keys}")
        if keys.all_equal:
            cls.fail(
                "C3",
                f"keys operand has all-equal type {keys}: one key broadcast to "
                "every member; pass per-member keys (jax.random.split) as client data",
            )
        cls.placed_operand(ctx, op.operands[-1], "C3")
        check_noise_and_values(cls, op, ctx)
        bits = op.attrs.get("bits")
        if (
            isinstance(bits, bool)
            or not isinstance(bits, int)
            or not (ddp.MIN_BITS <= bits <= ddp.MAX_BITS)
        ):
            cls.fail("C7", f"bits={bits!r}")
        if "min_clients" in op.attrs:
            m = op.attrs["min_clients"]
            p = op.operands[0].type
            n = ctx.cardinality.get(p.placement) if isinstance(p, PlacedType) else None
            if (
                isinstance(m, bool)
                or not isinstance(m, int)
                or m < 1
                or (isinstance(n, int) and m >= n)
            ):
                cls.fail("C8", f"min_clients={m!r}, cardinality {n}")


# --- the primitive (operands: the placed leaves of one pytree, then the members' keys) ----


def _impl(*args, placement, n, clip_norm, noise_multiplier, bits, mean, min_clients=None):
    del placement
    *xs, keys = args
    p = ddp.params(
        ddp.member_dim(x.shape[1:] for x in xs),
        n,
        clip_norm,
        noise_multiplier,
        bits,
        min_clients=min_clients,
    )
    encoded = ddp.encode_batch(xs, keys, p)
    like = [jax.ShapeDtypeStruct(x.shape[1:], x.dtype) for x in xs]
    return ddp.decode(ddp.aggregate(encoded, p), p, like, mean)


def _abstract_eval(
    op, *avals, placement, n, clip_norm, noise_multiplier, bits, mean, min_clients=None
):
    *xs, keys = avals
    if not xs:
        raise op.error("C1", "no value leaf before the keys")
    member_key = P.member_aval(keys, placement, n, f"{op.name} keys")
    if not P.is_key(member_key):
        raise op.error(
            "C3",
            f"got {keys.str_short()}; pass jax.random.split(key, n) (or raw "
            "uint32[n, 2]) as client data",
        )
    out = float_members(op, xs, placement, n)
    ddp.params(
        ddp.member_dim(x.shape[1:] for x in xs),
        n,
        clip_norm,
        noise_multiplier,
        bits,
        op.name,
        min_clients=min_clients,
    )
    return out


def define_ddp(op: type[FedOp], mean: bool):
    """The primitive of ``op`` (``fed.ddp_sum`` or, with ``mean``, ``fed.ddp_mean``),
    with its derivative: like ``fed.dp_*``, the noise and the rounding are constants."""
    prim = define_dp(
        "fed_" + op.name.removeprefix("fed."),
        functools.partial(_impl, mean=mean),
        functools.partial(_abstract_eval, op, mean=mean),
        compiled=True,  # float32 and integer ops only; op by op it takes seconds
    )
    AD.def_jvp(prim, functools.partial(dp_jvp, prim, mean))
    op.primitive = prim
    return prim


ddp_sum_p = define_ddp(DdpSum, mean=False)


def ddp_release(prim, what: str, x, clip_norm, noise_multiplier, keys, bits, min_clients=None):
    """Binds distributed DP aggregate ``prim`` on placed pytree ``x`` from the public
    functions (``fcir.ddp_sum``, ``fcir.ddp_mean``), its static attributes checked first."""
    frame = api._current(what)
    name, n = frame.child(what)
    clip = api._dp_static(what, "clip_norm", clip_norm, 0.0, True)
    z = api._dp_static(what, "noise_multiplier", noise_multiplier, 0.0, False)
    if isinstance(bits, (bool, np.bool_)) or not isinstance(bits, (int, np.integer)):
        raise PlacementError(f"{what}: bits must be a Python int, got {bits!r}")
    bits = int(bits)
    if not ddp.MIN_BITS <= bits <= ddp.MAX_BITS:
        raise PlacementError(
            f"{what}: bits must be in [{ddp.MIN_BITS}, {ddp.MAX_BITS}], got {bits}"
        )
    leaves, tree = api._flatten(x)
    if not leaves:
        raise PlacementError(f"{what}: x has no array leaves")
    api._check_placed(leaves, name, n, what)
    if not isinstance(keys, jax.Array) and not hasattr(keys, "aval"):
        keys = jax.numpy.asarray(keys)
    api._check_placed([keys], name, n, f"{what} (keys: one PRNG key per member of '{name}')")
    if min_clients is not None:
        if isinstance(min_clients, (bool, np.bool_)) or not isinstance(
            min_clients, (int, np.integer)
        ):
            raise PlacementError(f"{what}: min_clients must be a Python int, got {min_clients!r}")
        min_clients = int(min_clients)
        if not 1 <= min_clients <= n:
            raise PlacementError(
                f"{what}: min_clients must be in [1, {n}] (the number of '{name}'), got "
                f"{min_clients}"
            )
        if min_clients == n:
            min_clients = None  # the default: the IR stays as without it
    out = prim.bind(
        *leaves,
        keys,
        placement=name,
        n=n,
        clip_norm=clip,
        noise_multiplier=z,
        bits=bits,
        min_clients=min_clients,
    )
    return jax.tree_util.tree_unflatten(tree, out)


@public
def ddp_sum(x, clip_norm, noise_multiplier, keys, bits=20, *, min_clients=None):
    """Distributed DP sum: ``{T}@child -> T@p`` for a placed pytree ``x``, through a
    secure sum modulo ``2**bits``.

    ``keys`` holds one PRNG key per member (``jax.random.split(key, n)`` passed as client
    data, ``{key}@clients``). Each member clips its pytree to global L2 norm
    ``clip_norm``, rotates, scales and rounds it to integers at random and adds its share
    of discrete Gaussian noise, so that the sum carries noise of std ``noise_multiplier
    * clip_norm`` in the update's units; the server decodes the modular sum and never
    holds an individual or un-noised value (``fcir.ddp``). ``clip_norm``,
    ``noise_multiplier`` and ``bits`` are Python numbers (attributes of the op, read by
    ``fcir.privacy.epsilon``). Gradients treat the noise and the rounding as constants.

    ``min_clients`` (default: all of them) is the fewest clients whose noise shares the
    release must carry: each client adds the noise for ``min_clients`` shares, the
    accountant assumes only that many, and a runtime that gets fewer replies (Flower,
    a production plan) refuses the round instead of releasing it (docs/privacy.md,
    "Dropouts").
    """
    return ddp_release(
        ddp_sum_p, "fcir.ddp_sum", x, clip_norm, noise_multiplier, keys, bits, min_clients
    )
