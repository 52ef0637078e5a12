"""The reference interpreter: the oracle every other backend is tested against.

Federated ops get literal per-member semantics: ``fed.map`` runs its region once per
member in a Python loop, reductions add members one at a time in member order, and
``fed.broadcast`` copies the value to each member. Local ops run eagerly, op by op.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from fcir import fed as F
from fcir.base_interpreter import Interpreter, impl, is_placed
from fcir.checker.check import check
from fcir.errors import InterpreterError
from fcir.fed.dp_sum import exact_params
from fcir.frontend import jaxpr_cache as captured
from fcir.ir import Module, Op, walk
from fcir.ir.control_flow import scan_axis
from fcir.ir.types import runtime_type
from fcir.mechanisms import ddgauss as ddp
from fcir.mechanisms import lattice
from fcir.mechanisms.clipping import clip_member
from fcir.mechanisms.gaussian import dp_noise
from fcir.opkit.primitives import accumulation_dtype, mean_result_dtype, sum_result_dtype
from fcir.privacy import keys as dp_keys


@functools.cache
def _compiled_encode():
    """``fcir.mechanisms.ddgauss.encode`` compiled once per shapes and parameters: run op by op, each
    client's encoding dispatched its sampler's while loops afresh (over a hundred XLA
    compiles, seconds per client)."""
    return jax.jit(ddp.encode, static_argnums=2)


def _members(x) -> list:
    return [x[i] for i in range(x.shape[0])]


class ReferenceInterpreter(Interpreter):
    """Eager, per-member semantics. Subclass it to override single ops."""

    def run(self, module: Module, *args, intermediates: bool = False, **kwargs):
        """``Interpreter.run``, on a module that passes ``fcir.check``: the oracle runs
        only what the IR's rules allow, as ``xla.compile`` does (an IR file edited by
        hand, or read from disk, fails naming the op instead of giving numbers whose
        types disagree with the module's). Checked once per module while unchanged."""
        if isinstance(module, Module) and not captured.checked(module):
            check(module)
            captured.mark_checked(module)
        args, kwargs = jax.tree.map(_unsharded, (args, kwargs))
        return super().run(module, *args, intermediates=intermediates, **kwargs)

    @impl(F.Broadcast)
    def broadcast(self, op, x):
        n = self.module.cardinality(op.attrs["to"])
        return jnp.stack([jnp.asarray(x)] * n)

    @impl(F.Map)
    def map(self, op, *args):
        n = self.module.cardinality(op.operands[0].type.placement)
        region = op.regions[0]
        per_member = [self.run_region(region, [a[i] for a in args]) for i in range(n)]
        return [jnp.stack([outs[j] for outs in per_member]) for j in range(len(op.results))]

    @impl(F.Sum)
    def sum(self, op, x):
        dt = sum_result_dtype(x.dtype)
        return _member_total(x, dt).astype(dt)

    @impl(F.Mean)
    def mean(self, op, x):
        dt = mean_result_dtype(x.dtype)
        total = _member_total(x, dt)
        return (total * _reciprocal(x.shape[0], total.dtype)).astype(dt)

    @impl(F.Min)
    def min(self, op, x):
        out = x[0]
        for m in _members(x)[1:]:
            out = jnp.minimum(out, m)
        return out

    @impl(F.Max)
    def max(self, op, x):
        out = x[0]
        for m in _members(x)[1:]:
            out = jnp.maximum(out, m)
        return out

    @impl(F.WeightedMean)
    def weighted_mean(self, op, x, w):
        dt = mean_result_dtype(x.dtype)
        acc = accumulation_dtype(dt)  # products in dt, sums in acc: jnp.sum's rounding
        num = den = None
        for xi, wi in zip(_members(x), _members(w)):
            xi = jnp.asarray(xi).astype(dt)
            wi = jnp.asarray(wi).astype(dt).reshape(wi.shape + (1,) * (xi.ndim - wi.ndim))
            term = (xi * wi).astype(acc)
            num = term if num is None else num + term
            den = wi.astype(acc) if den is None else den + wi.astype(acc)
        num, den = num.astype(dt), den.astype(dt)
        if np.any(np.asarray(den) == 0):
            raise InterpreterError(
                f"{op.name}: the total weight is zero, so the weighted mean is undefined"
            )
        return (num / den).astype(dt)

    @impl(F.SecureSum)
    def secure_sum(self, op, x):
        bits = op.attrs["bitwidth"]
        modulus = 1 << bits
        total = 0
        for m in _members(np.asarray(x).astype(object)):
            total = (total + m) % modulus
        total = np.asarray(total, dtype=object)
        width = np.dtype(x.dtype).itemsize * 8
        if bits == width and jnp.issubdtype(x.dtype, jnp.signedinteger):
            # A full-width sum wraps in two's complement (as jit's int add does): the
            # residue r in [0, 2**bits) is the signed value r - 2**bits from 2**(bits-1).
            total = np.where(total >= modulus >> 1, total - modulus, total)
        return jnp.asarray(total.astype(x.dtype))

    @impl(*(c for c in F.ops().values() if c.reference is not None))
    def numpy_reduction(self, op, x):
        """The ops whose module states their semantics in numpy (``reference``, members
        along axis 0): the order statistics."""
        out = F.ops()[op.name].reference(np.asarray(x), op.attrs)
        return jnp.asarray(out)

    @impl(F.DpSum)
    def dp_sum(self, op, *args):
        return self._dp(op, args, mean=False)

    @impl(F.DpMean)
    def dp_mean(self, op, *args):
        return self._dp(op, args, mean=True)

    def _dp(self, op, args, *, mean: bool):
        """Clip each member on its own, add the members in member order, then add the
        noise once: the Gaussian mechanism as the op's definition states it."""
        *xs, key = args
        clip, z = op.attrs["clip_norm"], op.attrs["noise_multiplier"]
        n = xs[0].shape[0]
        if "gamma" in op.attrs:
            return self._dp_exact(op, xs, key, n, mean)
        totals = None
        for i in range(n):
            clipped = clip_member([x[i] for x in xs], clip)
            clipped = [c.astype(accumulation_dtype(c.dtype)) for c in clipped]  # as jnp.sum
            totals = clipped if totals is None else [t + c for t, c in zip(totals, clipped)]
        out = []
        for i, (t, x) in enumerate(zip(totals, xs)):
            t = t.astype(x.dtype)
            noisy = t + dp_noise(key, i, t.shape, t.dtype, clip, z)
            out.append(noisy * _reciprocal(n, noisy.dtype) if mean else noisy)
        return out

    def _dp_exact(self, op, xs, key, n: int, mean: bool):
        """Exact mode (``fcir.mechanisms.lattice``): each member clipped and rounded to
        the grid on its own, the integers added member by member in Python integers,
        the integer noise added once, the release ``k * gamma``."""
        clip, z, gamma = (op.attrs[k] for k in ("clip_norm", "noise_multiplier", "gamma"))
        p = exact_params(
            n, clip, z, gamma, [x.shape[1:] for x in xs], [x.dtype for x in xs], op.name
        )
        totals = [np.zeros(x.shape[1:], dtype=object) for x in xs]
        for i in range(n):
            clipped = clip_member([x[i] for x in xs], clip)
            for t, c in zip(totals, clipped):
                t += np.asarray(lattice.to_grid(c, gamma)).astype(object)
        out = []
        for i, (t, x) in enumerate(zip(totals, xs)):
            noisy = t + np.asarray(lattice.noise(key, i, t.shape, p)).astype(object)
            k = jnp.asarray(noisy.astype(np.int64).astype(np.int32))  # |k| <= 2**24: exact
            out.append(lattice.release(k, n, mean, gamma, x.dtype))
        return out

    @impl(F.DdpSum)
    def ddp_sum(self, op, *args):
        return self._ddp(op, args, mean=False)

    @impl(F.DdpMean)
    def ddp_mean(self, op, *args):
        return self._ddp(op, args, mean=True)

    def _ddp(self, op, args, *, mean: bool):
        """Each client encodes its own pytree with its own key (``fcir.mechanisms.ddgauss.encode``), the
        residues are added modulo ``2**bits`` one client at a time in Python integers (the
        secure sum), and the server decodes: the mechanism as ``fcir.mechanisms.ddgauss`` states it."""
        *xs, keys = args
        dp_keys.check_member_keys(op, keys)  # the type rule sees only broadcast keys
        n = xs[0].shape[0]
        p = ddp.attr_params(op.attrs, ddp.member_dim(x.shape[1:] for x in xs), n, op.name)
        total = np.zeros(p.padded_dim, dtype=object)
        encode = _compiled_encode()
        for i in range(n):
            share = np.asarray(encode([x[i] for x in xs], keys[i], p)).astype(object)
            total = (total + share) % p.modulus
        like = [x[0] for x in xs]
        return ddp.decode(jnp.asarray(total.astype(np.uint32)), p, like, mean)

    # Control flow whose regions hold fed ops or placed values runs eagerly, region by
    # region, so that the fed ops inside keep their per-member semantics; so does control
    # flow whose regions hold an op a subclass overrides, so that its rule sees every
    # iteration (traced into the loop primitive, it would run once per trace). Other
    # local control flow binds its primitive as everywhere else.
    def _eager(self, op) -> bool:
        return _federated(op) or _overrides_inside(type(self), op)

    @impl("jax.scan")
    def scan(self, op, *args):
        if not self._eager(op):
            return super().scan(op, *args)
        nc, nk = int(op.attrs["num_consts"]), int(op.attrs["num_carry"])
        length = int(op.attrs["length"])
        body = op.regions[op.attrs["jaxpr"].index]
        consts, carry, xs = list(args[:nc]), list(args[nc : nc + nk]), args[nc + nk :]
        # A placed xs is stacked inside its members (fcir.ir.control_flow.scan_axis).
        axes = [scan_axis(v.type) for v in op.operands[nc + nk :]]
        ys: list = [None] * length
        steps = range(length - 1, -1, -1) if op.attrs.get("reverse") else range(length)
        for t in steps:
            sliced = [jnp.take(x, t, axis=a) for x, a in zip(xs, axes)]
            outs = self.run_region(body, consts + carry + sliced)
            carry, ys[t] = list(outs[:nk]), outs[nk:]
        stacked = []
        for j, v in enumerate(op.results[nk:]):
            if length == 0:
                rt = runtime_type(v.type, self.module.cardinality)
                stacked.append(jnp.zeros(rt.shape, rt.np_dtype))
            else:
                stacked.append(jnp.stack([y[j] for y in ys], axis=scan_axis(v.type)))
        return carry + stacked

    @impl("jax.while")
    def while_loop(self, op, *args):
        if not self._eager(op):
            return self.local(op, *args)
        cn, bn = int(op.attrs["cond_nconsts"]), int(op.attrs["body_nconsts"])
        cond = op.regions[op.attrs["cond_jaxpr"].index]
        body = op.regions[op.attrs["body_jaxpr"].index]
        carry = list(args[cn + bn :])
        while bool(self.run_region(cond, list(args[:cn]) + carry)[0]):
            carry = list(self.run_region(body, list(args[cn : cn + bn]) + carry))
        return carry

    @impl("jax.cond")
    def cond(self, op, index, *ops):
        if not self._eager(op):
            return self.local(op, index, *ops)
        branches = op.attrs["branches"]
        # lax.switch clamps its index before the cond; the cond itself clamps too.
        i = min(max(int(index), 0), len(branches) - 1)
        return self.run_region(op.regions[branches[i].index], list(ops))

    def local(self, op, *args):
        """A ``jax.*`` op's JAX meaning; a call (a nested ``jax.jit``) holding an op a
        subclass overrides runs its region op by op, so that the rule sees each run."""
        if op.name.removeprefix("jax.") in _CALLS and _overrides_inside(type(self), op):
            return self.run_region(op.regions[0], list(args))
        return super().local(op, *args)

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


