"""``fed.geometric_median``: ``iters`` Weiszfeld steps from the mean, and the public
function ``reduce_geometric_median``.

``z_0`` is the members' mean; each step is ``z <- sum_i w_i x_i / sum_i w_i`` with
``w_i = 1 / max(||x_i - z||, eps)``, the norm over the whole member value (the public
function flattens a pytree into one vector per member first, ``fcir.fed.krum``'s
``flatten_members``, so the norm covers every leaf). Computed in float32 or wider,
rounded to the member dtype once at the end. The sums over members add one member
after another in member order, and a norm's squares in ``fcir.fed.krum.row_sums``'s
order (``weiszfeld_fold``): a stream over chunks of members adds the same numbers in
the same order, so streamed and unstreamed agree to the bit. A NaN member makes every coordinate NaN
(its norm is NaN); ``eps`` bounds every weight, so a step never divides by zero.

Not secure: whoever aggregates sees every member's value.

Derivative: through the unrolled steps. With ``S = sum w_i x_i``, ``W = sum w_i``:
``dz' = (dS - z' dW) / W``, ``dS = sum(dw_i x_i + w_i dx_i)``, ``dw_i = -w_i^2 <x_i - z,
dx_i - dz> / ||x_i - z||`` where the norm exceeds ``eps`` (else 0). Each step is one
``fed_map`` for the weights (primal) and one for the tangent terms (linear in ``dx``,
``dz``), then ``fed.sum``: the gradient program stays federated and grows with
``iters``.
"""

from __future__ import annotations

import numpy as np

from fcir.ir.types import TensorType
from fcir.opkit import autodiff as AD
from fcir.opkit import primitives as P

from .base import Reduction, public
from .broadcast import broadcast_p
from .krum import _float, _int_attr, flatten_members, int_arg, row_sums, unrolled_batch
from .map import member_map
from .mean import mean_p
from .sum import sum_p

__all__ = ["GeometricMedian", "geometric_median_p", "reduce_geometric_median"]


def weiszfeld_fold(total, rows, z, p, eps, valid=None):
    """``total``, the running ``(sum_i w_i x_i, sum_i w_i)``, after the rows ``x_i`` of
    ``rows`` (``[k, s]``, float32 or wider) added one by one in their order (``valid``:
    which rows to add); in pass ``p = 0`` every ``w_i`` is 1 (the mean), after it ``1 /
    max(||x_i - z||, eps)``. The same adds in the same order whether the members come
    all at once or a chunk at a time: a streamed Weiszfeld step has the unstreamed
    one's bits. Self-contained: the Flower app copies its source."""
    import jax
    import jax.numpy as jnp

    w = 1 / jnp.maximum(jnp.sqrt(row_sums(jnp.square(rows - z))), eps)
    w = jnp.where(p == 0, jnp.ones_like(w), w)

    def add(i, t):
        new = (t[0] + w[i] * rows[i], t[1] + w[i])
        if valid is None:
            return new
        return tuple(jnp.where(valid[i], a, b) for a, b in zip(new, t))

    return jax.lax.fori_loop(0, rows.shape[0], add, total)


class GeometricMedian(Reduction):
    """``iters`` Weiszfeld steps from the mean: ``{fN[s]}@child -> fN[s]``. Not secure:
    the aggregator sees every value."""

    name = "fed.geometric_median"
    attributes = {"iters": int, "eps": float}
    constraints = {
        **Reduction.constraints,
        "C4": "operand must be a floating-point tensor",
        "C5": "attribute 'iters' must be an int >= 0",
        "C6": "attribute 'eps' must be a finite float > 0",
    }

    server_helpers = (row_sums, weiszfeld_fold)

    @staticmethod
    def server_aggregate(x, *, iters, eps):
        """Weiszfeld over the replies (axis 0), as a Flower ServerApp computes it
        (self-contained, with ``server_helpers``)."""
        import jax
        import jax.numpy as jnp
        import numpy as np

        acc = np.result_type(x.dtype, np.float32)
        flat = x.reshape(x.shape[0], -1).astype(acc)
        zero = (jnp.zeros(flat.shape[1:], acc), jnp.zeros((), acc))

        def one_pass(p, z):
            total, weight = weiszfeld_fold(zero, flat, z, p, eps)
            return total / weight

        z = jax.lax.fori_loop(0, iters + 1, one_pass, zero[0])
        return z.reshape(x.shape[1:]).astype(x.dtype)

    @classmethod
    def problem(cls, dtype: str, n: int | None, attrs: dict) -> tuple[str, str] | None:
        """The violated constraint (code, detail) or None: asked while tracing and by
        the checker."""
        if not _float(dtype):
            return "C4", f"operand member dtype {dtype}; cast it (x.astype(jnp.float32)) first"
        iters, eps = attrs.get("iters"), attrs.get("eps")
        if not _int_attr(iters) or iters < 0:
            return "C5", f"iters={iters!r}"
        if not isinstance(eps, float) or not np.isfinite(eps) or eps <= 0:
            return "C6", f"eps={eps!r}"
        return None

    @classmethod
    def extra(cls, op, t, ctx):
        if not isinstance(t.member, TensorType):
            cls.fail("C4", f"operand member type {t.member}")
        found = cls.problem(t.member.dtype, None, op.attrs)
        if found is not None:
            cls.fail(*found)

    @classmethod
    def reference(cls, x: np.ndarray, attrs: dict) -> np.ndarray:
        x = np.asarray(x)
        flat = x.reshape(x.shape[0], -1).astype(np.result_type(x.dtype, np.float32))
        z = flat.mean(axis=0)
        for _ in range(attrs["iters"]):
            dist = np.sqrt(np.sum(np.square(flat - z), axis=1))
            w = 1 / np.maximum(dist, np.asarray(attrs["eps"], flat.dtype))
            z = (w[:, None] * flat).sum(axis=0) / w.sum()
        return z.reshape(x.shape[1:]).astype(x.dtype)


