"""Automatic differentiation rules for the federated primitives.

Importing ``fcir`` registers them. With these rules ``jax.jvp``, ``jax.linearize``,
``jax.vjp``/``jax.grad``, ``jax.jacfwd``/``jax.jacrev``/``jax.hessian``,
``jax.checkpoint`` and ``jax.vmap`` of any of them work on federated programs, under
``jax.jit`` and without it, and the derivative stays federated.

Design (the "federated-ness" rule every rule here obeys)
--------------------------------------------------------
A rule only ever emits

* fed primitives (``fed_broadcast``, ``fed_map``, ``fed_sum``, ``fed_mean`` ...), and
* local ops that either act on *server* values (the operands of the reductions'
  results, e.g. ``ct / n`` before a broadcast) or act per member *inside a*
  ``fed_map`` *region*.

So a rule never reduces over the member axis with a plain ``jnp`` op and never does
per-member arithmetic at top level. Per-member arithmetic that a rule needs (the
arg-min indicator of ``fed.min``, the weighted-mean tangent) is written as a small
function over one member's values, traced once per member type (cached) and bound as a
``fed_map`` region. The only top-level ops on placed values that can still appear in a
derivative are those JAX's own AD machinery inserts for any primitive: ``add_any``
accumulating the cotangents of a placed value used twice, which is elementwise on
same-shape placed values (member-wise, no cross-member flow).

Per primitive
-------------
``fed.broadcast``   linear. JVP: broadcast the tangent. Transpose: ``fed.sum`` (same
                    placement and cardinality), so the cotangent of a server value that
                    was broadcast is the federated sum of the members' cotangents.
``fed.sum``         linear. JVP: sum of tangents. Transpose: ``fed.broadcast``.
``fed.mean``        linear for inexact dtypes. Transpose: ``broadcast(ct / n)`` (the
                    division is done once, on the server value, exactly what
                    ``jnp.mean``'s VJP does). ``mean`` of ints/bools is float32 but its
                    input has no tangent: the output tangent is a symbolic zero and no
                    cotangent flows back (integer inputs are not differentiable).
``fed.weighted_mean``  ``y = sum(w x) / W`` with ``W = sum(w)``; nonlinear in ``w``:
                    ``dy = sum_members(w dx + dw (x - y)) / W``. The bracket is a
                    ``fed_map`` region over ``(w, x, broadcast(y), dx, dw)``, linear in
                    ``(dx, dw)``; the member sum is ``fed.sum`` and the division by ``W``
                    happens on the server. Partial evaluation splits the region into a
                    known map (residuals ``w``, ``x - y`` stay placed) and a linear map,
                    so the VJP is ``broadcast(ct / W)`` followed by a member-wise map.
                    Integer values or weights contribute no tangent.
``fed.min/max``     the subgradient JAX uses for ``jnp.min``/``jnp.max``
                    (``lax._reduce_chooser_jvp_rule``): the tangent of the arg-min
                    member; on ties the tangent is the *average* of the tied members'
                    tangents (so the cotangent is split equally among them). Federated
                    form: a known ``fed_map`` computes the per-member indicator
                    ``x == broadcast(ans)``, ``count = fed.sum(indicator)``; the tangent
                    is ``fed.sum(map(g * indicator)) / count``. Integer inputs: zero.
``fed.secure_sum``  integer-only (modular arithmetic): the tangent is always a
                    symbolic zero (``float0``); it is never linear, so it has no
                    transpose.
``fed.dp_sum/mean`` the noise is a constant (it depends on the key only), so the
                    tangent is the sum of the members' clip tangents:
                    ``fed.sum(map(jvp(clip)))`` (divided by n for the mean, on the
                    server). The map region is linear in the tangents, so partial
                    evaluation splits it like weighted_mean's and the VJP is a broadcast
                    followed by a member-wise map (clipping differentiated per member).
``fed.map``         higher-order: JVP maps the body's JVP (``ad.jvp_jaxpr``); direct
                    linearization maps ``ad.linearize_jaxpr``'s primal jaxpr and its
                    tangent jaxpr; partial evaluation (``JaxprTrace`` and the
                    ``partial_eval_jaxpr_custom`` used by remat and jit) splits the body
                    into a known map that *outputs its residuals placed at the members*
                    (leading axis n) and an unknown map that consumes them; residuals
                    that are just (placed) map operands are forwarded, residuals that
                    are constants of the body are baked into the unknown body as
                    constants (never broadcast, never moved to the server). Transpose
                    maps the body's backward pass (``ad.backward_pass``), consuming the
                    placed residuals and the placed cotangents and producing placed
                    cotangents. DCE prunes unused outputs and the body's dead code.
                    Symbolic zeros (``ad.Zero``) are never instantiated: zero tangents /
                    cotangents are dropped from the region's signature.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from fcir import jaxcompat as jc
from fcir.jaxcompat import (
    ad,
    ad_util,
    core,
    dtypes,
    merge_lists,
    partition_list,
    pe,
    source_info_util,
    split_list,
    weakref_lru_cache,
)
from fcir.primitives import (
    broadcast_p,
    clip_member,
    dp_mean_p,
    dp_sum_p,
    map_p,
    max_p,
    mean_p,
    mean_result_dtype,
    min_p,
    secure_sum_p,
    sum_p,
    weighted_mean_p,
)

__all__ = ["def_jvp", "is_zero", "member_map", "zero_tangent"]

Zero = ad_util.Zero


# --- helpers --------------------------------------------------------------------------------


def _is_zero(t) -> bool:
    """True for a symbolic zero or a ``float0`` tangent (the tangent of an int/bool)."""
    if type(t) is Zero:
        return True
    return getattr(core.typeof(t), "dtype", None) == dtypes.float0


def _inexact(dtype) -> bool:
    return dtypes.issubdtype(dtype, np.inexact)


def _member_aval(aval) -> core.ShapedArray:
    """One member's type: the placed type without its leading (member) axis."""
    sharding = aval.sharding
    spec = PartitionSpec(*sharding.spec[1:])
    return aval.update(shape=aval.shape[1:], sharding=sharding.update(spec=spec))


