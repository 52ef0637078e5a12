"""What every fed op declares, and the registry that every list of fed ops is read from.

A fed op is one class in one module of ``fcir.fed``: its name, its JAX primitive, its
*kind*, its attribute schema and its numbered constraints. Defining the class registers
it (``__init_subclass__``: no registration call to forget). Capture, the checker, the
interpreters, privacy, traffic, streaming and the exports read what they need from
here (``of_kind``, ``by_primitive``) instead of keeping their own name lists.

Constraint texts are quoted in errors as ``fed.broadcast/C2: ...`` both while tracing
(``FedOp.error``, raised by the primitive's abstract evaluation) and by ``fcir check``
(``Violation``): one table, one text.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import ClassVar

from fcir.errors import IRTypeError, PlacementError
from fcir.ir.types import SERVER, PlacedType, TensorType, Type

# What an op does, for the modules that treat ops by what they do:
#   broadcast  server -> members (one operand, one all-equal result)
#   map        a region run per member
#   reduction  members -> the placement above, in the clear (the plain aggregates)
#   dp         members -> the placement above through the Gaussian mechanism; the last
#              operand is a PRNG key local to where the result lives
#   ddp        members -> the placement above through distributed DP (noised at the
#              members, summed securely); the last operand holds one PRNG key per
#              member, placed like the values
#   index      members -> members: each member's position in its placement (no value
#              is read or sent)
KINDS = ("broadcast", "map", "reduction", "dp", "ddp", "index")


@dataclasses.dataclass(frozen=True)
class Unsupported:
    """A backend's explicit entry for an op it does not run: ``reason`` is the error it
    raises (what to do instead)."""

    reason: str


class Violation(Exception):
    """Raised by a type rule; the checker turns it into a located diagnostic."""

    def __init__(self, op_cls, code: str, detail: str = ""):
        self.code = f"{op_cls.name}/{code}"
        super().__init__(op_cls.message(code, detail))
        self.placement = code in op_cls.placement_constraints


class Context:
    """Where an op sits: ``level`` -1 is the server, i is inside a map over placement i."""

    def __init__(self, placements: list[tuple[str, int]], level: int):
        self.names = [p for p, _ in placements]
        self.cardinality = dict(placements)
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
    """Base of the fed ops. A subclass that defines ``name`` is registered."""

    name: ClassVar[str]
    primitive: ClassVar = None
    kind: ClassVar[str]
    multiple_results: ClassVar[bool] = False
    # attribute name -> Python type; the primitive's params of the same names
    # (besides ``placement`` and ``n``) are these attributes.
    attributes: ClassVar[dict[str, type]] = {}
    # attributes present in the IR only when set: the primitive's param is None when
    # unset (so a module that does not use one prints, serializes and hashes as before)
    optional_attributes: ClassVar[dict[str, type]] = {}
    constraints: ClassVar[dict[str, str]]
    # Module-level functions the op's ``server_aggregate`` calls, self-contained like it:
    # their source travels with its (``server_aggregate_source``).
    server_helpers: ClassVar[tuple] = ()
    placement_constraints: ClassVar[frozenset[str]] = frozenset()
    registry: ClassVar[dict[str, type[FedOp]]] = {}

    # --- what an op may add: None where it does not (a backend asks ``is not None``) ------

    reference: ClassVar[Callable | None] = None
    """``reference(x, attrs) -> np.ndarray``, a classmethod: the op in numpy over its
    members stacked on axis 0. The reference interpreter runs it instead of binding the
    primitive, so the oracle that an order statistic's or a selector's compiled rules
    are held to is written once, in the op's module, in the plainest terms."""

    server_aggregate: ClassVar[Callable | None] = None
    """``server_aggregate(x, **attrs)``, a staticmethod in jnp and numpy only that imports
    what it uses inside: how a server holding every member's value (stacked on axis 0)
    computes the op. A reduction with no intrinsic of its own has one: the Flower export
    copies its source (``server_aggregate_source``) into the app, which cannot import
    fcir, and the op's primitive may lower to it, so both run one definition."""

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        if "name" in cls.__dict__:  # abstract bases such as Reduction define no name
            if cls.kind not in KINDS:
                raise TypeError(f"{cls.__name__}.kind {cls.kind!r} is not one of {KINDS}")
            if cls.name in FedOp.registry:
                raise TypeError(f"fed op {cls.name} is defined twice")
            FedOp.registry[cls.name] = cls

    @classmethod
    def message(cls, code: str, detail: str = "") -> str:
        """``"<op>/<code>: <constraint text> (<detail>)"``: the words of every error
        citing the constraint, while tracing and in ``fcir check``."""
        text = cls.constraints[code]
        return f"{cls.name}/{code}: {text}" + (f" ({detail})" if detail else "")

    @classmethod
    def fail(cls, code: str, detail: str = ""):
        raise Violation(cls, code, detail)

    @classmethod
    def error(cls, code: str, detail: str = "") -> Exception:
        """The FcirError a violated constraint is while tracing: PlacementError for a
        placement constraint, IRTypeError otherwise."""
        kind = PlacementError if code in cls.placement_constraints else IRTypeError
        return kind(cls.message(code, detail))

    @classmethod
    def verify(cls, op, ctx: Context) -> None:
        raise NotImplementedError

    @classmethod
    def min_replies(cls, attrs: dict) -> int:
        """The fewest members an aggregate is defined over. A Flower server that got
        fewer replies than the round's cardinality computes the op over those that
        came (its ``server_aggregate``), down to this many; below it the round has no
        aggregate (Flower's ``Bulyan`` skips it)."""
        return 1

    @classmethod
    def placed_operands(cls, n_operands: int) -> range:
        """Indices of the operands that are placed at the members (a DP op's last
        operand, the key, is not)."""
        return range(n_operands - 1) if cls.kind == "dp" else range(n_operands)

    @classmethod
    def attrs_from_params(cls, params: dict) -> dict:
        """The op's attributes from its primitive's params (capture)."""
        out = {k: t(params[k]) for k, t in cls.attributes.items()}
        for k, t in cls.optional_attributes.items():
            if params.get(k) is not None:
                out[k] = t(params[k])
        return out

    @classmethod
    def bind(cls, op, args, cardinality, regions=()):
        """Runs ``op`` by binding its primitive (the JAX meaning every backend that
        traces to JAX shares). ``regions``: the op's regions as ClosedJaxprs, traced by
        the interpreter running it (``fed.map``'s body)."""
        p = op.operands[0].type.placement
        params = {k: op.attrs[k] for k in cls.attributes}
        params.update({k: op.attrs.get(k) for k in cls.optional_attributes})
        return cls.primitive.bind(*args, placement=p, n=cardinality(p), **params)

    @classmethod
    def server_aggregate_source(cls) -> str | None:
        """The source of the op's ``server_aggregate``, if it has one, after that of the
        ``server_helpers`` it calls, as the Flower export copies it into an app."""
        import inspect
        import textwrap

        if cls.server_aggregate is None:
            return None
        parts = []
        for f in (*cls.server_helpers, cls.server_aggregate):
            lines = textwrap.dedent(inspect.getsource(f)).splitlines()
            parts.append("\n".join(line for line in lines if not line.startswith("@")) + "\n")
        return "\n\n".join(parts)

    @classmethod
    def placed_operand(cls, ctx: Context, v, code_placement: str, allow_all_equal=True):
        t = v.type
        if not isinstance(t, PlacedType) or t.placement == SERVER:
            hint = ""
            if ctx.child is not None and isinstance(t, PlacedType):
                hint = (
                    f"; a value computed at '{ctx.here}' reaches the members of "
                    f"'{ctx.child}' only through fed.broadcast (every member gets the same "
                    "value): pass per-member values as client data, an argument whose "
                    f"leading axis is the number of '{ctx.child}' (under jax.vmap, batch "
                    "client data along an axis behind it: in_axes=1)"
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


def arity(cls, op, operands: int, results: int, regions: int = 0) -> None:
    if len(op.operands) != operands or len(op.results) != results or len(op.regions) != regions:
        cls.fail(
            "C1",
            f"has {len(op.operands)} operands, {len(op.results)} results, "
            f"{len(op.regions)} regions",
        )


class Reduction(FedOp):
    """A one-operand aggregate: ``{T}@child -> T`` local to the current placement."""

    kind = "reduction"
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
        arity(cls, op, 1, 1)
        t = cls.placed_operand(ctx, op.operands[0], "C2")
        cls.extra(op, t, ctx)
        if isinstance(t.member, TensorType):
            expected = ctx.local(cls.result_member(t.member))
        else:
            expected = PlacedType(t.member, SERVER, True) if ctx.level < 0 else t.member
        if op.results[0].type != expected:
            cls.fail("C3", f"result {op.results[0].type}, expected {expected}")

    @classmethod
    def extra(cls, op, t: PlacedType, ctx: Context) -> None:
        """The op's own checks of its operand type ``t`` and attributes, after the
        shared ones (``verify``): an op with constraints beyond C1-C3 raises them here,
        usually by asking ``problem``."""

    # --- what the order statistics and selectors declare (their backends ask for it) ----

    @classmethod
    def problem(cls, dtype: str, n: int | None, attrs: dict) -> tuple[str, str] | None:
        """The constraint that a member dtype (by name, ``"f32"``), the number of members
        ``n`` (None where it is not known yet) and the attributes break, as ``(code,
        detail)``, or None. The one rule of the op's own constraints: its primitive's
        abstract evaluation raises ``error(*found)`` while tracing, and ``extra`` /
        ``verify`` fail with it in ``fcir check``. A plain aggregate takes any member."""
        return None

    @classmethod
    def trim_for(cls, n: int, attrs: dict) -> int:
        """How many members an L-estimator drops at each end of the sorted ``n`` values
        of a coordinate before it averages the rest (the median: ``(n - 1) // 2``). The
        order statistics answer it; streaming's exact passes over the chunks read it
        (``interpreters/xla/streaming_order.py``). Any other reduction is no L-estimator."""
        raise NotImplementedError(f"{cls.name} is no L-estimator: it drops no members")

    @classmethod
    def result_shape(cls, shape: tuple, attrs: dict, n: int | None = None) -> tuple | None:
        """The result's member shape for an operand of member shape ``shape`` over ``n``
        members: ``shape`` for an aggregate; for a selector, the chosen members stacked
        (Krum: ``(m, *shape)``), or None where that needs ``n`` and it is not known."""
        return shape


# --- the registry, read by everything that treats fed ops ---------------------------------


def ops() -> dict[str, type[FedOp]]:
    """Every fed op, name -> class (importing ``fcir.fed`` defines them all)."""
    return dict(FedOp.registry)


def of_kind(*kinds: str) -> frozenset[str]:
    """Names of the fed ops of the given kinds."""
    for k in kinds:
        if k not in KINDS:
            raise ValueError(f"unknown fed op kind {k!r}; kinds are {KINDS}")
    return frozenset(n for n, c in FedOp.registry.items() if c.kind in kinds)


def op_class(op) -> type[FedOp] | None:
    """The class of IR op ``op`` (or of an op name) if it is a fed op, else None: what
    code outside ``fcir.fed`` compares (``op_class(op) is Broadcast``) instead of
    naming the op by string."""
    return FedOp.registry.get(op if isinstance(op, str) else op.name)


def by_primitive() -> dict[str, type[FedOp]]:
    """JAX primitive name (``fed_sum``) -> op class."""
    return {c.primitive.name: c for c in FedOp.registry.values()}


# The user-facing functions the op modules define (``fcir.reduce_median`` ...): name ->
# function. ``fcir`` exports every one.
FUNCTIONS: dict = {}


def public(fn):
    """Marks ``fn``, defined in a fed op's module, as a function of ``fcir``'s API
    (``fcir.<name>``): the op module is then the only file that names it."""
    if fn.__name__ in FUNCTIONS:
        raise TypeError(f"fcir.{fn.__name__} is defined twice")
    FUNCTIONS[fn.__name__] = fn
    return fn


def resolve(table: dict) -> dict[type[FedOp], object]:
    """A backend's own table, op class -> rule, with its kind defaults applied.

    ``table`` maps op classes to rules (or ``Unsupported``) and may map a kind name
    (``"reduction"``) to the rule of every op of that kind it does not list: a default
    the backend declares itself, in its own table. An op with neither is absent (the
    op-coverage test fails on it)."""
    for key in table:
        if isinstance(key, str) and key not in KINDS:
            raise ValueError(f"rule table key {key!r} is neither an op class nor a kind {KINDS}")
    out = {}
    for cls in FedOp.registry.values():
        if cls in table:
            out[cls] = table[cls]
        elif cls.kind in table:
            out[cls] = table[cls.kind]
    return out
