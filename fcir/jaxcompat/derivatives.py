"""Version-neutral derivatives: what a gradient captures to on every supported JAX.

JAX 0.10.2 differentiates ``tanh`` to ``(g + g*ans) * (1 - ans)``, JAX 0.12 to
``g * one_minus_square(ans)`` (a primitive 0.10 lacks). The two compute different bits,
and ir.md's guarantee 1 wants the IR of a gradient to run bit for bit (and with the same
XLA flops) as the *running* JAX's ``jax.jit``. So while fcir captures (and only then),
``tanh``'s JVP emits fcir's derivative ops instead of JAX's expression:

- ``r = tanh_residual(ans)``: what JAX's rule computes from ``ans = tanh(x)`` alone
  (0.10.2: ``1 - ans``; 0.12: ``one_minus_square(ans)``); it lands where JAX's partial
  evaluation puts it, in the forward pass (a residual);
- ``tanh_tangent(g, ans, r)``: the rest of the rule, linear in ``g``; its transpose is
- ``tanh_cotangent(ct, ans, r)``: ``jax.linear_transpose`` of it, linear in ``ct``.

They print the same under every JAX. Like JAX's own elementwise primitives they type
their results with their operands' common sharding (under an Explicit-axes mesh a type
carries it, and JAX's rules check it), and the splits they run are traced on that type
(:func:`_key`; tests/interpreters/xla/test_xla_explicit_mesh.py). What they compute is the running JAX's own rule,
split as JAX's partial evaluation splits it (:func:`_split`): their implementation, XLA
lowering and batching run those very equations, so a compiled module runs the ops
``jax.jit`` of the same function runs, where it runs them, on the same values. (Under
0.12 ``ans`` is one more residual than ``jax.jit`` keeps: no flops, no other bits.)

A derivative of such an op (a gradient of a gradient) is fcir's second-order ops,
``<op>_jvp`` / ``<op>_jvp_tangent`` / ``<op>_jvp_cotangent`` (:func:`_second_order`):
the running JAX's JVP of the op's expression, split and transposed as JAX splits and
transposes it. They take a tangent for every operand that has one, on every JAX (the
same text): under JAX 0.12 ``tanh_cotangent`` (``ct * r``) reads no ``ans``, so its
``_jvp_cotangent`` gives a zero cotangent for ``ans`` where JAX's own trace has a
symbolic zero; :func:`zero_results` names such results and the XLA backend removes
them and the adds of them before XLA sees them (fcir/interpreters/xla/zeros.py), so
the compiled program does the flops ``jax.jit``'s does. Where the running JAX's JVP
does not split that way (a tangent read twice: JAX 0.10.2's forward-over-forward of
``tanh``), an expansion would sum cotangents in another order than ``jax.jit``, so
capture traces the program again with the running JAX's own rules
(:func:`make_jaxpr`), whose text is then JAX's.

Where ``tanh``'s input has another use after ``tanh`` (an LSTM's cell state, also the
next step's carry), the backward pass reaches ``tanh`` with that input's cotangent
holding ``acc`` already, and JAX adds what the rule's transpose writes onto it one piece
at a time. JAX 0.10.2's rule reads ``g`` twice, so ``jax.jit`` sums ``(acc + u) +
u*ans`` (``u = ct * (1 - ans)``); one ``tanh_cotangent`` added once would sum ``acc + (u
+ u*ans)``, other last bits than ``jax.jit``'s. So ``tanh_tangent``'s transpose is a
"fancy" one, given the accumulator itself (:func:`_tangent_transpose_onto`): onto an
empty one it writes ``tanh_cotangent``, onto ``acc`` it writes ``tanh_cotangent_add(acc,
ct, ans, r)``, JAX's own backward pass of the rule started at ``acc``
(:func:`_cotangent_add`). Which of the two capture writes depends on the order of the
program's uses, on every JAX; only where JAX itself transposes ``tanh`` with an
accumulator of its own (JAX 0.12's ``jnp.tanh`` is a ``jit`` its AD keeps at the top
level of a differentiated function, though not in a scan's body; 0.10.2 inlines it
while tracing) is it ``tanh_cotangent`` and an ``add_any`` on one JAX,
``tanh_cotangent_add`` on the other: the two JAX's ``jax.jit`` compute different bits
there anyway (their rules do). Under JAX 0.12 the rule reads
``g`` once and ``tanh_cotangent_add`` is ``acc + ct*r``, the ops ``jax.jit`` runs
(tests/interpreters/xla/test_xla_lstm_bitwise.py). The corpus programs' goldens have
no ``tanh_cotangent_add`` (no backward pass of theirs reaches ``tanh`` with a cotangent
of its input in hand); the LSTM's gradient there has one (golden ``lstm_grad``, one
text on both JAX).

A ``custom_jvp_call`` with unknown inputs is inlined while capturing, as JAX 0.10.2's
partial evaluation does (see :func:`_inline_custom_jvp_call`).

Capture mode is a JAX config state included in JAX's trace context
(:data:`CAPTURE_MODE`): JAX keys its tracing, JVP and linearization caches on that
context, so a trace made while capturing never reuses one JAX made outside (with its
own rules) and vice versa: capture's text does not depend on what JAX traced before
(tests/jaxcompat/test_golden_capture_mode.py).
"""