def _map_out_avals(in_avals, body, placement: str, n: int):
    """The placed result types of ``fed_map`` (its own abstract evaluation)."""
    out_avals, _ = map_p.abstract_eval(*in_avals, body=body, placement=placement, n=n)
    return out_avals


def _trace_region(fn, avals, name: str) -> jc.ClosedJaxpr:
    """Traces ``fn`` over one member's values (``avals``) to a closed region."""
    return jc.trace_closed(fn, avals, f"fcir.{name}")


@functools.lru_cache(maxsize=4096)
def _cached_region(builder, member_avals: tuple, static: tuple) -> jc.ClosedJaxpr:
    return _trace_region(builder(*static), member_avals, builder.__name__)


def member_map(builder, static: tuple, placement: str, n: int, *placed):
    """Binds ``fed_map`` with the region ``builder(*static)`` traced over member types.

    ``builder(*static)`` returns a function of one member's values returning a list.
    Regions are cached per (builder, member types, static), so a rule emits the same
    region object each time (deterministic IR, cache-friendly).
    """
    avals = tuple(_member_aval(core.typeof(x)) for x in placed)
    body = _cached_region(builder, avals, tuple(static))
    return map_p.bind(*placed, body=body, placement=placement, n=n)


def _bake_const_residuals(jaxpr: jc.ClosedJaxpr, is_const, const_vals, num_rest: int):
    """Turns the leading residual binders flagged ``is_const`` into constants of ``jaxpr``.

    ``jaxpr`` takes ``[*residuals, *rest]``. Residuals that are constants of the
    original body stay constants of the new body instead of being materialised per
    member (or shipped from the server).
    """
    if not any(is_const):
        return jaxpr
    moved = pe.move_binders_to_front(jaxpr, [*is_const, *([False] * num_rest)])
    k = sum(is_const)
    assert not moved.jaxpr.constvars and not moved.consts
    assert k == len(const_vals)
    return jc.with_leading_consts(moved, const_vals)


def _split_fwd_residuals(fwds, num_consts, consts, ins, ext_res):
    """Residual values for the staged map, from forwarding info.

    ``fwds[i]`` is None (a residual output of the known map, ``ext_res``), an index
    below ``num_consts`` (a constant of the body) or an index into ``ins`` shifted by
    ``num_consts`` (a forwarded, already placed, map operand).
    Returns ``(is_const, const_vals, placed_residuals)``.
    """
    ext = iter(ext_res)
    is_const, const_vals, placed = [], [], []
    for f in fwds:
        if f is None:
            is_const.append(False)
            placed.append(next(ext))
        elif f < num_consts:
            is_const.append(True)
            const_vals.append(consts[f])
        else:
            is_const.append(False)
            placed.append(ins[f - num_consts])
    assert next(ext, None) is None
    return is_const, const_vals, placed