# Call-like primitives whose one region takes the op's operands (pjit is jit before
# JAX 0.12): run region by region when a subclass overrides an op inside them.
_CALLS = ("pjit", "jit", "closed_call", "core_call")


def _overridden(cls) -> frozenset[str] | None:
    """The op names whose rule ``cls`` (a ReferenceInterpreter subclass) defines itself,
    or None when it overrides ``local`` or ``bind``, the rule of every ``jax.*`` op."""
    if cls is ReferenceInterpreter:
        return frozenset()
    cached = vars(cls).get("_fcir_overridden", False)
    if cached is not False:
        return cached
    if cls.local is not ReferenceInterpreter.local or cls.bind is not Interpreter.bind:
        found = None
    else:
        base = ReferenceInterpreter._impls
        found = frozenset(
            name for name, method in cls._impls.items()
            if isinstance(method, str) and (
                not isinstance(base.get(name), str)
                or getattr(cls, method) is not getattr(ReferenceInterpreter, base[name])
            )
        )
    cls._fcir_overridden = found
    return found


def _overrides_inside(cls, op: Op) -> bool:
    """Whether ``cls`` has a rule of its own for an op in ``op``'s regions."""
    names = _overridden(cls)
    if names is not None and not names:
        return False
    return any(
        o.name.startswith("jax.") if names is None else o.name in names
        for sub in op.regions for _, o in walk(sub)
    )
