"""Structural zeros, removed from a Module before XLA sees it.

fcir's IR is the same under every supported JAX, so an op may have a result that is
zero whatever its operands on one JAX and not on another: a ``tanh_*_jvp_cotangent``
gives a cotangent for each tangent it was given, and under JAX 0.12 one of them is
zero (its rule does not read ``ans``; docs/ops.md, derivative ops). JAX's own trace of
the program carries that cotangent as a symbolic zero and adds nothing; the IR adds it
(``jax.add_any``), and through a scan (a zero ``ys`` of one scan, ``xs`` of the next)
XLA does not see that it adds a zero: the compiled program does more flops than
``jax.jit``'s. :func:`without_structural_zeros` does what JAX's symbolic zeros do,
starting only from results the running JAX's rules make zero
(``fcir.jaxcompat.derivatives.zero_results``):

- ``add_any(x, 0)`` is ``x`` (as JAX's ``add_jaxvals`` of a symbolic zero);
- ``tanh_cotangent_add(0, ct, ans, r)`` is ``tanh_cotangent(ct, ans, r)`` (a backward
  pass whose accumulator holds a symbolic zero writes the cotangent alone) and
  ``tanh_cotangent_add(acc, 0, ans, r)`` is ``acc`` (it writes nothing);
- a scan's zero operands leave the scan (a const or ``xs`` always, a carry when the
  body's new carry is zero too whenever it is, to a fixed point) and so do its zero
  results (zero ``ys``; carries as above): their values become zeros outside;
- any other use of a zero that no op computes any more reads an explicit zero
  (``broadcast_in_dim`` of a ``0.0`` constant, as JAX instantiates a symbolic zero).

A module without such results is returned as it is (the same object): nothing else
changes what any program computes. Each dropped ``add_any`` is one ``jax.jit`` of the
same function does not have, so its values stay bitwise ``jax.jit``'s (an add of
``+0.0`` would turn a ``-0.0`` into ``+0.0``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from fcir.ir import Module, Op, Region, Value, walk
from fcir.ir import attrs as A
from fcir.ir.types import PlacedType, TensorType, runtime_type
from fcir.jaxcompat import derivatives

__all__ = ["structural_zeros", "without_structural_zeros"]

#: ``zero_results(op) -> frozenset[int]``: the results of ``op`` zero whatever its operands.
ZeroResults = Callable[[Op], frozenset]


def structural_zeros(op: Op) -> frozenset:
    """The results of ``op`` that the running JAX's rules make zero (derivative ops)."""
    if not op.name.startswith("jax.tanh_") or not op.operands:
        return frozenset()
    t = op.operands[0].type
    while isinstance(t, PlacedType):
        t = t.member
    return derivatives.zero_results(op.name.removeprefix("jax."), op.attrs, t.np_dtype)


def without_structural_zeros(module: Module, zero_results: ZeroResults = structural_zeros):
    """``module`` with the structural zeros of ``zero_results`` removed (see the module
    doc): a new Module of the same signature, or ``module`` itself when it has none."""
    if not any(zero_results(op) for _, op in walk(module.main.body)):
        return module
    body, _ = _Rewrite(module.cardinality, zero_results).region(module.main.body, set(), set())
    main = dataclasses.replace(module.main, body=body)
    funcs = [main if f is module.main else f for f in module.funcs]
    return dataclasses.replace(module, funcs=funcs)


class _Zero:
    """A value known to be zero: ``computed`` is the value still computing it (an op's
    zero result), None when nothing does any more (then a use reads explicit zeros)."""

    def __init__(self, type, computed: Value | None = None):
        self.type, self.computed, self.explicit = type, computed, None