# --- fed.broadcast / fed.sum / fed.mean -----------------------------------------------------


def _linear_jvp(prim):
    """JVP of a primitive linear in its operand: the same primitive on the tangent.
    Integer and bool operands (e.g. the f32 mean of ints) have no tangent."""

    def jvp(primals, tangents, *, placement, n):
        (x,), (t,) = primals, tangents
        y = prim.bind(x, placement=placement, n=n)
        if _is_zero(t) or not _inexact(core.typeof(x).dtype):
            return y, ad_util.p2tz(y)
        return y, prim.bind(t, placement=placement, n=n)

    return jvp


def _broadcast_transpose(ct, x, *, placement, n):
    assert ad.is_undefined_primal(x)
    if type(ct) is Zero:
        return [Zero(x.aval.to_ct_aval())]
    return [sum_p.bind(ct, placement=placement, n=n)]


def _sum_transpose(ct, x, *, placement, n):
    assert ad.is_undefined_primal(x)
    if type(ct) is Zero:
        return [Zero(x.aval.to_ct_aval())]
    return [broadcast_p.bind(ct, placement=placement, n=n)]


def _mean_transpose(ct, x, *, placement, n):
    assert ad.is_undefined_primal(x)
    if type(ct) is Zero:
        return [Zero(x.aval.to_ct_aval())]
    # Scale once on the server, then broadcast: jnp.mean's VJP computes ct / n too.
    return [broadcast_p.bind(ct / n, placement=placement, n=n)]


ad.primitive_jvps[broadcast_p] = _linear_jvp(broadcast_p)
ad.primitive_transposes[broadcast_p] = _broadcast_transpose
ad.primitive_jvps[sum_p] = _linear_jvp(sum_p)
ad.primitive_transposes[sum_p] = _sum_transpose
ad.primitive_jvps[mean_p] = _linear_jvp(mean_p)
ad.primitive_transposes[mean_p] = _mean_transpose


def def_jvp(prim, rule) -> None:
    """Registers ``rule(primals, tangents, **params) -> (out, tangent_out)`` as the JVP
    of ``prim``, for fed op modules that define their primitive and rules together."""
    ad.primitive_jvps[prim] = rule


def is_zero(t) -> bool:
    """True for a tangent that is a symbolic zero (or ``float0``)."""
    return _is_zero(t)


def zero_tangent(primal):
    """The symbolic zero tangent of ``primal``."""
    return ad_util.p2tz(primal)


# --- fed.min / fed.max ----------------------------------------------------------------------


def _indicator_region(dtype):
    def indicator(x, ans):
        return [(x == ans).astype(dtype)]

    return indicator


def _masked_region():
    def masked(g, ind):
        return [g * ind]

    return masked


def _chooser_jvp(prim, primals, tangents, *, placement, n):
    (x,), (g,) = primals, tangents
    ans = prim.bind(x, placement=placement, n=n)
    dtype = core.typeof(x).dtype
    if _is_zero(g) or not _inexact(dtype):
        return ans, ad_util.p2tz(ans)
    # Same subgradient as lax._reduce_chooser_jvp_rule (jnp.min/jnp.max): average the
    # tangents of the members attaining the extremum. Everything per member happens in
    # fed_map regions; the division by the tie count happens on the server.
    ans_at_members = broadcast_p.bind(ans, placement=placement, n=n)
    (ind,) = member_map(_indicator_region, (np.dtype(dtype),), placement, n, x, ans_at_members)
    count = sum_p.bind(ind, placement=placement, n=n)
    (picked,) = member_map(_masked_region, (), placement, n, g, ind)
    return ans, sum_p.bind(picked, placement=placement, n=n) / count


ad.primitive_jvps[min_p] = functools.partial(_chooser_jvp, min_p)
ad.primitive_jvps[max_p] = functools.partial(_chooser_jvp, max_p)


# --- fed.weighted_mean ----------------------------------------------------------------------


