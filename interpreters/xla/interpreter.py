"""``XlaInterpreter``: the Interpreter that rebuilds a Module as one JAX computation.

Run under ``jax.jit`` tracing, the base class already reproduces the captured program:
every op binds its JAX primitive, so the traced jaxpr is the original one. What this
subclass adds is the layout a mesh asks for. Placed values are sharded along their
placement's mesh axis exactly where the frontend (``fcir.opkit.placement``) puts its constraints,
so a program compiled from its IR and the same program run with ``jax.jit`` on the
same mesh lower to the same HLO:

- ``fed.broadcast``: the broadcast value is constrained (``fcir.opkit.sharding.constrain_broadcast``);
- ``fed.map``: every operand and every result is constrained
  (``fcir.opkit.sharding.constrain_placed``), and the member region is traced with each
  member's typed layout (``fcir.opkit.sharding.member_sharding``), as ``map_fn`` traces it;
- reductions are left as they are: the result's layout is XLA's to choose;
- under Explicit axes, a param that is a NamedSharding over the empty mesh (what a
  capture without a mesh records where JAX copied an aval's sharding into a param) is
  put on the mesh in context, the param tracing on that mesh records: the base class
  does that (``fcir.opkit.sharding.on_context_mesh``), for any interpreter run under ``jax.jit``
  on such a mesh.

The rules themselves (``Auto`` axes get ``with_sharding_constraint``, ``Explicit``
axes get ``reshard``, a mesh without the placement's axis gets no constraint and a
warning) live in ``fcir.opkit.sharding``, shared with the frontend, so there is one place
that decides a layout.
"""

from __future__ import annotations

import jax
from jax.sharding import AxisType, PartitionSpec

from fcir import fed as F
from fcir import jaxcompat as jc
from fcir.base_interpreter import Interpreter, impl
from fcir.ir import Op, Region
from fcir.ir.types import runtime_type
from fcir.opkit import sharding

__all__ = ["XlaInterpreter"]


class XlaInterpreter(Interpreter):
    """Rebuilds a Module under tracing, sharding placed values over ``mesh``.

    ``mesh`` is a ``jax.sharding.Mesh`` or ``AbstractMesh`` (or None: no constraints,
    the single-device program). Use it inside ``jax.jit``; ``fcir.interpreters.xla.compile``
    does that for you::

        jax.jit(lambda *leaves: XlaInterpreter(mesh).run(module, *leaves))
    """

    def __init__(self, mesh=None, *, verbose: bool = False):
        super().__init__(verbose=verbose)
        self.mesh = None if mesh is None else sharding.resolve_mesh(mesh)
        # Explicit axes put layouts in the types, so regions must be traced with their
        # operands' typed layouts; (op, operand avals) of the op being run, if so.
        self._typed = self.mesh is not None and AxisType.Explicit in tuple(self.mesh.axis_types)
        self._operands: tuple[Op, list] | None = None
        self._equal_regions: dict[tuple, jc.ClosedJaxpr] = {}

    def constrain(self, x, placement: str):
        """``x`` (placed at ``placement``) laid out along the mesh axis of that name."""
        if self.mesh is None:
            return x
        return sharding.constrain_placed(x, placement, self.mesh)

    @impl(F.Broadcast)
    def broadcast(self, op: Op, x):
        y = super().broadcast(op, x)
        if self.mesh is None:
            return y
        return sharding.constrain_broadcast(y, op.attrs["to"], self.mesh)

    @impl(F.Map)
    def map(self, op: Op, *args):
        placement = op.operands[0].type.placement
        args = [self.constrain(jax.numpy.asarray(a), placement) for a in args]
        body = self.member_jaxpr(op.regions[0], args)
        outs = F.Map.bind(op, args, self.module.cardinality, [body])
        return [self.constrain(o, placement) for o in outs]

    @impl(F.MemberIndex)
    def member_index(self, op: Op, x):
        """Each member's position: the primitive's iota, laid out as the placement's
        members (on a mesh, split over its axis like the values it indexes)."""
        placement = op.operands[0].type.placement
        return self.constrain(self.fed_op(op, x), placement)

    @impl(*(c for c in F.ops().values() if c.kind in ("reduction", "dp", "ddp")))
    def aggregate(self, op: Op, *args):
        """A reduction or DP aggregate: its primitive, lowered by the rule its module in
        ``fcir.fed`` registers."""
        return self.fed_op(op, *args)

    def member_jaxpr(self, region: Region, placed_args) -> jc.ClosedJaxpr:
        """The region traced for one member of ``placed_args``: unbatched shapes with each
        operand's weak type and typed member layout (what ``fcir.map_fn`` traces)."""
        specs = []
        for x in placed_args:
            aval = jax.typeof(x)
            specs.append(
                jax.ShapeDtypeStruct(
                    aval.shape[1:],
                    aval.dtype,
                    weak_type=aval.weak_type,
                    sharding=sharding.member_sharding(x),
                )
            )
        return super().region_jaxpr(region, specs)

    def bind(self, prim, args, params):
        # A scan stacking one value twice is bound as the running JAX binds it
        # (fcir.jaxcompat.scan_outputs: merged on JAX 0.12), for jax.jit's flops.
        if prim is jc.scan_outputs.scan_p:
            return jc.scan_outputs.bind_scan(args, params)
        return super().bind(prim, args, params)

    # -- regions of local ops under Explicit axes ---------------------------------------

    def local(self, op: Op, *args):
        if not (self._typed and op.regions):
            return super().local(op, *args)
        saved, self._operands = self._operands, (op, [jax.typeof(a) for a in args])
        try:
            return super().local(op, *args)
        finally:
            self._operands = saved

    def region_jaxpr(self, region: Region, specs: list | None = None) -> jc.ClosedJaxpr:
        if specs is not None:
            return super().region_jaxpr(region, specs)
        shapes = [runtime_type(v.type, self.module.cardinality).shape for v in region.params]
        specs = self._operands and _typed_region_specs(*self._operands, region, shapes)
        # Equal regions get one jaxpr, as JAX traces a function called twice once: the
        # lowering then emits one private function (``@_where``, not ``@_where_0``,
        # ``@_where_1``), like the original program's.
        key = (_fingerprint(region), _spec_key(specs) if specs else None)
        cached = self._equal_regions.get(key)
        if cached is not None:
            return cached
        closed = super().region_jaxpr(region, specs or None)
        self._equal_regions[key] = closed
        return closed


