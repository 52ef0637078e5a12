"""The DP aggregates for production: ``fed.dp_sum`` / ``fed.dp_mean`` decomposed into
what a DistributeAggregateForm round runs where.

One DP op becomes

* a ``fed.map`` that clips each client's pytree (``fcir.mechanisms.clipping.clip_member``):
  client_work;
* one ``fed.sum`` per leaf: client_to_server_aggregation, as ``federated_sum``;
* server ops drawing ``noise_multiplier * clip_norm * normal(fold_in(key, i))`` per leaf,
  added to the sums (and the division by the cardinality for ``dp_mean``):
  server_result, the key reaching it as temporary state.

The decomposition is traced from JAX (``fcir.capture``) with the very functions the
primitive's rules use, so it computes what the op computes. The privacy check runs on
the round as written (one op per release); the decomposed round is the same program
in plain ops and is not itself marked private (its ``fed.sum`` of clipped updates is
exactly what the check forbids outside a DP op). ``fcir.privacy.round_cost`` of the
original round goes into the manifest.
"""

from __future__ import annotations

import weakref

import jax

import fcir
from fcir import fed as F
from fcir.checker.check import check
from fcir.errors import ExportError
from fcir.fed.dp_sum import exact_params
from fcir.frontend.capture import capture
from fcir.ir import Func, Module, Op, Region, Value, walk
from fcir.ir.types import runtime_type
from fcir.mechanisms import lattice
from fcir.mechanisms.clipping import clip_member
from fcir.mechanisms.gaussian import dp_noise
from fcir.privacy import round_cost

from .ddp import mechanism
from .rewrite import clone_op

__all__ = ["Decomposition", "decompose", "gaussian_program", "manifest_entry"]


class Decomposition:
    """A production rule (``splitting.OP_RULES``) for an op the export rewrites into
    plain fed ops before the split: ``program(op, placement, n, member_shapes, mean=)``
    is an ``@fcir.program`` of ``(key or keys, *xs)`` computing ``op``."""

    def __init__(self, program, *, mean: bool):
        self.program, self.mean = program, mean

    def __call__(self, op: Op, placement: str, n: int, member_shapes):
        return self.program(op, placement, n, member_shapes, mean=self.mean)

    def __str__(self) -> str:
        return f"decomposed before the split ({self.program.__module__})"


def _decomposed(op: Op, rules: dict) -> Decomposition | None:
    rule = rules.get(F.ops().get(op.name))
    return rule if isinstance(rule, Decomposition) else None


def decompose(module: Module, rules: dict) -> Module:
    """``module`` with every top-level op whose entry in ``rules`` (op class -> rule)
    is a :class:`Decomposition` replaced by its plain ops: clip map, sums and server
    noise (the module itself if it has none). ExportError for such an op inside a
    region."""
    for path, op in walk(module.main.body):
        if _decomposed(op, rules) is not None and len(path) > 1:
            raise ExportError(
                f"{op.name} (op {'/'.join(map(str, path))}) sits inside a region; the "
                "production export decomposes DP aggregates of the round's top level only: "
                "move it out of the map or loop"
            )
    if not any(_decomposed(op, rules) for op in module.main.body.ops):
        return module
    main = module.main
    body = main.body
    env: dict[Value, Value] = {v: Value(v.type) for v in body.params}
    new = Region([env[v] for v in body.params], [], [], body.label)
    origin: list[int] = []  # new top-level op -> index of the user's op it comes from
    for i, op in enumerate(body.ops):
        rule = _decomposed(op, rules)
        if rule is None:
            new.ops.append(clone_op(op, env))
        else:
            outs = _splice(module, op, rule, new, [env[v] for v in op.operands])
            env.update(zip(op.results, outs))
        origin.extend([i] * (len(new.ops) - len(origin)))
    new.results = [env[v] for v in body.results]
    func = Func(main.name, new, main.arg_structure, main.result_structure)
    func.result_treedef = main.result_treedef
    out = check(Module(module.name, list(module.placements), [func], module.ir_version))
    # Errors about the decomposed round name the user's ops (see user_op).
    _ORIGINS[out] = (module, origin)
    return out