from __future__ import annotations

import contextlib
import functools
import threading

import jax
from jax._src import config, core
from jax._src.interpreters import ad, batching, mlir
from jax._src.lax import lax as _lax

__all__ = [
    "CAPTURE_MODE",
    "OPS",
    "capturing",
    "tanh_cotangent_add_p",
    "tanh_cotangent_p",
    "tanh_residual_p",
    "tanh_tangent_p",
]  # and the second-order ops, tanh_*_jvp{,_tangent,_cotangent}_p (see below)

#: True while fcir captures a program (part of JAX's trace context: see the module doc).
CAPTURE_MODE = config.bool_state(
    name="fcir_capture_mode",
    default=False,
    help="Internal to fcir: set while fcir.capture traces a program, so that derivative "
    "rules emit fcir's version-neutral ops and JAX's trace caches keep those traces apart.",
    include_in_trace_context=True,
)


_STATE = threading.local()


def _expanded() -> None:
    probe = getattr(_STATE, "probe", None)
    if probe is not None and CAPTURE_MODE.value:
        probe.expanded = True


class Probe:
    """What a :func:`capturing` block saw: ``expanded`` is True when a derivative op was
    itself differentiated (or batched over differing axes) and so expanded into the
    running JAX's expression."""

    expanded = False


@contextlib.contextmanager
def capturing():
    """The block traces in capture mode; yields a :class:`Probe` (per thread)."""
    probe, saved = Probe(), getattr(_STATE, "probe", None)
    _STATE.probe = probe
    try:
        with CAPTURE_MODE(True):
            yield probe
    finally:
        _STATE.probe = saved
        if saved is not None and probe.expanded:
            saved.expanded = True


def _jax_tanh_rule():
    """The running JAX's ``tanh`` JVP rule ``rule(g, ans, x, accuracy)`` (registered with
    ``ad.defjvp2``), or None when the table holds something else."""
    entry = ad.primitive_jvps.get(_lax.tanh_p)
    rules = getattr(entry, "args", None)
    if getattr(entry, "func", None) is not ad.standard_jvp2 or not rules or len(rules[0]) != 1:
        return None
    return rules[0][0]


_RULE = _jax_tanh_rule()
_JAX_TANH_JVP = ad.primitive_jvps.get(_lax.tanh_p)


def _key(aval):
    """The type a split is traced on and cached by: shape, dtype, weak type and sharding
    (under an Explicit-axes mesh JAX's own rules type their results by their operands'
    sharding, and the equations replayed must have been traced on that sharding)."""
    return core.ShapedArray(
        tuple(aval.shape), aval.dtype, weak_type=bool(aval.weak_type), sharding=aval.sharding
    )


def _partition(jaxpr, unknowns: set) -> tuple[set, list, list]:
    """``(tainted, known, unknown)``: the equations of ``jaxpr`` that read nothing
    computed from ``unknowns`` (they run in the forward pass, as JAX's partial
    evaluation runs them) and those that do, with every variable the latter make."""
    tainted, known, unknown = set(unknowns), [], []
    for eqn in jaxpr.eqns:
        if any(isinstance(v, core.Var) and v in tainted for v in eqn.invars):
            tainted.update(eqn.outvars)
            unknown.append(eqn)
        else:
            known.append(eqn)
    return tainted, known, unknown