def _weighted_tangent_region(dtype, has_dx: bool, has_dw: bool):
    def weighted_tangent(w, x, y, *ts):
        ts = list(ts)
        dx = ts.pop(0) if has_dx else None
        dw = ts.pop(0) if has_dw else None
        expand = (1,) * (x.ndim - w.ndim)
        out = None
        if has_dx:
            out = w.astype(dtype).reshape(w.shape + expand) * dx
        if has_dw:
            dev = x.astype(dtype) - y
            term = dw.astype(dtype).reshape(w.shape + expand) * dev
            out = term if out is None else out + term
        return [out]

    return weighted_tangent


def _cast_region(dtype):
    def cast(w):
        return [w.astype(dtype)]

    return cast


def _weighted_mean_jvp(primals, tangents, *, placement, n):
    (x, w), (dx, dw) = primals, tangents
    y = weighted_mean_p.bind(x, w, placement=placement, n=n)
    x_aval, w_aval = core.typeof(x), core.typeof(w)
    has_dx = not _is_zero(dx) and _inexact(x_aval.dtype)
    has_dw = not _is_zero(dw) and _inexact(w_aval.dtype)
    if not (has_dx or has_dw):
        return y, ad_util.p2tz(y)
    dt = np.dtype(mean_result_dtype(x_aval.dtype))
    # W = sum of the weights (in the result dtype, as the primal computes it).
    w_dt = w if w_aval.dtype == dt else member_map(_cast_region, (dt,), placement, n, w)[0]
    total = sum_p.bind(w_dt, placement=placement, n=n)
    y_at_members = broadcast_p.bind(y, placement=placement, n=n)
    ts = [t for t, has in ((dx, has_dx), (dw, has_dw)) if has]
    (num_members,) = member_map(
        _weighted_tangent_region, (dt, has_dx, has_dw), placement, n, w, x, y_at_members, *ts
    )
    num = sum_p.bind(num_members, placement=placement, n=n)
    total = total.reshape(total.shape + (1,) * (num.ndim - total.ndim))
    return y, num / total


ad.primitive_jvps[weighted_mean_p] = _weighted_mean_jvp


# --- fed.secure_sum -------------------------------------------------------------------------
# Integer-only modular sum: never differentiable, the tangent is a symbolic zero.

ad.defjvp_zero(secure_sum_p)


# --- fed.dp_sum / fed.dp_mean ---------------------------------------------------------------


def _clip_tangent_region(clip_norm: float, nonzero: tuple[bool, ...]):
    def clip_tangent(*args):
        k = len(nonzero)
        xs, given = list(args[:k]), iter(args[k:])
        ts = [next(given) if nz else jnp.zeros_like(x) for x, nz in zip(xs, nonzero)]
        _, out = jax.jvp(lambda *m: clip_member(m, clip_norm), xs, ts)
        return list(out)

    return clip_tangent


def dp_jvp(prim, mean: bool, primals, tangents, **params):
    """The JVP of a DP aggregate (``fed.dp_*``, ``fed.ddp_*``, whose modules register it
    with ``def_jvp``): the noise (and ddp's rounding) is a constant, so the tangent is
    the sum (mean) of the members' clipped tangents. The last operand is the key(s)."""
    *xs, _ = primals
    ys = prim.bind(*primals, **params)
    nonzero = tuple(not _is_zero(t) for t in tangents[:-1])
    if not any(nonzero):
        return ys, [ad_util.p2tz(y) for y in ys]
    ts = [t for t, nz in zip(tangents, nonzero) if nz]
    placement, n = params["placement"], params["n"]
    clipped = member_map(
        _clip_tangent_region, (params["clip_norm"], nonzero), placement, n, *xs, *ts
    )
    out = [sum_p.bind(c, placement=placement, n=n) for c in clipped]
    return ys, [o / n for o in out] if mean else out


ad.primitive_jvps[dp_sum_p] = functools.partial(dp_jvp, dp_sum_p, False)
ad.primitive_jvps[dp_mean_p] = functools.partial(dp_jvp, dp_mean_p, True)


# --- fed.map: JVP ---------------------------------------------------------------------------