# decomposed module -> (the user's module, new op index -> user's op index)
_ORIGINS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def user_op(module: Module, index: int):
    """(the user's module, the user's op index) for top-level op ``index`` of a module
    that ``decompose`` made; None for any other module."""
    entry = _ORIGINS.get(module)
    if entry is None or index >= len(entry[1]):
        return None
    return entry[0], entry[1][index]


def gaussian_program(op: Op, placement: str, n: int, member_shapes, *, mean: bool):
    """An ``@fcir.program`` of ``(key, *xs)`` computing the central DP op ``op`` in plain
    fed ops: clipped members, one sum per leaf, noise from ``fold_in(key, i)``."""

    clip, z = op.attrs["clip_norm"], op.attrs["noise_multiplier"]
    if "gamma" in op.attrs:
        return _lattice_program(op, placement, n, member_shapes, mean=mean)

    @fcir.program(placements={placement: n})
    def decomposed(key, *xs):
        clipped = fcir.map_fn(lambda *m: tuple(clip_member(list(m), clip)), tuple(xs))
        totals = fcir.reduce_sum(list(clipped))
        out = []
        for i, t in enumerate(totals):
            noisy = t + dp_noise(key, i, t.shape, t.dtype, clip, z)
            out.append(noisy / n if mean else noisy)
        return out

    return decomposed


def _lattice_program(op: Op, placement: str, n: int, member_shapes, *, mean: bool):
    """Exact mode (``fcir.mechanisms.lattice``): each client clips and rounds to the
    grid (int32) in client_work, ``federated_sum`` adds the integers (exact, whoever
    replies), the server adds the integer noise and releases ``k * gamma``."""
    clip, z, gamma = (op.attrs[k] for k in ("clip_norm", "noise_multiplier", "gamma"))
    p = exact_params(
        n, clip, z, gamma, [s for s, _ in member_shapes], [d for _, d in member_shapes], op.name
    )

    @fcir.program(placements={placement: n})
    def decomposed(key, *xs):
        def grid(*m):
            return tuple(lattice.to_grid(c, gamma) for c in clip_member(list(m), clip))

        totals = fcir.reduce_sum(list(fcir.map_fn(grid, tuple(xs))))
        return [
            lattice.release(t + lattice.noise(key, i, t.shape, p), n, mean, gamma, dt)
            for i, (t, (_, dt)) in enumerate(zip(totals, member_shapes))
        ]

    return decomposed


def _splice(module: Module, op: Op, rule: Decomposition, region: Region, operands) -> list:
    placement = op.operands[0].type.placement
    n = module.cardinality(placement)
    shapes = [(v.type.member.shape, v.type.member.np_dtype) for v in op.operands[:-1]]
    decomposed = rule(op, placement, n, shapes)
    *xs, key = op.operands
    specs = [
        jax.ShapeDtypeStruct(rt.shape, rt.np_dtype)
        for rt in (runtime_type(v.type, module.cardinality) for v in (key, *xs))
    ]
    traced = capture(decomposed, *specs).main.body
    *x_vs, key_v = operands
    env = dict(zip(traced.params, [key_v, *x_vs]))
    for sub in traced.ops:
        region.ops.append(clone_op(sub, env))
    outs = [env[v] for v in traced.results]
    for old, new in zip(op.results, outs):
        if new.type != old.type:  # the op's type rule and the traced ops must agree
            raise ExportError(f"{op.name}: decomposed result {new.type}, expected {old.type}")
    return outs


def manifest_entry(module: Module) -> dict | None:
    """The privacy parameters the manifest states (None without DP ops)."""
    cost = round_cost(module)
    if cost is None:
        return None
    return {
        **cost,
        "private_program_checked": bool(module.private),
        "mechanism": mechanism(cost) or "Gaussian: each client's update clipped in "
        "client_work, summed with federated_sum, noise added in server_result; "
        "client-level DP (add or remove one client)",
    }