@functools.lru_cache(maxsize=256)
def _split(aval):
    """JAX's rule on arrays of type ``aval`` (a :func:`_key`) split as JAX's partial
    evaluation splits it with ``ans`` known and ``g`` unknown: ``(jaxpr, g, ans, known,
    unknown, r)``, where ``known`` are the equations computing the one residual ``r``
    from ``ans`` (they run in the forward pass), ``unknown`` those computing the tangent
    from ``g``, ``ans`` and ``r``; None when the rule does not split that way (then
    capture keeps JAX's rule)."""
    closed = jax.make_jaxpr(lambda g, ans: _RULE(g, ans, ans, None))(aval, aval)
    jaxpr = closed.jaxpr
    g, ans = jaxpr.invars
    if closed.consts or jaxpr.constvars or len(jaxpr.outvars) != 1:
        return None
    tainted, known, unknown = _partition(jaxpr, {g})
    produced = {v for e in known for v in e.outvars}
    residuals = {v for e in unknown for v in e.invars if isinstance(v, core.Var) and v in produced}
    out = jaxpr.outvars[0]
    if len(residuals) != 1 or not isinstance(out, core.Var) or out not in tainted:
        return None
    return g, ans, tuple(known), tuple(unknown), residuals.pop(), out


def _run(eqns, env):
    def read(v):
        return v.val if isinstance(v, core.Literal) else env[v]

    for eqn in eqns:
        outs = eqn.primitive.bind(*map(read, eqn.invars), **eqn.params)
        env.update(zip(eqn.outvars, outs if eqn.primitive.multiple_results else [outs]))
    return env


def _parts(x):
    return _split(_key(core.typeof(x)))


def _residual(ans):
    """What JAX's rule computes from ``ans`` alone (0.10.2: ``1 - ans``; 0.12:
    ``one_minus_square(ans)``)."""
    _, a, known, _, r, _ = _parts(ans)
    return _run(known, {a: ans})[r]


def _tangent(g, ans, r):
    """JAX's tangent of ``tanh`` (default accuracy) from ``g``, ``ans`` and the residual;
    ``ans`` stands for ``x`` in the rule, which only takes constants of its dtype from it."""
    gv, a, _, unknown, rv, out = _parts(ans)
    return _run(unknown, {gv: g, a: ans, rv: r})[out]


def _cotangent(ct, ans, r):
    aval = jax.ShapeDtypeStruct(ans.shape, ans.dtype, sharding=core.typeof(ans).sharding)
    (out,) = jax.linear_transpose(lambda g: _tangent(g, ans, r), aval)(ct)
    return out


def _elementwise_aval(*avals):
    first = avals[0]
    if any(a.shape != first.shape or a.dtype != first.dtype for a in avals):
        raise TypeError(
            "tanh_residual/tanh_tangent/tanh_cotangent take arrays of one type, got "
            + ", ".join(a.str_short() for a in avals)
        )
    # The operands' common sharding, as JAX's own elementwise primitives type it (under
    # an Explicit-axes mesh a result without it would meet its uses unsharded).
    sharding = _lax.broadcasting_sharding_rule("fcir derivative op", *avals)
    return first.update(weak_type=all(a.weak_type for a in avals), sharding=sharding)


def _define(name: str, expression, results=None):
    """A derivative op computing ``expression`` (the running JAX's equations); ``results``
    maps its ``tangents`` param to its number of results (None: one result, no params)."""
    prim = core.Primitive(name)
    multiple = results is not None
    prim.multiple_results = multiple
    prim.def_impl(expression)
    if multiple:
        prim.def_abstract_eval(
            lambda *avals, tangents: [_elementwise_aval(*avals)] * results(tangents)
        )
    else:
        prim.def_abstract_eval(lambda *avals, **_: _elementwise_aval(*avals))
    mlir.register_lowering(prim, mlir.lower_fun(expression, multiple_results=multiple))

    def batch(args, dims, **params):
        if dims[0] is not None and all(d == dims[0] for d in dims):
            out = prim.bind(*args, **params)  # elementwise: the same op on the batch
            return out, ([dims[0]] * len(out) if multiple else dims[0])
        # Otherwise JAX's expression, batched as JAX batches it (so no broadcast of an
        # unbatched operand, and the flops of ``jax.vmap`` of JAX's derivative).
        _expanded()
        fn = functools.partial(expression, **params)
        out = jax.vmap(fn, in_axes=tuple(dims))(*args)  # unmapped: None
        return out, ([0] * len(out) if multiple else 0)

    batching.primitive_batchers[prim] = batch

    def jvp(primals_in, tangents_in, /, **params):  # params may name "tangents"
        _expanded()
        tangents_in = [ad.instantiate_zeros(t) for t in tangents_in]
        fn = functools.partial(expression, **params)
        return jax.jvp(fn, tuple(primals_in), tuple(tangents_in))

    ad.primitive_jvps[prim] = jvp
    return prim


