"""``fed.map``: a region run by each member of a placement.

A higher-order primitive: ``body`` is a ClosedJaxpr over one member's values. Every
operand is mapped along its leading axis; values closed over from outside are made
explicit broadcasts by the frontend, so the region only ever sees member values. The
body stays a sub-jaxpr, so the map boundary survives in the jaxpr (and in the IR).

Derivative: higher-order: JVP maps the body's JVP (``ad.jvp_jaxpr``); direct
linearization maps ``ad.linearize_jaxpr``'s primal jaxpr and its tangent jaxpr; partial
evaluation (``JaxprTrace`` and the ``partial_eval_jaxpr_custom`` used by remat and jit)
splits the body into a known map that *outputs its residuals placed at the members*
(leading axis n) and an unknown map that consumes them; residuals that are just (placed)
map operands are forwarded, residuals that are constants of the body are baked into the
unknown body as constants (never broadcast, never moved to the server). Transpose maps
the body's backward pass (``ad.backward_pass``), consuming the placed residuals and the
placed cotangents and producing placed cotangents. DCE prunes unused outputs and the
body's dead code. Symbolic zeros (``ad.Zero``) are never instantiated: zero tangents /
cotangents are dropped from the region's signature.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable

import jax
import numpy as np
from jax.sharding import PartitionSpec

from fcir import jaxcompat as jc
from fcir.errors import PlacementError
from fcir.ir.types import PlacedType
from fcir.jaxcompat import (
    ad,
    ad_util,
    batching,
    core,
    merge_lists,
    partition_list,
    pe,
    source_info_util,
    split_list,
    weakref_lru_cache,
)
from fcir.opkit import autodiff as AD
from fcir.opkit import placement as api
from fcir.opkit import primitives as P
from fcir.opkit import sharding

from .base import FedOp, public
from .broadcast import broadcast_p

__all__ = ["Map", "map_fn", "map_p", "member_map", "member_slices", "mixed_layout_error"]

Zero = ad_util.Zero
_is_zero = AD.is_zero
_inexact = AD.inexact
_trace_region = AD.trace_region


# --- the primitive ------------------------------------------------------------------------


def _map_impl(*args, body, placement, n):
    del placement
    return jax.vmap(core.jaxpr_as_fun(body), axis_size=n)(*args)


def _map_abstract_eval(*avals, body, placement, n):
    member_axes = []
    for i, (aval, inner) in enumerate(zip(avals, body.in_avals)):
        member = P.member_aval(aval, placement, n, f"fed.map operand {i}")
        if member.shape != inner.shape or member.dtype != inner.dtype:
            raise Map.error(
                "C3",
                f"operand {i} has member type {member.str_short()} but the region "
                f"expects {inner.str_short()}",
            )
        member_axes.append(aval.sharding.spec[0] if aval.sharding.spec else None)
    # Outputs' member axes are sharded like the operands' (vmap's rule for Explicit axes).
    if len(set(member_axes)) > 1:
        raise mixed_layout_error(placement, member_axes, avals)
    member_axis = member_axes[0] if member_axes else None
    mesh = avals[0].sharding.mesh if member_axis is not None else None
    return [P.placed_aval(a, n, member_axis, mesh) for a in body.out_avals], body.effects


def mixed_layout_error(placement: str, member_axes: list, avals) -> PlacementError:
    """The error for a map whose operands' member axes (``member_axes``, one per operand:
    a mesh axis name or None) are sharded differently; also raised by the streaming
    backend, which sees the same operands before it slices them."""
    return PlacementError(
        f"fed.map over '{placement}': operands' member axes are sharded differently "
        f"({', '.join(map(str, member_axes))}); on a mesh with Explicit axes every "
        f"operand's leading axis must be sharded alike: "
        + _mixed_layout_advice(placement, member_axes, avals)
    )


def _mixed_layout_advice(placement: str, member_axes: list, avals) -> str:
    """What to do about operands laid out differently. When some operand is already
    split over a mesh axis named ``placement`` (the mesh has it) and no mesh is in
    context, what is missing is the context: fcir.broadcast and map_fn lay values out
    over the mesh set by ``jax.set_mesh`` (an argument placed on the mesh by
    ``device_put`` carries its layout, the broadcast model does not)."""
    on_axis = any(a == placement or (isinstance(a, tuple) and placement in a) for a in member_axes)
    if on_axis and jax.sharding.get_abstract_mesh().empty:
        mesh = next(a.sharding.mesh for a in avals if not a.sharding.mesh.empty)
        return (
            f"the operands' mesh has an axis named '{placement}' but no mesh is in "
            f"context, so the values fcir lays out (broadcasts, map results) are not on "
            f"it: call the program inside `with jax.set_mesh(mesh):` (the mesh with axes "
            f"{tuple(mesh.axis_names)}), or pass mesh= to fcir.program"
        )
    return f"add a mesh axis named '{placement}' or reshard the operands"


def _map_batch(axis_data, args, dims, *, body, placement, n):
    not_mapped = None  # batching's NotMapped
    batched = [d is not not_mapped for d in dims]
    args = [a if d is not_mapped else P.moveaxis_to(a, d, 1) for a, d in zip(args, dims)]
    new_body, out_batched = batching.batch_jaxpr(body, axis_data, batched, False)
    outs = map_p.bind(*args, body=new_body, placement=placement, n=n)
    return outs, [1 if b else not_mapped for b in out_batched]


map_p = P.define_primitive(
    "fed_map",
    _map_impl,
    _map_abstract_eval,
    _map_batch,
    multiple_results=True,
    effectful=True,
    fancy_batch=True,
)


# --- residual helpers ---------------------------------------------------------------------


def _map_out_avals(in_avals, body, placement: str, n: int):
    """The placed result types of ``fed_map`` (its own abstract evaluation)."""
    out_avals, _ = map_p.abstract_eval(*in_avals, body=body, placement=placement, n=n)
    return out_avals


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


AD.def_jvp(map_p, _map_jvp)


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


AD.def_transpose(map_p, _map_transpose)


# --- fed.map: remat (jax's remat transform) -------------------------------------------------


def _map_remat(ctx, *args, body, placement, n):
    body_fwd, body_rem, num_res = jc.remat_jaxpr(ctx, body)
    outs = map_p.bind(*args, body=body_fwd, placement=placement, n=n)
    primals_out, res = split_list(outs, [len(body.out_avals)])

    def rem(res, *args):
        return map_p.bind(*res, *args, body=body_rem, placement=placement, n=n)

    return primals_out, res, rem


jc.register_remat_rule(map_p, _map_remat)


# --- the op -------------------------------------------------------------------------------


class Map(FedOp):
    """Applies its region to each member: ``({T...}@p) -> {U...}@p``."""

    name = "fed.map"
    primitive = map_p
    kind = "map"
    multiple_results = True
    constraints = {
        "C1": "has exactly one region, at least one operand, one region parameter per operand "
        "and one result per yielded value",
        "C2": "every operand must be placed at the placement directly below the current one",
        "C3": "region parameter i must have the member type of operand i",
        "C4": "result i must be {U}@p where U is the type of the i-th yielded value",
    }
    placement_constraints = frozenset({"C2"})

    @classmethod
    def bind(cls, op, args, cardinality, regions=()):
        """Binds ``map_p`` with the body the interpreter traced from the op's region."""
        (body,) = regions
        p = op.operands[0].type.placement
        return cls.primitive.bind(*args, body=body, placement=p, n=cardinality(p))

    @classmethod
    def verify(cls, op, ctx):
        if len(op.regions) != 1 or not op.operands:
            cls.fail("C1", f"{len(op.regions)} regions, {len(op.operands)} operands")
        (region,) = op.regions
        if len(region.params) != len(op.operands) or len(region.results) != len(op.results):
            cls.fail(
                "C1",
                f"{len(op.operands)} operands for {len(region.params)} parameters, "
                f"{len(op.results)} results for {len(region.results)} yielded values",
            )
        p = None
        for i, (v, param) in enumerate(zip(op.operands, region.params)):
            t = cls.placed_operand(ctx, v, "C2")
            p = t.placement
            if param.type != t.member:
                cls.fail("C3", f"parameter {i} has type {param.type}, operand member {t.member}")
        for i, (r, y) in enumerate(zip(op.results, region.results)):
            if r.type != PlacedType(y.type, p, False):
                cls.fail("C4", f"result {i} has type {r.type}, region yields {y.type}")