def _map_jvp(primals, tangents, *, body, placement, n):
    nzs = [not _is_zero(t) for t in tangents]
    body_jvp, nzs_out = ad.jvp_jaxpr(body, nzs, instantiate=False)
    nz_tangents = [t for t, nz in zip(tangents, nzs) if nz]
    outs = map_p.bind(*primals, *nz_tangents, body=body_jvp, placement=placement, n=n)
    primals_out, nz_tangents_out = split_list(outs, [len(body.out_avals)])
    it = iter(nz_tangents_out)
    tangents_out = [next(it) if nz else ad_util.p2tz(p) for p, nz in zip(primals_out, nzs_out)]
    assert next(it, None) is None
    return primals_out, tangents_out


ad.primitive_jvps[map_p] = _map_jvp


# --- fed.map: direct linearization ----------------------------------------------------------


def _map_linearize(is_vjp, nzs, *primals, body, placement, n):
    nzs = [nz and _inexact(a.dtype) for nz, a in zip(nzs, body.in_avals)]
    num_consts = len(body.consts)
    primal_jaxpr, num_res, nzs_out, fwds, tangent_jaxpr = jc.linearize_jaxpr(
        body, nzs, instantiate=False, allow_fwds=True, is_vjp=is_vjp
    )
    num_out = len(body.out_avals)
    # Known map: primal outputs plus the non-forwarded residuals, placed at the members.
    outs = map_p.bind(*primals, body=primal_jaxpr, placement=placement, n=n)
    primals_out, ext_res = split_list(outs, [num_out])
    assert len(ext_res) == num_res
    is_const, const_vals, residuals = _split_fwd_residuals(
        fwds, num_consts, body.consts, primals, ext_res
    )
    num_nz_in = sum(nzs)
    tangent_body = _bake_const_residuals(tangent_jaxpr, is_const, const_vals, num_nz_in)
    tangent_avals_out = [core.typeof(p).to_tangent_aval() for p in primals_out]

    def tangent_fun(residuals, *tangents):
        nz_tangents = [ad.instantiate_zeros(t) for t, nz in zip(tangents, nzs) if nz]
        if any(nzs_out):
            nz_out = map_p.bind(
                *residuals, *nz_tangents, body=tangent_body, placement=placement, n=n
            )
        else:
            nz_out = []
        it = iter(nz_out)
        res = [next(it) if nz else Zero(a) for a, nz in zip(tangent_avals_out, nzs_out)]
        assert next(it, None) is None
        return res

    return primals_out, nzs_out, residuals, tangent_fun


jc.register_linearization(map_p, _map_linearize)


# --- fed.map: partial evaluation (JaxprTrace) -----------------------------------------------


def _map_partial_eval(trace, *tracers, body, placement, n):
    unknowns = [not t.pval.is_known() for t in tracers]
    if not any(unknowns):
        vals = [t.pval.get_known() for t in tracers]
        return map_p.bind(*vals, body=body, placement=placement, n=n)
    if all(unknowns):
        # Nothing to split off: stage the whole map (a known part would have no operands).
        return trace.default_process_primitive(
            map_p, tracers, dict(body=body, placement=placement, n=n)
        )
    # Known numpy operands are not forwarded (as in scan): they would become constants
    # of the staged jaxpr instead of placed values.
    fwd = [not isinstance(t.pval.get_known(), np.ndarray) for t in tracers]
    jaxpr_known, jaxpr_unknown, out_uk, res_avals, in_fwd_res = pe.partial_eval_jaxpr_nounits_fwd(
        body, unknowns, instantiate=False, fwd=fwd
    )
    num_known_out = len(jaxpr_known.out_avals) - len(res_avals)
    known_ins = [t.pval.get_known() for t in tracers if t.pval.is_known()]
    if jaxpr_known.out_avals or jaxpr_known.effects:
        known_outs_res = map_p.bind(*known_ins, body=jaxpr_known, placement=placement, n=n)
    else:
        known_outs_res = []
    known_outs, ext_res = split_list(known_outs_res, [num_known_out])
    is_const, const_vals, residuals = _split_fwd_residuals(
        in_fwd_res, len(body.consts), body.consts, known_ins, ext_res
    )
    num_unknown_in = sum(unknowns)
    unknown_body = _bake_const_residuals(jaxpr_unknown, is_const, const_vals, num_unknown_in)

    res_tracers = [trace.new_instantiated_const(r) for r in residuals]
    unknown_tracers = [t for t in tracers if not t.pval.is_known()]
    in_tracers = [*res_tracers, *unknown_tracers]
    out_avals = _map_out_avals([t.aval for t in in_tracers], unknown_body, placement, n)
    out_tracers = [pe.JaxprTracer(trace, pe.PartialVal.unknown(a), None) for a in out_avals]
    name_stack = source_info_util.current_name_stack()[len(trace.name_stack) :]
    source = source_info_util.current().replace(name_stack=name_stack)
    eqn = pe.new_eqn_recipe(
        trace,
        in_tracers,
        out_tracers,
        map_p,
        dict(body=unknown_body, placement=placement, n=n),
        core.positional_effects(unknown_body),
        source,
    )
    for t in out_tracers:
        t.recipe = eqn
    return merge_lists(out_uk, known_outs, out_tracers)