def _cotangent_add(acc, ct, ans, r):
    """``acc`` plus ``tanh_cotangent(ct, ans, r)``, summed as the running JAX's backward
    pass sums it onto a cotangent that already holds ``acc``: one add per piece its
    transpose writes, in the order it writes them (0.10.2: ``(acc + u) + u*ans``, ``u =
    ct * r``; 0.12: ``acc + ct * r``). It is JAX's own backward pass of the rule,
    with ``g``'s accumulator starting at ``acc`` (the rule's function returns ``g``
    too, and a backward pass adds the cotangents of its results before those of its
    equations)."""
    aval = jax.ShapeDtypeStruct(ans.shape, ans.dtype, sharding=core.typeof(ans).sharding)
    (out,) = jax.linear_transpose(lambda g: (_tangent(g, ans, r), g), aval)((ct, acc))
    return out


tanh_residual_p = _define("tanh_residual", _residual)
tanh_tangent_p = _define("tanh_tangent", _tangent)
tanh_cotangent_p = _define("tanh_cotangent", _cotangent)
tanh_cotangent_add_p = _define("tanh_cotangent_add", _cotangent_add)


def _transpose(into):
    def rule(ct, a, ans, r):
        if ad.is_undefined_primal(ans) or ad.is_undefined_primal(r):
            raise ValueError(f"{into.name}: transposed in an operand it is not linear in")
        if type(ct) is ad.Zero:
            return [None, None, None]
        return [into.bind(ct, ans, r), None, None]

    return rule


ad.primitive_transposes[tanh_tangent_p] = _transpose(tanh_cotangent_p)
ad.primitive_transposes[tanh_cotangent_p] = _transpose(tanh_tangent_p)


def _tangent_transpose_onto(ct, g, ans, r):
    """``tanh_tangent``'s transpose as a backward pass runs it (JAX's "fancy" transpose:
    it gets ``g``'s accumulator itself). Where that accumulator holds nothing yet (the
    only use of ``tanh``'s input, or its last one in program order) the cotangent is
    ``tanh_cotangent``, added later as JAX adds it. Where it holds ``acc`` already (the
    input has another use after ``tanh``: an LSTM's cell state, also the next carry),
    the running JAX's rule may write more than one piece: 0.10.2's, ``(g + g*ans) *
    (1 - ans)``, reads ``g`` twice, so ``jax.jit`` sums ``(acc + u) + u*ans``, where
    one ``tanh_cotangent`` added onto ``acc`` sums ``acc + (u + u*ans)``, another
    grouping and other last bits than ``jax.jit``'s. So there the accumulator becomes
    ``tanh_cotangent_add(acc, ct, ans, r)``, which sums as the running JAX does
    (:func:`_cotangent_add`). The choice follows the order of the program's uses, on
    every JAX (the module doc says where a JAX's own ``jit`` around ``tanh`` changes
    it); under 0.12, which reads ``g`` once, both forms sum ``acc + ct*r``, the ops
    ``jax.jit`` runs."""
    if any(isinstance(x, ad.GradAccum) for x in (ans, r)):
        raise ValueError("tanh_tangent: transposed in an operand it is not linear in")
    if not isinstance(g, ad.GradAccum) or type(ct) is ad.Zero:
        return None
    if isinstance(g, ad.ValAccum) and type(g.val) is not ad.Zero:
        g.val = tanh_cotangent_add_p.bind(g.val, ct, ans, r)
    else:
        g.accum(tanh_cotangent_p.bind(ct, ans, r))
    return None


