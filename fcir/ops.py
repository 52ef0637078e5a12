"""The federated ops: one class per op with its primitive, numbered constraints and
type rule. Backends add execution rules in their own modules (``interpreters/``).

Constraint messages are quoted in errors as ``fed.broadcast/C2: ...``; each has a
negative test named after it in tests/test_check.py.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from fcir import primitives as P
from fcir.types import SERVER, PlacedType, TensorType, Type


class Violation(Exception):
    """Raised by a type rule; the checker turns it into a located diagnostic."""

    def __init__(self, op_cls, code: str, detail: str = ""):
        self.code = f"{op_cls.name}/{code}"
        text = op_cls.constraints[code]
        super().__init__(f"{self.code}: {text}" + (f" ({detail})" if detail else ""))
        self.placement = code in op_cls.placement_constraints


class Context:
    """Where an op sits: ``level`` -1 is the server, i is inside a map over placement i."""

    def __init__(self, placements: list[tuple[str, int]], level: int):
        self.names = [p for p, _ in placements]
        self.level = level

    @property
    def here(self) -> str:
        return SERVER if self.level < 0 else self.names[self.level]

    @property
    def child(self) -> str | None:
        return self.names[self.level + 1] if self.level + 1 < len(self.names) else None

    def local(self, t: TensorType) -> Type:
        return PlacedType(t, SERVER, True) if self.level < 0 else t

    def is_local(self, t: Type) -> bool:
        if self.level < 0:
            return isinstance(t, PlacedType) and t.placement == SERVER
        return isinstance(t, TensorType)

    def member_of_local(self, t: Type) -> Type:
        return t.member if self.level < 0 else t


class FedOp:
    name: ClassVar[str]
    primitive: ClassVar = None
    constraints: ClassVar[dict[str, str]]
    placement_constraints: ClassVar[frozenset[str]] = frozenset()
    registry: ClassVar[dict[str, type[FedOp]]] = {}

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        if "name" in cls.__dict__:  # abstract bases such as _Reduce define no name
            FedOp.registry[cls.name] = cls

    @classmethod
    def fail(cls, code: str, detail: str = ""):
        raise Violation(cls, code, detail)

    @classmethod
    def verify(cls, op, ctx: Context) -> None:
        raise NotImplementedError

    @classmethod
    def placed_operand(cls, ctx: Context, v, code_placement: str, allow_all_equal=True):
        t = v.type
        if not isinstance(t, PlacedType) or t.placement == SERVER:
            hint = ""
            if ctx.child is not None and isinstance(t, PlacedType):
                hint = (
                    f"; a value computed at '{ctx.here}' reaches the members of "
                    f"'{ctx.child}' only through fed.broadcast (every member gets the same "
                    "value): pass per-member values as client data"
                )
            cls.fail(code_placement, f"operand has type {t}{hint}")
        if ctx.child is None or t.placement != ctx.child:
            cls.fail(
                code_placement,
                f"operand is placed at '{t.placement}'; from '{ctx.here}' the placement "
                f"below is {ctx.child!r}",
            )
        if t.all_equal and not allow_all_equal:
            cls.fail(code_placement, f"operand has all-equal type {t}")
        return t


def _arity(cls, op, operands: int, results: int, regions: int = 0) -> None:
    if len(op.operands) != operands or len(op.results) != results or len(op.regions) != regions:
        cls.fail(
            "C1",
            f"has {len(op.operands)} operands, {len(op.results)} results, "
            f"{len(op.regions)} regions",
        )


class Broadcast(FedOp):
    """Sends a value to every member of the placement below: ``T@p -> T@child!``."""

    name = "fed.broadcast"
    primitive = P.broadcast_p
    constraints = {
        "C1": "takes one operand and gives one result",
        "C2": "operand must be placed at the parent of the target placement",
        "C3": "attribute 'to' must name the placement directly below the current one",
        "C4": "result type must be T@to! where T is the operand's member type",
    }
    placement_constraints = frozenset({"C2", "C3"})

    @classmethod
    def verify(cls, op, ctx):
        _arity(cls, op, 1, 1)
        to = op.attrs.get("to")
        if not isinstance(to, str) or to != ctx.child:
            cls.fail("C3", f"to={to!r}, placement below '{ctx.here}' is {ctx.child!r}")
        x = op.operands[0].type
        if not ctx.is_local(x):
            cls.fail("C2", f"operand type {x} is not local to '{ctx.here}'")
        expected = PlacedType(ctx.member_of_local(x), to, True)
        if op.results[0].type != expected:
            cls.fail("C4", f"result {op.results[0].type}, expected {expected}")


class Map(FedOp):
    """Applies its region to each member: ``({T...}@p) -> {U...}@p``."""

    name = "fed.map"
    primitive = P.map_p
    constraints = {
        "C1": "has exactly one region, at least one operand, one region parameter per operand "
        "and one result per yielded value",
        "C2": "every operand must be placed at the placement directly below the current one",
        "C3": "region parameter i must have the member type of operand i",
        "C4": "result i must be {U}@p where U is the type of the i-th yielded value",
    }
    placement_constraints = frozenset({"C2"})

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


def _mean_dtype(dtype: str) -> str:
    from fcir.types import dtype_from_name, dtype_name

    return dtype_name(P.mean_result_dtype(dtype_from_name(dtype)))


class _Reduce(FedOp):
    constraints = {
        "C1": "takes one operand and gives one result",
        "C2": "operand must be placed at the placement directly below the current one",
        "C3": "result must be the operand's member type, local to the current placement",
    }
    placement_constraints = frozenset({"C2"})

    @classmethod
    def result_member(cls, member: Type) -> Type:
        return member

    @classmethod
    def verify(cls, op, ctx):
        _arity(cls, op, 1, 1)
        t = cls.placed_operand(ctx, op.operands[0], "C2")
        cls.extra(op, t)
        expected = ctx.local(cls.result_member(t.member)) if isinstance(
            t.member, TensorType
        ) else (PlacedType(t.member, SERVER, True) if ctx.level < 0 else t.member)
        if op.results[0].type != expected:
            cls.fail("C3", f"result {op.results[0].type}, expected {expected}")

    @classmethod
    def extra(cls, op, t: PlacedType) -> None:
        pass


class Sum(_Reduce):
    """Sum over members: ``{T}@child -> T``; bool members are counted in i32."""

    name = "fed.sum"
    primitive = P.sum_p
    constraints = {
        **_Reduce.constraints,
        "C3": "result must be the operand's member type (i32 for bool members), local to the "
        "current placement",
    }

    @classmethod
    def result_member(cls, member):
        from fcir.types import dtype_from_name, dtype_name

        return TensorType(dtype_name(P.sum_result_dtype(dtype_from_name(member.dtype))),
                          member.shape)


class Mean(_Reduce):
    """Mean over members: ``{T}@child -> T``; integer and bool members give f32."""

    name = "fed.mean"
    primitive = P.mean_p
    constraints = {
        **_Reduce.constraints,
        "C3": "result must be the operand's member type (f32 for integer and bool members), "
        "local to the current placement",
    }

    @classmethod
    def result_member(cls, member):
        return TensorType(_mean_dtype(member.dtype), member.shape)


class Min(_Reduce):
    """Elementwise minimum over members: ``{T}@child -> T``."""

    name = "fed.min"
    primitive = P.min_p


class Max(_Reduce):
    """Elementwise maximum over members: ``{T}@child -> T``."""

    name = "fed.max"
    primitive = P.max_p


class SecureSum(_Reduce):
    """Sum modulo ``2**bitwidth`` by secure aggregation: ``{iN[...]}@child -> iN[...]``."""

    name = "fed.secure_sum"
    primitive = P.secure_sum_p
    constraints = {
        **_Reduce.constraints,
        "C4": "operand must be an integer tensor",
        "C5": "attribute 'bitwidth' must be an int in [1, bits of the operand dtype]",
    }

    @classmethod
    def extra(cls, op, t):
        member = t.member
        if not isinstance(member, TensorType) or member.dtype[0] not in "iu":
            cls.fail("C4", f"operand member type {member}")
        bits = int(member.dtype[1:]) if member.dtype[1:].isdigit() else 0
        bw = op.attrs.get("bitwidth")
        if isinstance(bw, bool) or not isinstance(bw, int) or not 1 <= bw <= bits:
            cls.fail("C5", f"bitwidth={bw!r} for {member.dtype}")


class WeightedMean(FedOp):
    """``sum(w*x)/sum(w)`` over members: ``({T}@child, {W}@child) -> T``."""

    name = "fed.weighted_mean"
    primitive = P.weighted_mean_p
    constraints = {
        "C1": "takes two operands (values, weights) and gives one result",
        "C2": "values and weights must be placed at the placement directly below the current one",
        "C3": "the weight shape must be a prefix of the value shape (a scalar per member, or "
        "one weight per element)",
        "C4": "weights must be numeric",
        "C5": "result must be the value member type (f32 for integer members), local to the "
        "current placement",
    }
    placement_constraints = frozenset({"C2"})

    @classmethod
    def verify(cls, op, ctx):
        _arity(cls, op, 2, 1)
        x = cls.placed_operand(ctx, op.operands[0], "C2")
        w = cls.placed_operand(ctx, op.operands[1], "C2")
        if not isinstance(x.member, TensorType) or not isinstance(w.member, TensorType):
            cls.fail("C3", "nested placed members are not supported")
        if tuple(x.member.shape[: len(w.member.shape)]) != tuple(w.member.shape):
            cls.fail("C3", f"weights {w.member}, values {x.member}")
        if w.member.dtype == "bool" or w.member.dtype.startswith("key<"):
            cls.fail("C4", f"weights {w.member}")
        expected = ctx.local(TensorType(_mean_dtype(x.member.dtype), x.member.shape))
        if op.results[0].type != expected:
            cls.fail("C5", f"result {op.results[0].type}, expected {expected}")


class DpSum(FedOp):
    """Differentially private sum of a pytree: each member's leaves are clipped to global
    L2 norm ``clip_norm``, summed, and Gaussian noise of std ``noise_multiplier *
    clip_norm`` is added where the result lives:
    ``({T1}@child, ..., {Tk}@child, K) -> (T1, ..., Tk)``, ``K`` a PRNG key local to
    the current placement. Leaf ``i``'s noise is drawn with ``fold_in(key, i)``."""

    name = "fed.dp_sum"
    primitive = P.dp_sum_p
    constraints = {
        "C1": "takes k >= 1 value operands followed by one key operand, and gives k results",
        "C2": "value operands must be placed at the placement directly below the current one",
        "C3": "the last operand must be a PRNG key (key<...>[] or u32[2]) local to the "
        "current placement",
        "C4": "value operands must be floating-point tensors",
        "C5": "attribute 'clip_norm' must be a finite float > 0 and 'noise_multiplier' a "
        "finite float >= 0",
        "C6": "result i must be operand i's member type, local to the current placement",
    }
    placement_constraints = frozenset({"C2", "C3"})

    @classmethod
    def verify(cls, op, ctx):
        k = len(op.operands) - 1
        if k < 1 or len(op.results) != k or op.regions:
            cls.fail(
                "C1",
                f"has {len(op.operands)} operands, {len(op.results)} results, "
                f"{len(op.regions)} regions",
            )
        key = op.operands[-1].type
        member = ctx.member_of_local(key) if ctx.is_local(key) else None
        if not isinstance(member, TensorType) or not (
            (member.dtype.startswith("key<") and member.shape == ())
            or (member.dtype == "u32" and tuple(member.shape) == (2,))
        ):
            cls.fail("C3", f"key operand has type {key}")
        for name in ("clip_norm", "noise_multiplier"):
            a = op.attrs.get(name)
            low_ok = (a > 0) if name == "clip_norm" else (a >= 0)
            if not isinstance(a, float) or not np.isfinite(a) or not low_ok:
                cls.fail("C5", f"{name}={a!r}")
        for i, (v, r) in enumerate(zip(op.operands[:-1], op.results)):
            t = cls.placed_operand(ctx, v, "C2")
            if not isinstance(t.member, TensorType) or not (
                t.member.dtype.startswith("f") or t.member.dtype == "bf16"
            ):
                cls.fail("C4", f"operand {i} has member type {t.member}")
            if r.type != ctx.local(t.member):
                cls.fail("C6", f"result {i} is {r.type}, expected {ctx.local(t.member)}")


class DpMean(DpSum):
    """``fed.dp_sum`` divided by the cardinality of the placement summed over (the noise
    too): ``({T1}@child, ..., {Tk}@child, K) -> (T1, ..., Tk)``."""

    name = "fed.dp_mean"
    primitive = P.dp_mean_p


# The ops that release client data to the placement above only through the Gaussian
# mechanism: the privacy check lets their results through, the accountant counts them.
DP_OPS = frozenset({"fed.dp_sum", "fed.dp_mean", "fed.ddp_sum", "fed.ddp_mean"})

from fcir import ddp_ops as _ddp_ops  # noqa: E402, F401  (registers fed.ddp_sum/mean)

FED_OPS: dict[str, type[FedOp]] = dict(FedOp.registry)

# Collectives over a named axis: inside a fed.map over a placement they would be
# client-to-client communication.
COLLECTIVES = frozenset(
    "psum pmax pmin pmean ppermute pbroadcast all_gather all_to_all axis_index psum_scatter "
    "reduce_scatter psum_invariant pvary".split()
)


def dtype_bits(dtype: str) -> int:
    from fcir.types import dtype_from_name

    return np.dtype(dtype_from_name(dtype)).itemsize * 8