def _abstract_eval(x, *, placement, n, **attrs):
    from fcir.ir.types import dtype_name

    member = P.member_aval(x, placement, n, GeometricMedian.name)
    found = GeometricMedian.problem(dtype_name(member.dtype), n, attrs)
    if found is not None:
        raise GeometricMedian.error(*found)
    return member.update(weak_type=False)


def _lower(x, *, placement, n, **attrs):
    # The Flower app's copy of the op (server_aggregate) is the op's one definition.
    del placement, n
    return GeometricMedian.server_aggregate(x, **attrs)


geometric_median_p = P.define_primitive(
    "fed_geometric_median", _lower, _abstract_eval, unrolled_batch(lambda: geometric_median_p)
)
GeometricMedian.primitive = geometric_median_p


# --- derivative -------------------------------------------------------------------------


def _weights_region(eps: float):
    def weights(x, z):
        import jax.numpy as jnp

        w = 1 / jnp.maximum(jnp.sqrt(jnp.sum(jnp.square(x - z))), eps)
        return [w * x, w]

    return weights


def _tangent_region(eps: float):
    def tangent(x, z, dx, dz):
        import jax.numpy as jnp

        diff = x - z
        dist = jnp.sqrt(jnp.sum(jnp.square(diff)))
        far = dist > eps
        w = 1 / jnp.maximum(dist, eps)
        ddist = jnp.sum(diff * (dx - dz)) / jnp.where(far, dist, 1.0)
        dw = jnp.where(far, -w * w * ddist, 0.0)
        return [dw * x + w * dx, dw]

    return tangent


def _cast_region(dtype: str):
    def cast(x):
        return [x.reshape(-1).astype(dtype)]

    return cast


def _jvp(primals, tangents, *, placement, n, iters, eps):
    (x,), (t,) = primals, tangents
    ans = geometric_median_p.bind(x, placement=placement, n=n, iters=iters, eps=eps)
    if AD.is_zero(t):
        return ans, AD.zero_tangent(ans)
    kw = {"placement": placement, "n": n}
    acc = np.dtype(np.result_type(x.dtype, np.float32)).name
    (xf,) = member_map(_cast_region, (acc,), placement, n, x)
    (tf,) = member_map(_cast_region, (acc,), placement, n, t)
    z, dz = mean_p.bind(xf, **kw), mean_p.bind(tf, **kw)
    for _ in range(iters):
        zb, dzb = broadcast_p.bind(z, **kw), broadcast_p.bind(dz, **kw)
        wx, w = member_map(_weights_region, (eps,), placement, n, xf, zb)
        dwx, dw = member_map(_tangent_region, (eps,), placement, n, xf, zb, tf, dzb)
        s, total = sum_p.bind(wx, **kw), sum_p.bind(w, **kw)
        z = s / total
        dz = (sum_p.bind(dwx, **kw) - z * sum_p.bind(dw, **kw)) / total
    return ans, dz.reshape(ans.shape).astype(ans.dtype)


AD.def_jvp(geometric_median_p, _jvp)


@public
def reduce_geometric_median(x, iters: int = 8, eps: float = 1e-8):
    """The geometric median of the members by ``iters`` Weiszfeld steps from their
    mean: ``{T}@child -> T@p``.

    Each step weighs member ``i`` by ``1 / max(||x_i - z||, eps)``, the norm over every
    leaf of the pytree together. A robust aggregate, not a secure one: whoever
    aggregates sees every member's value. Differentiable through the unrolled steps.
    """
    from fcir.errors import PlacementError

    what = "fcir.reduce_geometric_median"
    iters = int_arg(what, "iters", iters)
    if isinstance(eps, bool) or not isinstance(eps, (int, float, np.integer, np.floating)):
        raise PlacementError(f"{what}: eps must be a Python number, got {eps!r}")
    flat, name, n, unflatten = flatten_members(x, what)
    y = geometric_median_p.bind(flat, placement=name, n=n, iters=iters, eps=float(eps))
    return unflatten(y, 0)