def _cotangent_add_transpose(ct, acc, c, ans, r):
    # Linear in (acc, c): acc's cotangent is ct, c's is tanh_cotangent's transpose of it.
    if ad.is_undefined_primal(ans) or ad.is_undefined_primal(r):
        raise ValueError("tanh_cotangent_add: transposed in an operand it is not linear in")
    if type(ct) is ad.Zero:
        return [None, None, None, None]
    return [
        ct if ad.is_undefined_primal(acc) else None,
        tanh_tangent_p.bind(ct, ans, r) if ad.is_undefined_primal(c) else None,
        None,
        None,
    ]


ad.fancy_transposes[tanh_tangent_p] = _tangent_transpose_onto
ad.primitive_transposes[tanh_cotangent_add_p] = _cotangent_add_transpose


def _tanh_jvp(primals, tangents, **params):
    (x,), (g,) = primals, tangents
    if (
        not CAPTURE_MODE.value
        or type(g) is ad.Zero
        or params.get("accuracy") is not None
        or not jax.numpy.issubdtype(x.dtype, jax.numpy.floating)
        or _parts(x) is None
    ):
        return _JAX_TANH_JVP(primals, tangents, **params)
    ans = _lax.tanh_p.bind(x, **params)
    return ans, tanh_tangent_p.bind(g, ans, tanh_residual_p.bind(ans))


if _RULE is not None:
    ad.primitive_jvps[_lax.tanh_p] = _tanh_jvp

# Second order. JAX's own gradient of a gradient differentiates, equation by equation,
# the expression a derivative op stands for, where the op stands: the forward pass runs
# what JAX's partial evaluation keeps known (the primal and what the tangent rules
# compute from primals alone), the linear part the rest, and the transposes accumulate
# the outer cotangents eqn by eqn. fcir's second-order ops are that JVP of the running
# JAX's expression (:func:`_jvp_split`) split the same way:
#
# - ``<op>_jvp(primals) -> (out, s)``: the known equations; ``s`` is the one value the
#   tangent needs from them besides the primals (when JAX's split needs none, ``s`` is
#   the first operand again: no flops);
# - ``<op>_jvp_tangent(tangents, primals, s)``: the tangent equations, linear in the
#   tangents; ``tangents`` is a bitmask of the operands with a (nonzero) tangent;
# - ``<op>_jvp_cotangent(ct, primals, s)``: its transpose, one cotangent per tangent
#   (zero for a tangent the running JAX's equations do not read: :func:`zero_results`).
#
# The fused transpose sums the cotangents an outer operand receives at once; JAX sums
# them eqn by eqn onto what that operand has received already, in another order when
# the tangent equations read it more than once. So the ops are used only where each
# tangent operand is read once (else capture falls back: see make_jaxpr).


def _zero(aval):
    return ad.Zero(aval.to_tangent_aval())


def _jvp_run(jaxpr, primals, tangents):
    """JAX's JVP of ``jaxpr`` as a JVPTrace runs it (symbolic zeros kept): each
    equation's primal, and its JAX JVP rule unless all its tangents are zero."""
    penv, tenv = dict(zip(jaxpr.invars, primals)), dict(zip(jaxpr.invars, tangents))

    def p(v):
        return v.val if isinstance(v, core.Literal) else penv[v]

    def t(v):
        return _zero(v.aval) if isinstance(v, core.Literal) else tenv[v]

    for eqn in jaxpr.eqns:
        ps, ts = [p(v) for v in eqn.invars], [t(v) for v in eqn.invars]
        if all(type(x) is ad.Zero for x in ts):
            outs = eqn.primitive.bind(*ps, **eqn.params)
            outs = outs if eqn.primitive.multiple_results else [outs]
            touts = [_zero(v.aval) for v in eqn.outvars]
        else:
            outs, touts = ad.primitive_jvps[eqn.primitive](ps, ts, **eqn.params)
            if not eqn.primitive.multiple_results:
                outs, touts = [outs], [touts]
        penv.update(zip(eqn.outvars, outs))
        tenv.update(zip(eqn.outvars, touts))
    return p(jaxpr.outvars[0]), t(jaxpr.outvars[0])