pe.custom_partial_eval_rules[map_p] = _map_partial_eval


# --- fed.map: partial_eval_jaxpr_custom (remat, jit partial eval) ---------------------------


def _map_partial_eval_custom(saveable, unks_in, inst_in, eqn):
    body = eqn.params["body"]
    placement, n = eqn.params["placement"], eqn.params["n"]
    if all(unks_in):
        # Nothing is known: stage the whole map (a known map would have no operands).
        new_inst = [x for x, inst in zip(eqn.invars, inst_in) if type(x) is core.Var and not inst]
        num_out = len(eqn.outvars)
        return None, eqn, [True] * num_out, [True] * num_out, new_inst
    jaxpr_known_, jaxpr_staged_, unks_out, inst_out, num_res = pe.partial_eval_jaxpr_custom(
        body.jaxpr,
        in_unknowns=unks_in,
        in_inst=True,
        ensure_out_unknowns=False,
        ensure_out_inst=True,
        saveable=saveable,
    )
    jaxpr_known = jc.closed_jaxpr(jaxpr_known_, body.consts)
    jaxpr_staged = jc.closed_jaxpr(jaxpr_staged_, body.consts)
    # Residuals are computed per member by the known map and stay placed (leading n).
    ins_known, _ = partition_list(unks_in, eqn.invars)
    known_out_avals = _map_out_avals([x.aval for x in ins_known], jaxpr_known, placement, n)
    residuals = [core.Var(a) for a in known_out_avals[len(known_out_avals) - num_res :]]
    outs_known, _ = partition_list(unks_out, eqn.outvars)
    if jaxpr_known.out_avals or jaxpr_known.effects:
        eqn_known = pe.new_jaxpr_eqn(
            ins_known,
            [*outs_known, *residuals],
            map_p,
            dict(body=jaxpr_known, placement=placement, n=n),
            core.eqn_effects(jaxpr_known, ins_known),
            eqn.source_info,
            eqn.ctx,
        )
    else:
        eqn_known = None
    # The staged map takes every operand (instantiated: DCE prunes the unused ones).
    new_inst = [x for x, inst in zip(eqn.invars, inst_in) if type(x) is core.Var and not inst]
    _, outs_staged = partition_list(inst_out, eqn.outvars)
    staged_in = [*residuals, *eqn.invars]
    eqn_staged = pe.new_jaxpr_eqn(
        staged_in,
        outs_staged,
        map_p,
        dict(body=jaxpr_staged, placement=placement, n=n),
        core.eqn_effects(jaxpr_staged, staged_in),
        eqn.source_info,
        eqn.ctx,
    )
    return eqn_known, eqn_staged, unks_out, inst_out, [*new_inst, *residuals]


pe.partial_eval_jaxpr_custom_rules[map_p] = _map_partial_eval_custom


# --- fed.map: dead-code elimination ---------------------------------------------------------


@weakref_lru_cache
def _dce_body(body: jc.ClosedJaxpr, used_outputs: tuple[bool, ...]):
    jaxpr, used_inputs = pe.dce_jaxpr(body.jaxpr, used_outputs)
    return jc.closed_jaxpr(jaxpr, body.consts), used_inputs


@weakref_lru_cache
def _dce_body_keep_first(body: jc.ClosedJaxpr, used_outputs: tuple[bool, ...]):
    keep = (True,) + (False,) * (len(body.jaxpr.invars) - 1)
    jaxpr, used_inputs = pe.dce_jaxpr(body.jaxpr, used_outputs, instantiate=keep)
    return jc.closed_jaxpr(jaxpr, body.consts), used_inputs


