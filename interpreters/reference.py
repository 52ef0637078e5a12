"""The reference interpreter: the oracle every other backend is tested against.

Federated ops get literal per-member semantics: ``fed.map`` runs its region once per
member in a Python loop, reductions add members one at a time in member order, and
``fed.broadcast`` copies the value to each member. Local ops run eagerly, op by op.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from fcir.errors import InterpreterError
from fcir.interpreter import Interpreter, impl
from fcir.ir import Module
from fcir.primitives import mean_result_dtype, sum_result_dtype


def _members(x) -> list:
    return [x[i] for i in range(x.shape[0])]


class ReferenceInterpreter(Interpreter):
    """Eager, per-member semantics. Subclass it to override single ops."""

    @impl("fed.broadcast")
    def broadcast(self, op, x):
        n = self.module.cardinality(op.attrs["to"])
        return jnp.stack([jnp.asarray(x)] * n)

    @impl("fed.map")
    def map(self, op, *args):
        n = self.module.cardinality(op.operands[0].type.placement)
        region = op.regions[0]
        per_member = [self.run_region(region, [a[i] for a in args]) for i in range(n)]
        return [jnp.stack([outs[j] for outs in per_member]) for j in range(len(op.results))]

    @impl("fed.sum")
    def sum(self, op, x):
        dt = sum_result_dtype(x.dtype)
        members = [m.astype(dt) for m in _members(x)]
        total = members[0]
        for m in members[1:]:
            total = total + m
        return total

    @impl("fed.mean")
    def mean(self, op, x):
        dt = mean_result_dtype(x.dtype)
        members = [m.astype(dt) for m in _members(x)]
        total = members[0]
        for m in members[1:]:
            total = total + m
        return (total / len(members)).astype(dt)

    @impl("fed.min")
    def min(self, op, x):
        out = x[0]
        for m in _members(x)[1:]:
            out = jnp.minimum(out, m)
        return out

    @impl("fed.max")
    def max(self, op, x):
        out = x[0]
        for m in _members(x)[1:]:
            out = jnp.maximum(out, m)
        return out

    @impl("fed.weighted_mean")
    def weighted_mean(self, op, x, w):
        dt = mean_result_dtype(x.dtype)
        num = den = None
        for xi, wi in zip(_members(x), _members(w)):
            xi = xi.astype(dt)
            wi = wi.astype(dt).reshape(wi.shape + (1,) * (xi.ndim - wi.ndim))
            num = xi * wi if num is None else num + xi * wi
            den = wi if den is None else den + wi
        if np.any(np.asarray(den) == 0):
            raise InterpreterError(
                "fed.weighted_mean: the total weight is zero, so the weighted mean is undefined"
            )
        return (num / den).astype(dt)

    @impl("fed.secure_sum")
    def secure_sum(self, op, x):
        bits = op.attrs["bitwidth"]
        modulus = 1 << bits
        total = 0
        for m in _members(np.asarray(x).astype(object)):
            total = (total + m) % modulus
        # A full-width sum of a signed dtype is its two's-complement bits read as signed
        # (jnp.sum's wrap-around); a narrower one is the low bits, never negative.
        dtype = np.dtype(x.dtype)
        if dtype.kind == "i":
            full = 1 << (dtype.itemsize * 8)
            total = np.where(np.asarray(total) >= full // 2, np.asarray(total) - full, total)
        return jnp.asarray(np.asarray(total).astype(x.dtype))


    # Layout ops change where a value lives, never what it is: the oracle ignores them,
    # so a module captured under a mesh runs without one.
    @impl("jax.sharding_constraint")
    def sharding_constraint(self, op, x):
        return x

    @impl("jax.reshard")
    def reshard(self, op, x):
        return x

    @impl("jax.mesh_cast")
    def mesh_cast(self, op, x):
        return x


def run(module: Module, *args, intermediates: bool = False):
    """Runs ``module`` eagerly with per-member semantics; returns the output pytree."""
    return ReferenceInterpreter().run(module, *args, intermediates=intermediates)