def _unsharded(x):
    """An argument leaf split over a mesh with ``Explicit`` axes, replicated over that
    mesh: its type says how it is split, and JAX refuses the oracle's per-member reads of
    a member axis typed as split (``x[i]``: "ShardingTypeError: Use
    .at[...].get(out_sharding=)"). Replicated, on the same mesh (inside ``jax.set_mesh``
    eager ops refuse arrays on one device), each read is a plain slice; a layout never
    changes a value."""
    sharding = getattr(x, "sharding", None)
    if not isinstance(x, jax.Array) or not isinstance(sharding, jax.sharding.NamedSharding):
        return x
    if jax.sharding.AxisType.Explicit not in tuple(sharding.mesh.axis_types) or all(
        e is None for e in sharding.spec
    ):
        return x
    return jax.device_put(x, jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec()))


def _federated(op: Op) -> bool:
    """Whether a control-flow op passes placed values or runs fed ops in its regions."""
    if any(is_placed(v.type) for v in [*op.operands, *op.results]):
        return True
    return any(o.name.startswith("fed.") for sub in op.regions for _, o in walk(sub))


def _member_total(x, dt):
    """The members of ``x`` added one by one in ``dt``'s accumulation dtype (f32 for
    f16/bf16, as ``jnp.sum`` and ``jnp.mean`` accumulate)."""
    members = [jnp.asarray(m).astype(accumulation_dtype(dt)) for m in _members(x)]
    total = members[0]
    for m in members[1:]:
        total = total + m
    return total


def _reciprocal(n: int, dtype):
    """``1 / n`` rounded once to ``dtype``, the dtype of a total being averaged: a mean
    is the total times it, as ``jnp.mean`` and a jitted ``total / n`` compile (XLA turns
    the division by the constant ``n`` into a multiplication by its reciprocal, 1 ulp
    from a division for some totals: the mean of the ints [0, 0, 0, 0, 1, 1, 1] is
    0.42857146, where 3 / 7 is 0.42857143)."""
    one = np.asarray(1, dtype)
    return one / np.asarray(n, dtype)


def run(module: Module, *args, intermediates: bool = False, **kwargs):
    """Runs ``module`` eagerly with per-member semantics; returns the output pytree.
    Keyword arguments are those the module was captured with (``fcir.capture(f, w,
    x=x)``: ``run(module, w, x=x)``)."""
    return ReferenceInterpreter().run(module, *args, intermediates=intermediates, **kwargs)