# --- binding fed.map from other ops' rules --------------------------------------------


def _member_aval(aval) -> core.ShapedArray:
    """One member's type: the placed type without its leading (member) axis."""
    sharding = aval.sharding
    spec = PartitionSpec(*sharding.spec[1:])
    return aval.update(shape=aval.shape[1:], sharding=sharding.update(spec=spec))


@functools.lru_cache(maxsize=4096)
def _cached_region(builder, member_avals: tuple, static: tuple) -> jc.ClosedJaxpr:
    return AD.trace_region(builder(*static), member_avals, builder.__name__)


def member_map(builder, static: tuple, placement: str, n: int, *placed):
    """Binds ``fed_map`` with the region ``builder(*static)`` traced over member types.

    ``builder(*static)`` returns a function of one member's values returning a list.
    Regions are cached per (builder, member types, static), so a rule emits the same
    region object each time (deterministic IR, cache-friendly).
    """
    avals = tuple(_member_aval(core.typeof(x)) for x in placed)
    body = _cached_region(builder, avals, tuple(static))
    return map_p.bind(*placed, body=body, placement=placement, n=n)


def member_slices(xs, dims, b: int, placement: str, n: int) -> list:
    """Element ``b`` of the batch axis ``dims[i]`` (>= 1) of each placed ``xs[i]``,
    taken by a fed.map over the members (unbatched leaves as they are)."""
    batched = [i for i, d in enumerate(dims) if d is not None]
    if not batched:
        return list(xs)

    def body(*members):
        return [
            jax.lax.index_in_dim(m, b, dims[i] - 1, keepdims=False)
            for i, m in zip(batched, members)
        ]

    avals = [jax.ShapeDtypeStruct(xs[i].shape[1:], xs[i].dtype) for i in batched]
    closed = jax.make_jaxpr(body)(*avals)
    outs = map_p.bind(*[xs[i] for i in batched], body=closed, placement=placement, n=n)
    got = list(xs)
    for i, o in zip(batched, outs):
        got[i] = o
    return got