@functools.lru_cache(maxsize=256)
def _jvp_split(name, aval, mask):
    """The running JAX's JVP of derivative op ``name``'s expression, with tangents on
    the operands in bitmask ``mask`` (of type ``aval``, a :func:`_key`), split into
    ``(jaxpr, primals, tangents, known, unknown, out, residual, tout)``; None when it
    does not split into one residual with each tangent read once (or has a zero
    tangent)."""
    expression, arity = _EXPRESSIONS[name]
    nz = [bool(mask >> i & 1) for i in range(arity)]

    def fn(*args):
        primals, ts = args[:arity], iter(args[arity:])
        tangents = [next(ts) if z else _zero(aval) for z in nz]
        inner = jax.make_jaxpr(expression)(*primals).jaxpr
        out, tout = _jvp_run(inner, primals, tangents)
        if type(tout) is ad.Zero:
            raise _NoSplit
        return out, tout

    try:
        closed = jax.make_jaxpr(fn)(*[aval] * (arity + sum(nz)))
    except _NoSplit:
        return None
    jaxpr = closed.jaxpr
    if closed.consts or jaxpr.constvars:
        return None
    primals, tangents = jaxpr.invars[:arity], jaxpr.invars[arity:]
    tainted, known, unknown = _partition(jaxpr, set(tangents))
    out, tout = jaxpr.outvars
    reads = [v for e in unknown for v in e.invars if isinstance(v, core.Var)]
    produced = {v for e in known for v in e.outvars}
    residuals = {v for v in reads if v in produced}
    if (
        len(residuals) > 1
        or not isinstance(out, core.Var)
        or out not in produced
        or not isinstance(tout, core.Var)
        or tout in tangents
        or any(reads.count(v) > 1 for v in tangents)
    ):
        return None
    # No residual: s is the first operand again (already a value of the forward pass;
    # ``out`` would have to be materialized for a scan's residuals, and XLA would
    # compute it twice where jax.jit fuses it into its one use).
    residual = residuals.pop() if residuals else primals[0]
    known, unknown = tuple(known), tuple(unknown)
    read = tuple(v in reads for v in tangents)
    return jaxpr, tuple(primals), tuple(tangents), known, unknown, out, residual, tout, read


class _NoSplit(Exception):
    pass


def _split_of(name, x, mask):
    return _jvp_split(name, _key(core.typeof(x)), mask)


def _apply(fn, rest, tangents, *ts):
    return fn(*ts, *rest, tangents=tangents)


def _second_order(name):
    """The three second-order ops of derivative op ``name`` (see above)."""

    def jvp_primal(*primals, tangents):
        _, ps, _, known, _, out, res, _, _ = _split_of(name, primals[0], tangents)
        env = _run(known, dict(zip(ps, primals)))
        return [env[out], env[res]]

    def jvp_tangent(*args, tangents):
        n = bin(tangents).count("1")
        ts, primals, s = args[:n], args[n:-1], args[-1]
        _, ps, tvs, _, unknown, _, res, tout, _ = _split_of(name, primals[0], tangents)
        env = {**dict(zip(ps, primals)), **dict(zip(tvs, ts)), res: s}
        return _run(unknown, env)[tout]

    def jvp_cotangent(ct, *rest, tangents):
        # jax.linear_transpose gives zeros for a tangent the rule does not read (JAX
        # 0.12's tanh_cotangent, ct * r, reads no ans): the outer backward pass adds
        # them where JAX adds nothing. The op keeps that result on every JAX (the same
        # text); :func:`zero_results` names it, and the XLA backend drops it and the
        # adds of it before XLA sees them (fcir/interpreters/xla/zeros.py).
        aval = jax.ShapeDtypeStruct(ct.shape, ct.dtype, sharding=core.typeof(ct).sharding)
        n = bin(tangents).count("1")
        linear = functools.partial(_apply, jvp_tangent, rest, tangents)
        return list(jax.linear_transpose(linear, *[aval] * n)(ct))

    primal_p = _define(f"{name}_jvp", jvp_primal, results=lambda m: 2)
    tangent_p = _define(f"{name}_jvp_tangent", jvp_tangent)
    cotangent_p = _define(
        f"{name}_jvp_cotangent", jvp_cotangent, results=lambda m: bin(m).count("1")
    )

    def tangent_transpose(ct, *args, tangents):
        n = bin(tangents).count("1")
        if any(ad.is_undefined_primal(a) for a in args[n:]):
            raise ValueError(f"{tangent_p.name}: transposed in an operand it is not linear in")
        if type(ct) is ad.Zero:
            return [None] * len(args)
        cts = cotangent_p.bind(ct, *args[n:], tangents=tangents)
        return [*cts, *[None] * (len(args) - n)]

    ad.primitive_transposes[tangent_p] = tangent_transpose
    return primal_p, tangent_p, cotangent_p