def _typed_region_specs(op: Op, avals: list, region: Region, shapes) -> list | None:
    """Specs for tracing ``region`` of local op ``op`` from its operands' avals (shape,
    dtype, weak type and typed sharding), or None where the mapping is not known."""
    name = op.name.removeprefix("jax.")
    index = op.regions.index(region) if region in op.regions else -1
    if name == "scan":
        consts_carry = int(op.attrs["num_consts"]) + int(op.attrs["num_carry"])
        params = avals[:consts_carry] + [_unstacked(a) for a in avals[consts_carry:]]
    elif name == "while":
        cond_n, body_n = int(op.attrs["cond_nconsts"]), int(op.attrs["body_nconsts"])
        carry = avals[cond_n + body_n :]
        if index == op.attrs["cond_jaxpr"].index:
            params = avals[:cond_n] + carry
        else:
            params = avals[cond_n : cond_n + body_n] + carry
    elif name == "cond":
        params = avals[1:]
    else:
        params = avals
    if len(params) != len(shapes) or any(tuple(a.shape) != s for a, s in zip(params, shapes)):
        return None
    return [
        jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type, sharding=a.sharding)
        for a in params
    ]


def _spec_key(specs) -> tuple:
    return tuple((s.shape, str(s.dtype), s.weak_type, s.sharding) for s in specs)


def _fingerprint(region: Region):
    """A hashable value equal for regions with the same ops, types and attributes (values
    numbered by position), or the region itself when an attribute is not hashable."""
    numbers: dict = {}

    def number(v):
        # A value from outside the region (none in captured IR) keeps its identity.
        return numbers.get(v, ("outer", id(v)))

    def walk(r: Region) -> tuple:
        params = []
        for v in r.params:
            numbers[v] = len(numbers)
            params.append(str(v.type))
        ops = []
        for op in r.ops:
            operands = tuple(number(v) for v in op.operands)
            for v in op.results:
                numbers[v] = len(numbers)
            ops.append(
                (
                    op.name,
                    operands,
                    tuple(str(v.type) for v in op.results),
                    tuple(sorted(op.attrs.items())),
                    tuple(walk(sub) for sub in op.regions),
                )
            )
        return tuple(params), tuple(ops), tuple(number(v) for v in r.results)

    fingerprint = walk(region)
    try:
        hash(fingerprint)
    except TypeError:
        return region
    return fingerprint


def _unstacked(aval):
    """The aval of one slice along the leading axis (a scanned-over operand)."""
    spec = PartitionSpec(*tuple(aval.sharding.spec)[1:])
    return aval.update(shape=aval.shape[1:], sharding=aval.sharding.update(spec=spec))