@public
def map_fn(fn: Callable, arg, *, mesh=None):
    """Applies ``fn`` to each member: ``{T}@p -> {U}@p``.

    ``fn`` is traced once with one member's (unbatched) shapes and becomes the region of
    a ``fed.map`` op. A tuple ``arg`` is unpacked into positional arguments. Values that
    ``fn`` closes over are broadcast explicitly, so every server-to-member flow is a
    visible ``fed.broadcast``.
    """
    frame = api._current("fcir.map_fn")
    if not callable(fn):
        raise PlacementError(
            f"fcir.map_fn(fn, arg): fn must be a function of one member's values, got "
            f"{type(fn).__name__}"
        )
    name, n = frame.child("fcir.map_fn")
    mesh = frame.mesh if mesh is None else mesh
    api._check_placed(arg, name, n, "fcir.map_fn")
    leaves, in_tree = api._flatten(arg)
    leaves = [sharding.constrain_placed(jax.numpy.asarray(x), name, mesh) for x in leaves]
    member_specs = [
        jax.ShapeDtypeStruct(
            np.shape(x)[1:],
            x.dtype,
            weak_type=jax.typeof(x).weak_type,
            sharding=sharding.member_sharding(x),
        )
        for x in leaves
    ]
    out_tree_box = []

    def flat_body(*member_leaves):
        member_arg = jax.tree_util.tree_unflatten(in_tree, member_leaves)
        out = fn(*member_arg) if isinstance(member_arg, tuple) else fn(member_arg)
        out_leaves, out_tree = api._flatten(out)
        for leaf in out_leaves:
            if not (isinstance(leaf, (bool, int, float, complex)) or hasattr(leaf, "dtype")):
                raise PlacementError(
                    f"fcir.map_fn: fn returned a {type(leaf).__name__} ({leaf!r:.40}) among its "
                    "results; a member's results are arrays (pytrees of them): return "
                    "non-array values from outside the map_fn"
                )
        out_tree_box.append(out_tree)
        return out_leaves

    with api._pushed(api._Frame(frame.placements, frame.level + 1, mesh)):
        try:
            closed = jax.make_jaxpr(flat_body)(*member_specs)
        except NameError as e:
            _reject_placement_collective(e, frame.placements)
            raise
        except (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError) as e:
            # capture's message for it says what to write in a member's code; the
            # innermost map_fn is the one whose body asked.
            if getattr(e, "fcir_member_of", None) is None:
                e.fcir_member_of = name
            raise
    body, consts = _lift_traced_consts(closed)
    bcast = [
        sharding.constrain_broadcast(broadcast_p.bind(c, placement=name, n=n), name, mesh)
        for c in consts
    ]
    outs = map_p.bind(*bcast, *leaves, body=body, placement=name, n=n)
    outs = [sharding.constrain_placed(o, name, mesh) for o in outs]
    return jax.tree_util.tree_unflatten(out_tree_box[-1], outs)


def _reject_placement_collective(err: NameError, placements: api.Placements) -> None:
    """A collective over a placement axis inside a map_fn body (``psum(x, "clients")``)
    fails in JAX as an unbound axis name; say that it is client-to-client communication."""
    m = re.search(r"unbound axis name: (\w+)", str(err))
    if m is not None and m.group(1) in placements.names:
        raise PlacementError(
            f"fcir.map_fn: the body uses a collective over the placement axis '{m.group(1)}' "
            f"({err}); that is client-to-client communication: aggregate with "
            "fcir.reduce_sum/reduce_mean/... outside the body instead"
        ) from err


def _lift_traced_consts(closed: jc.ClosedJaxpr) -> tuple[jc.ClosedJaxpr, list]:
    """Turns constants that are tracers of an outer trace into leading invars.

    Concrete constants (numpy arrays) stay constants of the region.
    """
    jaxpr = closed.jaxpr
    traced = [isinstance(c, jc.core.Tracer) for c in closed.consts]
    if not any(traced):
        return closed, []
    keep_vars = [v for v, t in zip(jaxpr.constvars, traced) if not t]
    keep_vals = [c for c, t in zip(closed.consts, traced) if not t]
    lift_vars = [v for v, t in zip(jaxpr.constvars, traced) if t]
    lift_vals = [c for c, t in zip(closed.consts, traced) if t]
    new = jaxpr.replace(
        constvars=keep_vars,
        invars=[*lift_vars, *jaxpr.invars],
        debug_info=jaxpr.debug_info._replace(arg_names=None),
    )
    return jc.closed_jaxpr(new, keep_vals), lift_vals