class _Rewrite:
    def __init__(self, cardinality, zero_results: ZeroResults):
        self.cardinality, self.zero_results = cardinality, zero_results

    def region(self, region: Region, zero_params: set, drop: set) -> tuple[Region, list[bool]]:
        """``region`` with params ``zero_params`` known zero (and left out) and results
        ``drop`` (zero ones) left out; and which of its results are zero."""
        env: dict = {}
        params = []
        for i, p in enumerate(region.params):
            if i in zero_params:
                env[p] = _Zero(p.type)
            else:
                env[p] = p
                params.append(p)
        ops: list[Op] = []
        for op in region.ops:
            self.op(op, env, ops)
        zero = [isinstance(env[v], _Zero) for v in region.results]
        results = [self.read(env[v], ops) for i, v in enumerate(region.results) if i not in drop]
        return Region(params, ops, results, region.label), zero

    def read(self, x, ops: list[Op]) -> Value:
        if not isinstance(x, _Zero):
            return x
        if x.computed is not None:
            return x.computed
        if x.explicit is None:
            t = runtime_type(x.type, self.cardinality)
            scalar = Value(_scalar(x.type))
            value = np.zeros((), t.np_dtype)
            ops.append(Op("fcir.constant", [], [scalar], {"value": A.Tensor.from_array(value)}))
            x.explicit = Value(x.type)
            attrs = {"broadcast_dimensions": (), "shape": t.shape, "sharding": None}
            ops.append(Op("jax.broadcast_in_dim", [scalar], [x.explicit], attrs))
        return x.explicit

    def op(self, op: Op, env: dict, ops: list[Op]) -> None:
        ins = [env[v] for v in op.operands]
        if op.name == "jax.add_any" and len(ins) == 2 and any(isinstance(x, _Zero) for x in ins):
            a, b = ins
            env[op.results[0]] = b if isinstance(a, _Zero) else a
            return
        if op.name == "jax.tanh_cotangent_add" and len(ins) == 4:
            acc, ct = ins[:2]
            if isinstance(ct, _Zero):
                env[op.results[0]] = acc
                return
            if isinstance(acc, _Zero):
                op = dataclasses.replace(op, name="jax.tanh_cotangent", operands=op.operands[1:])
                ins = ins[1:]
        if op.name == "jax.scan":
            self.scan(op, ins, env, ops)
            return
        regions = [self.region(r, set(), set())[0] for r in op.regions]
        ops.append(
            dataclasses.replace(op, operands=[self.read(x, ops) for x in ins], regions=regions)
        )
        zero = self.zero_results(op)
        for i, v in enumerate(op.results):
            env[v] = _Zero(v.type, v) if i in zero else v

    def scan(self, op: Op, ins: list, env: dict, ops: list[Op]) -> None:
        nc, nk = int(op.attrs["num_consts"]), int(op.attrs["num_carry"])
        body = op.regions[op.attrs["jaxpr"].index]
        fixed = {i for i, x in enumerate(ins) if isinstance(x, _Zero) and not nc <= i < nc + nk}
        carry = {i for i in range(nc, nc + nk) if isinstance(ins[i], _Zero)}
        while True:  # the carries that stay zero: start zero, and the body keeps them so
            _, zero = self.region(body, fixed | carry, set())
            kept = {i for i in carry if zero[i - nc]}
            if kept == carry:
                break
            carry = kept
        drop = {i - nc for i in carry} | {j for j in range(nk, len(zero)) if zero[j]}
        new_body, _ = self.region(body, fixed | carry, drop)
        gone = fixed | carry
        regions = list(op.regions)
        regions[op.attrs["jaxpr"].index] = new_body
        attrs = {
            **op.attrs,
            "num_consts": nc - sum(i < nc for i in gone),
            "num_carry": nk - len(carry),
        }
        operands = [self.read(x, ops) for i, x in enumerate(ins) if i not in gone]
        results = [v for j, v in enumerate(op.results) if j not in drop]
        ops.append(
            dataclasses.replace(
                op, operands=operands, results=results, attrs=attrs, regions=regions
            )
        )
        for j, v in enumerate(op.results):
            env[v] = _Zero(v.type) if j in drop else v


def _scalar(t):
    """The type of a scalar at the level of a value of type ``t`` (its placements)."""
    if isinstance(t, PlacedType):
        return dataclasses.replace(t, member=_scalar(t.member))
    return TensorType(t.dtype, ())