def _map_dce(used_outputs, eqn):
    body = eqn.params["body"]
    if not any(used_outputs) and not pe.has_effects(eqn):
        return [False] * len(eqn.invars), None
    used_outputs = tuple(used_outputs)
    new_body, used_inputs = _dce_body(body, used_outputs)
    if not any(used_inputs) and eqn.invars:
        # Keep one operand: a map needs at least one placed operand to carry its members.
        new_body, used_inputs = _dce_body_keep_first(body, used_outputs)
    new_invars = [v for v, u in zip(eqn.invars, used_inputs) if u]
    new_outvars = [v for v, u in zip(eqn.outvars, used_outputs) if u]
    new_eqn = pe.new_jaxpr_eqn(
        new_invars,
        new_outvars,
        map_p,
        dict(eqn.params, body=new_body),
        core.eqn_effects(new_body, new_invars),
        eqn.source_info,
        eqn.ctx,
    )
    return used_inputs, new_eqn


jc.register_dce_rule(map_p, _map_dce)


# --- fed.map: transpose ---------------------------------------------------------------------


@weakref_lru_cache
def _transpose_body(body: jc.ClosedJaxpr, linear: tuple[bool, ...], ct_nz: tuple[bool, ...]):
    """The per-member backward pass: ``(residuals, nonzero cts) -> nonzero input cts``.

    Returns the region and, per linear input, whether its cotangent is nonzero.
    """
    in_avals, out_avals = body.in_avals, body.out_avals
    res_avals = [a for a, lin in zip(in_avals, linear) if not lin]
    ct_avals = [a.to_ct_aval() for a, nz in zip(out_avals, ct_nz) if nz]
    cell = []

    def transposed(*args):
        res, cts_nz = split_list(args, [len(res_avals)])
        res_it, ct_it = iter(res), iter(cts_nz)
        primals = [
            ad.UndefinedPrimal(a) if lin else next(res_it) for a, lin in zip(in_avals, linear)
        ]
        cts = [next(ct_it) if nz else Zero(a.to_ct_aval()) for a, nz in zip(out_avals, ct_nz)]
        cts_out = ad.backward_pass(body.jaxpr, False, body.consts, primals, cts)
        lin_out = [ct for ct, lin in zip(cts_out, linear) if lin]
        nz_out = [not _is_zero(ct) for ct in lin_out]
        cell.append(nz_out)
        return [ct for ct, nz in zip(lin_out, nz_out) if nz]

    region = _trace_region(transposed, [*res_avals, *ct_avals], "map_transpose")
    return region, cell[0]


def _map_transpose(cts, *args, body, placement, n):
    linear = tuple(ad.is_undefined_primal(x) for x in args)
    ct_nz = tuple(not _is_zero(ct) for ct in cts)

    def zero_ct(x):
        return Zero(x.aval.to_ct_aval())

    if not any(ct_nz):
        return [zero_ct(x) if lin else None for x, lin in zip(args, linear)]
    region, nz_out = _transpose_body(body, linear, ct_nz)
    residuals = [x for x, lin in zip(args, linear) if not lin]
    nz_cts = [ct for ct, nz in zip(cts, ct_nz) if nz]
    outs = (
        map_p.bind(*residuals, *nz_cts, body=region, placement=placement, n=n)
        if any(nz_out)
        else []
    )
    outs_it, nz_it = iter(outs), iter(nz_out)
    result = []
    for x, lin in zip(args, linear):
        if not lin:
            result.append(None)
        elif next(nz_it):
            result.append(next(outs_it))
        else:
            result.append(zero_ct(x))
    assert next(outs_it, None) is None
    return result


ad.primitive_transposes[map_p] = _map_transpose


# --- fed.map: remat (jax's remat transform) -------------------------------------------------


def _map_remat(ctx, *args, body, placement, n):
    body_fwd, body_rem, num_res = jc.remat_jaxpr(ctx, body)
    outs = map_p.bind(*args, body=body_fwd, placement=placement, n=n)
    primals_out, res = split_list(outs, [len(body.out_avals)])

    def rem(res, *args):
        return map_p.bind(*res, *args, body=body_rem, placement=placement, n=n)

    return primals_out, res, rem


jc.register_remat_rule(map_p, _map_remat)