def zero_results(name: str, attrs: dict, dtype) -> frozenset[int]:
    """The results of derivative op ``jax.<name>`` (attributes ``attrs``, operands of
    ``dtype``) that are zero whatever its operands, on the running JAX: a
    ``<op>_jvp_cotangent``'s cotangents of the tangents the running JAX's rule does not
    read (JAX 0.12's ``tanh_cotangent``, ``ct * r``, reads no ``ans``). Empty for every
    other op. JAX itself carries such a cotangent as a symbolic zero and adds nothing."""
    base = name.removesuffix("_jvp_cotangent")
    if base == name or base not in _EXPRESSIONS:
        return frozenset()
    mask, arity = attrs.get("tangents"), _EXPRESSIONS[base][1]
    dtype = jax.numpy.dtype(dtype)
    if isinstance(mask, bool) or not isinstance(mask, int) or mask <= 0 or mask >> arity:
        return frozenset()
    if not jax.numpy.issubdtype(dtype, jax.numpy.floating):
        return frozenset()
    split = _jvp_split(base, core.ShapedArray((), dtype), mask)
    if split is None:  # not an op capture writes (a hand-edited module): nothing known
        return frozenset()
    return frozenset(i for i, read in enumerate(split[-1]) if not read)


def _derivative_jvp(prim, name):
    fallback = ad.primitive_jvps[prim]

    def jvp(primals, tangents):
        mask = sum(1 << i for i, t in enumerate(tangents) if type(t) is not ad.Zero)
        split = _split_of(name, primals[0], mask) if CAPTURE_MODE.value else None
        if split is None:
            return fallback(primals, tangents)
        primal_p, tangent_p, _ = _SECOND[name]
        out, s = primal_p.bind(*primals, tangents=mask)
        ts = [t for i, t in enumerate(tangents) if mask >> i & 1]
        return out, tangent_p.bind(*ts, *primals, s, tangents=mask)

    ad.primitive_jvps[prim] = jvp


_EXPRESSIONS = {
    "tanh_residual": (_residual, 1),
    "tanh_tangent": (_tangent, 3),
    "tanh_cotangent": (_cotangent, 3),
    "tanh_cotangent_add": (_cotangent_add, 4),
}
tanh_residual_jvp_p, tanh_residual_jvp_tangent_p, tanh_residual_jvp_cotangent_p = _second_order(
    "tanh_residual"
)
tanh_tangent_jvp_p, tanh_tangent_jvp_tangent_p, tanh_tangent_jvp_cotangent_p = _second_order(
    "tanh_tangent"
)
tanh_cotangent_jvp_p, tanh_cotangent_jvp_tangent_p, tanh_cotangent_jvp_cotangent_p = _second_order(
    "tanh_cotangent"
)
(
    tanh_cotangent_add_jvp_p,
    tanh_cotangent_add_jvp_tangent_p,
    tanh_cotangent_add_jvp_cotangent_p,
) = _second_order("tanh_cotangent_add")
_SECOND = {
    "tanh_residual": (
        tanh_residual_jvp_p,
        tanh_residual_jvp_tangent_p,
        tanh_residual_jvp_cotangent_p,
    ),
    "tanh_tangent": (tanh_tangent_jvp_p, tanh_tangent_jvp_tangent_p, tanh_tangent_jvp_cotangent_p),
    "tanh_cotangent": (
        tanh_cotangent_jvp_p,
        tanh_cotangent_jvp_tangent_p,
        tanh_cotangent_jvp_cotangent_p,
    ),
    "tanh_cotangent_add": (
        tanh_cotangent_add_jvp_p,
        tanh_cotangent_add_jvp_tangent_p,
        tanh_cotangent_add_jvp_cotangent_p,
    ),
}
for _prim in (tanh_residual_p, tanh_tangent_p, tanh_cotangent_p, tanh_cotangent_add_p):
    _derivative_jvp(_prim, _prim.name)

#: fcir's derivative ops: name -> (operands, meaning), for docs/ops.md.
OPS = {
    "tanh_residual": (
        "ans",
        "what the running JAX's tanh JVP rule computes from ans = tanh(x) alone, in the "
        "forward pass (JAX 0.10.2: 1 - ans; 0.12: one_minus_square(ans))",
    ),
    "tanh_tangent": (
        "g, ans, r",
        "tanh's tangent g * tanh'(x), given ans = tanh(x) and r = tanh_residual(ans): "
        "the rest of the running JAX's rule (capture's version-neutral form of it)",
    ),
    "tanh_cotangent": (
        "ct, ans, r",
        "the transpose of tanh_tangent in g: jax.linear_transpose of the running JAX's rule",
    ),
    "tanh_cotangent_add": (
        "acc, ct, ans, r",
        "acc + tanh_cotangent(ct, ans, r), summed as the running JAX's backward pass sums "
        "it onto a cotangent already holding acc: one add per piece its transpose writes "
        "(JAX 0.10.2: (acc + u) + u*ans with u = ct*r; 0.12: acc + ct*r); capture writes it "
        "where a backward pass reaches tanh with a cotangent of its input in hand (the "
        "input used again after tanh)",
    ),
}
for _name, (_operands, _) in list(OPS.items()):
    OPS[f"{_name}_jvp"] = (
        _operands,
        f"the forward-pass half of the running JAX's JVP of {_name} (tangents "
        "on the operands in bitmask tangents): (its value, the one value the tangent needs "
        "from that pass, or the first operand again)",
    )
    OPS[f"{_name}_jvp_tangent"] = (
        f"tangents..., {_operands}, s",
        f"the linear half of that JVP of {_name}, from the tangents, the "
        f"operands and s (the second result of {_name}_jvp)",
    )
    OPS[f"{_name}_jvp_cotangent"] = (
        f"out_ct, {_operands}, s",
        f"the transpose of {_name}_jvp_tangent: one cotangent per tangent "
        "(jax.linear_transpose of the running JAX's equations); zero for a tangent the "
        "running JAX's rule does not read (JAX 0.12's tanh_tangent, tanh_cotangent and "
        "tanh_cotangent_add: ans's), which the XLA backend drops with the adds of it (JAX "
        "adds no symbolic zero)",
    )


def make_jaxpr(fn, *args, **kwargs):
    """``jax.make_jaxpr(fn, return_shape=True)(*args, **kwargs)`` as capture traces it: in
    capture mode, so that first derivatives of ``tanh`` are fcir's derivative ops (and
    their derivatives its second-order ops). When one of those had to be expanded into
    JAX's expression instead (differentiated where its JVP does not split, or batched
    over differing axes), the expansion would accumulate the outer cotangents in
    another order than ``jax.jit`` of ``fn`` (other bits), so ``fn`` is traced again
    with the running JAX's own rules."""
    with capturing() as probe:
        out = jax.make_jaxpr(fn, return_shape=True)(*args, **kwargs)
    if not probe.expanded:
        return out
    return jax.make_jaxpr(fn, return_shape=True)(*args, **kwargs)


# JAX 0.10.2 partially evaluates a custom_jvp_call with unknown inputs by inlining its
# primal function (the custom rule has been applied already: the call is in the linear
# part of a derivative); JAX 0.11 on keeps the call. Its XLA lowering inlines the called
# function either way (the same HLO), and fcir's IR omits the rule
# (#Omitted.derivative_rule), so while capturing fcir follows 0.10.2 on every JAX.
def _inline_custom_jvp_call(jax_method):
    def process_custom_jvp_call(self, prim, fun, jvp, tracers, /, *, symbolic_zeros):
        if not CAPTURE_MODE.value:
            return jax_method(self, prim, fun, jvp, tracers, symbolic_zeros=symbolic_zeros)
        tracers = [self.to_jaxpr_tracer(t) for t in tracers]
        if all(t.is_known() for t in tracers):
            with core.set_current_trace(self.parent_trace):
                vals = [t.pval[1] for t in tracers]
                return prim.bind(*vals, subfuns=(fun, jvp), symbolic_zeros=symbolic_zeros)
        with core.set_current_trace(self):
            return fun.call_wrapped(*tracers)

    return process_custom_jvp_call


if tuple(int(p) for p in jax.__version__.split(".")[:2]) >= (0, 11):
    from jax._src.interpreters import partial_eval as _pe

    _pe.JaxprTrace.process_custom_jvp_call = _inline_custom_jvp_call(
        _pe.JaxprTrace.process_custom_jvp_call
    )
