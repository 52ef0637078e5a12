"""Streaming client maps: members processed ``k`` at a time, reductions as running sums.

The unchunked XLA program (``XlaInterpreter``) runs ``fed.map`` as one batched
computation over every member, as DrJAX does, so every member's results exist at once:
a FedAvg round holds one model copy per client before the mean. With
``xla.compile(module, mesh, clients_per_step=k)`` the program is planned per region
(:func:`plan_region`) into *streams*, and :class:`StreamingInterpreter` runs each
stream as a loop over chunks of ``k`` members:

- a stream is one ``fed.map``, the per-member elementwise ops applied to its results
  afterwards (``y * 2``, ``jnp.abs(y)``: ``ELEMENTWISE``; the layout ops capture adds
  under ``jax.set_mesh`` pass a member's value through: ``LAYOUT``), and the reductions of those
  values (``fed.sum``, ``mean``, ``weighted_mean``, ``min``, ``max``, ``secure_sum``,
  ``dp_sum``/``dp_mean``: clipped member by member, the noise added once at the end;
  ``ddp_*``: ``streaming_ddp.py``; ``median``, ``trimmed_mean``: exact, by passes over
  the chunks after the stream's loop, ``streaming_order.py``; ``krum``, ``multi_krum``,
  ``bulyan``, ``geometric_median``: by passes too, ``streaming_robust.py``): ``RULES``
  maps each fed op class to what the stream does with it, an accumulator object for a
  reduction (``accumulators.py``), a :class:`streaming_order.ByPasses` for one computed
  by passes (which read the members through :class:`Chunks`);
- each step slices ``k`` members out of the per-member operands, runs the map region
  ``jax.vmap``-ed over them (broadcast values go in unbatched, as the server's one copy)
  and folds the results into running accumulators: sums (in the accumulation dtype of
  the reduction's result dtype, f32 for f16/bf16 as in the reference and ``jnp.sum``,
  rounded to the result dtype once at the end; a weighted mean keeps the weighted sum
  and the weight sum; a secure sum wraps in its integer dtype, which is exact modulo
  ``2**bitwidth``), minima and maxima; means divide by the cohort size once, at the end;
- values needed per member afterwards (returned, or used by a later op) are written
  chunk by chunk into a preallocated array of the full shape, in member order; per-member
  values a later map reads (a captured gradient's backward map reads the forward map's
  results) are instead recomputed in that map's stream, which runs the earlier stream's
  member ops again first (``Stream.prelude``).

Reverse mode: each stream is a ``jax.custom_vjp`` whose backward pass is a second loop
over the chunks: every chunk's values are recomputed under ``jax.vjp`` and pulled back
with the chunk's share of the results' cotangents, the server values' cotangents summed
in the loop and the members' written chunk by chunk. ``jax.grad`` of the forward loop
would keep a residual per member instead.

``k`` need not divide the cohort: the last chunk starts at ``n - k`` (it overlaps the
previous one) and a mask drops the members already counted, so sums, means, minima and
maxima see each member exactly once and no padding value is ever read. On a mesh whose
axis is named like the placement (and divides it), the stream runs under
``jax.shard_map``: each device loops over its own ``n / devices`` members, ``k`` at a
time, and the partial accumulators are combined with ``psum``/``pmin``/``pmax``.

Ops are reordered only as data dependencies allow (the IR is pure): a stream runs
once all its inputs exist, before the first op that reads one of its outputs.
"""

from __future__ import annotations

import dataclasses
import heapq

import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_derivatives import SymbolicZero
from jax.sharding import PartitionSpec

from fcir import fed as F
from fcir.errors import InterpreterError
from fcir.fed.map import mixed_layout_error
from fcir.ir import Op, Region, Value
from fcir.ir import elementwise as E
from fcir.ir.types import PlacedType, runtime_type
from fcir.opkit import primitives as P

from . import accumulators as A
from . import streaming_order as _order
from . import streaming_robust as _robust
from .interpreter import XlaInterpreter
from .streaming_ddp import Distributed

__all__ = ["ELEMENTWISE", "Stream", "StreamingInterpreter", "members_per_step", "plan_region"]

# Ops applied member by member to values placed at the map's placement: their params
# name no axis, so running them on one member's value means the same as on all.
ELEMENTWISE = frozenset("jax." + n for n in E.ELEMENTWISE)
# Ops that only say where a placed value lives (capture adds them under ``jax.set_mesh``:
# a constraint on every map operand and result). A stream reads through them: a member
# has no member axis to lay out, so per member they are the identity, and the stream's
# own loop lays out the members (shard_map over the placement's axis). A value one of
# them defines that is needed whole afterwards gets the op applied to the whole buffer.
LAYOUT = frozenset("jax." + n for n in E.LAYOUT)

_NO_ACCUMULATOR = (
    "streaming has no accumulator for this reduction (interpreters/xla/streaming.py "
    "RULES): compile without clients_per_step to run it"
)


class StreamSource:
    """``fed.broadcast`` to the stream's placement: its operand enters the stream once,
    unbatched, as the server's one copy every member reads."""

    def __call__(self, op: Op, placement: str) -> Value | None:
        """The value a member reads in place of ``op``'s result (None: not a source of a
        stream over ``placement``)."""
        return op.operands[0] if op.attrs.get("to") == placement else None


class MemberPosition:
    """``fed.member_index``: read per member like an elementwise op after the map (its
    operand names the placement), each member's value its cohort index, which the chunk
    knows (``start + j``, plus the device's offset under shard_map)."""

    def __call__(self, index) -> list:
        """A member's value, given its cohort index."""
        return [index]


class StreamHead:
    """``fed.map``: a stream, its region run ``k`` members at a time with the per-member
    ops after it and the reductions of their values (:func:`plan_region`)."""

    def __call__(self, region, index, op, producer, users, results, cardinality) -> Stream:
        return _plan_map(region, index, op, producer, users, results, cardinality)


# What a stream does with each fed op, keyed by op class: the entry is the behaviour
# (tests/fed/test_op_coverage.py reads this table). A reduction it does not name is refused
# (the kind's default, declared here).
_OWN_RULES: dict[type[F.FedOp] | str, object] = {
    F.Broadcast: StreamSource(),
    F.Map: StreamHead(),
    F.MemberIndex: MemberPosition(),
    # The sum-like family: running sums in the accumulation dtype, finished once.
    F.Sum: A.Linear(P.sum_result_dtype),
    F.Mean: A.Linear(P.mean_result_dtype, A.divided_by_cohort),
    F.WeightedMean: A.Weighted(P.mean_result_dtype, A.divided_by_weight),
    F.SecureSum: A.Linear(total=A.wrapped_to_bitwidth),
    F.Min: A.Extremum(smallest=True),
    F.Max: A.Extremum(smallest=False),
    # Clipped member by member and summed; the noise is added once, at the end.
    F.DpSum: A.Gaussian(mean=False),
    F.DpMean: A.Gaussian(mean=True),
    # interpreters/xla/streaming_ddp.py: only the uint32 modular sum is carried.
    F.DdpSum: Distributed(mean=False),
    F.DdpMean: Distributed(mean=True),
    # Exact, by passes over the chunks after the stream's loop (streaming_order.py).
    F.Median: _order.ByPasses(),
    F.TrimmedMean: _order.ByPasses(),
    F.BandEdges: _order.BandEdgesPasses(),
    # The robust aggregates, by passes too: the members' distances chunk by chunk, the
    # chosen members gathered (streaming_robust.py), or Weiszfeld's steps.
    F.Krum: _robust.ChosenMembers(),
    F.MultiKrum: _robust.ChosenMembers(),
    F.BulyanSelect: _robust.ChosenMembers(),
    F.Bulyan: _robust.ChosenMembers(),
    F.GeometricMedian: _robust.WeiszfeldPasses(),
    "reduction": F.Unsupported(_NO_ACCUMULATOR),
}
RULES = F.resolve(_OWN_RULES)


def _rule(op: Op):
    """``op``'s entry in :data:`RULES` (None for an op that is no fed op)."""
    return RULES.get(F.ops().get(op.name))


def _accumulator(op: Op) -> A.Accumulator | None:
    rule = _rule(op)
    return rule if isinstance(rule, A.Accumulator) else None


def _by_passes(op: Op) -> _order.ByPasses | None:
    rule = _rule(op)
    return rule if isinstance(rule, _order.ByPasses) else None


def _stream_head(op: Op) -> bool:
    return isinstance(_rule(op), StreamHead)


@dataclasses.dataclass(eq=False)
class Stream:
    """One ``fed.map`` and what runs with it, member by member, ``k`` at a time."""

    map_op: Op
    placement: str
    n: int
    absorbed: list[Op]  # per-member elementwise ops run right after the map region
    reductions: list[Op]  # reductions of the stream's values: running accumulators
    batched: list[Value]  # per-member inputs, sliced k members at a time
    unbatched: list[Value]  # inputs every member sees whole (broadcast sources, scalars)
    materialized: list[Value]  # stream values needed with their member axis afterwards
    source: dict[Value, Value]  # a broadcast result -> the value it broadcasts
    # Member ops of earlier streams run again, chunk by chunk, before the map: the per-
    # member values this stream reads from them are recomputed instead of kept whole.
    prelude: list[Op] = dataclasses.field(default_factory=list)
    ordered: list[Op] = dataclasses.field(default_factory=list)  # order statistics (ByPasses)

    @property
    def inputs(self) -> list[Value]:
        return self.batched + self.unbatched

    @property
    def member_ops(self) -> list[Op]:
        """The ops run per member, in order: the prelude, the map, the absorbed ops."""
        return [*self.prelude, self.map_op, *self.absorbed]

    @property
    def group(self) -> set[Value]:
        """The per-member values this stream's own ops define."""
        return {v for op in (self.map_op, *self.absorbed) for v in op.results}

    @property
    def outputs(self) -> list[Value]:
        reduced = [r for op in (*self.reductions, *self.ordered) for r in op.results]
        return reduced + self.materialized


def plan_region(region: Region, cardinality) -> list[Stream]:
    """The streams of ``region``: one per ``fed.map`` at its top level."""
    producer: dict[Value, Op] = {}
    users: dict[Value, list[Op]] = {}
    for op in region.ops:
        for v in op.results:
            producer[v] = op
        for v in op.operands:
            users.setdefault(v, []).append(op)
    results = set(region.results)
    streams = []
    for i, op in enumerate(region.ops):
        rule = _rule(op)
        if isinstance(rule, StreamHead):
            streams.append(rule(region, i, op, producer, users, results, cardinality))
    _recompute_member_values(region, streams, users, results)
    return streams


def _recompute_member_values(region: Region, streams: list[Stream], users, results) -> None:
    """A stream that reads per-member values of an earlier stream (a map's results read
    by a later map: the residuals a captured gradient's backward map reads from the
    forward map) recomputes them chunk by chunk, running the earlier stream's member ops
    again before its own map, so they are never kept for every member. The earlier
    stream then materializes only what something else still needs."""
    position = {id(op): i for i, op in enumerate(region.ops)}
    owner: dict[Value, Stream] = {}
    recomputed_in: dict[Value, list[Stream]] = {}
    for s in streams:
        borrowed = [v for v in s.batched if v in owner]
        if borrowed:
            lenders = list(dict.fromkeys(owner[v] for v in borrowed))
            prelude = {id(op): op for e in lenders for op in e.member_ops}
            prelude.update({id(op): op for op in s.prelude})
            s.prelude = sorted(prelude.values(), key=lambda op: position[id(op)])
            defined = {v for op in s.prelude for v in op.results}
            for e in lenders:
                s.source.update(e.source)
                for v in e.batched:
                    if v not in s.batched:
                        s.batched.append(v)
                for v in e.unbatched:
                    if v not in s.unbatched:
                        s.unbatched.append(v)
            for v in defined:
                recomputed_in.setdefault(v, []).append(s)
            s.batched = [v for v in s.batched if v not in defined]
        for v in s.group:
            owner[v] = s

    def inside(s: Stream) -> set[int]:
        return {id(op) for op in (*s.member_ops, *s.reductions)}

    for e in streams:
        mine = inside(e)
        e.materialized = [
            v
            for v in e.materialized
            if v in results
            or any(
                id(u) not in mine and not any(id(u) in inside(s) for s in recomputed_in.get(v, ()))
                for u in users.get(v, ())
            )
        ]


def _broadcast_source(v: Value, placement: str, producer) -> Value | None:
    op = producer.get(v)
    # A broadcast value laid out (``reshard`` of ``fcir.broadcast(w)``) is still the
    # server's one copy to every member.
    while op is not None and op.name in LAYOUT and _placed_at(v, placement):
        v = op.operands[0]
        op = producer.get(v)
    rule = None if op is None else _rule(op)
    return rule(op, placement) if isinstance(rule, StreamSource) else None


def _placed_at(v: Value, placement: str) -> bool:
    return isinstance(v.type, PlacedType) and v.type.placement == placement


def _plan_map(region, index, map_op, producer, users, results, cardinality) -> Stream:
    placement = map_op.operands[0].type.placement
    group, absorbed, reductions, ordered = _stream_ops(region, index, map_op, producer, cardinality)
    stream_ops = [map_op, *absorbed]
    batched, unbatched, source = _stream_inputs(stream_ops, reductions, group, placement, producer)
    inside = set(absorbed) | set(reductions) | set(ordered) | {map_op}
    materialized = [
        v
        for op in stream_ops
        for v in op.results
        if v in results or any(u not in inside for u in users.get(v, ()))
    ]
    return Stream(
        map_op=map_op,
        placement=placement,
        n=cardinality(placement),
        absorbed=absorbed,
        reductions=reductions,
        batched=batched,
        unbatched=unbatched,
        materialized=materialized,
        source=source,
        ordered=ordered,
    )


def _stream_ops(region, index, map_op, producer, cardinality):
    """What runs with the ``fed.map`` at ``region.ops[index]``: (the values the stream
    defines member by member, the per-member ops absorbed after the map, the reductions
    of its values it accumulates, the order statistics it feeds by passes)."""
    placement = map_op.operands[0].type.placement
    # The values computed from the results of the maps after this one.
    later_maps: set[Value] = set()
    for op in region.ops[index + 1 :]:
        if _stream_head(op) or any(v in later_maps for v in op.operands):
            later_maps.update(op.results)
    group: set[Value] = set(map_op.results)
    # Values computed from the stream's outputs: an op reading one cannot feed the
    # stream (that would be a cycle), so it is never absorbed.
    tainted: set[Value] = set(map_op.results)
    absorbed: list[Op] = []
    reductions: list[Op] = []
    ordered: list[Op] = []

    def member_operand(v: Value) -> bool:
        """Can ``v`` be read per member by an absorbed op, without depending on the map?"""
        if v in group:
            return True
        if v in tainted:
            return False
        if _broadcast_source(v, placement, producer) is not None:
            return True
        if _placed_at(v, placement):
            # Read a chunk at a time, like the map's operands, unless computed from a
            # later map (``map(f, x) + map(g, x)``): this stream would wait for that
            # map's, which absorbs the same op and, recomputing this stream's member
            # ops, would then read its own output.
            return v not in later_maps
        # A server scalar (a literal like the 2.0 of ``y * 2.0``) applies to each member.
        unplaced = not isinstance(v.type, PlacedType) or v.type.placement == "server"
        return unplaced and len(runtime_type(v.type, cardinality).shape) == 0

    for op in region.ops[index + 1 :]:
        touches = any(v in tainted for v in op.operands)
        if not touches:
            continue
        if (
            (op.name in ELEMENTWISE or op.name in LAYOUT or isinstance(_rule(op), MemberPosition))
            and not op.regions
            and all(_placed_at(r, placement) for r in op.results)
            and any(v in group for v in op.operands)
            and all(member_operand(v) for v in op.operands)
        ):
            absorbed.append(op)
            group.update(op.results)
            tainted.update(op.results)
            continue
        acc = _accumulator(op) or _by_passes(op)
        if (
            acc is not None
            and op.operands[0] in group
            and all(
                v in group or (_placed_at(v, placement) and v not in tainted)
                for v in acc.member_operands(op)[1:]
            )
            and all(v not in tainted for v in acc.server_operands(op))
        ):
            (ordered if isinstance(acc, _order.ByPasses) else reductions).append(op)
        tainted.update(op.results)
    return group, absorbed, reductions, ordered


def _stream_inputs(stream_ops, reductions, defined, placement, producer):
    """(the per-member inputs, sliced a chunk at a time; the inputs every member sees
    whole; a broadcast result -> the value it broadcasts) of a stream whose ops define
    the values ``defined``."""
    batched: list[Value] = []
    unbatched: list[Value] = []
    source: dict[Value, Value] = {}

    def add_input(v: Value) -> None:
        if v in defined:
            return
        src = _broadcast_source(v, placement, producer)
        if src is not None:
            source[v] = src
            if src not in unbatched:
                unbatched.append(src)
        elif _placed_at(v, placement):
            if v not in batched:
                batched.append(v)
        elif v not in unbatched:
            unbatched.append(v)

    for op in stream_ops:
        for v in op.operands:
            add_input(v)
    for op in reductions:
        acc = _accumulator(op)
        for v in acc.member_operands(op)[1:]:  # a weight that is no stream value: per chunk
            if v not in defined and v not in batched:
                batched.append(v)
        for v in acc.server_operands(op):  # a DP key: read when the noise is added
            if v not in unbatched:
                unbatched.append(v)
    return batched, unbatched, source


def members_per_step(clients_per_step) -> int:
    """``clients_per_step`` checked: the one place a streaming budget ``k`` is validated
    (``xla.compile``, ``StreamingInterpreter``); InterpreterError unless an int >= 1."""
    k = clients_per_step
    if isinstance(k, bool) or not isinstance(k, int):
        raise InterpreterError(
            f"clients_per_step must be a positive int or 'auto', got {clients_per_step!r}"
        )
    if k < 1:
        raise InterpreterError(
            f"clients_per_step must be >= 1 (members per step and device), got {k}"
        )
    return k


class StreamingInterpreter(XlaInterpreter):
    """An :class:`XlaInterpreter` that runs every ``fed.map`` as a stream of chunks of
    ``clients_per_step`` members per device (see the module docstring)."""

    unsupported = {c: rule for c, rule in RULES.items() if isinstance(rule, F.Unsupported)}

    def __init__(self, mesh=None, *, clients_per_step: int, verbose: bool = False):
        super().__init__(mesh, verbose=verbose)
        self.k = members_per_step(clients_per_step)
        self._plans: dict[int, tuple[Region, list[Stream]]] = {}
        self._member_interp: StreamingInterpreter | None = None

    # -- planning ------------------------------------------------------------------------

    def _plan(self, region: Region) -> list[Stream]:
        cached = self._plans.get(id(region))
        if cached is not None and cached[0] is region:
            return cached[1]
        streams = plan_region(region, self.module.cardinality)
        self._plans[id(region)] = (region, streams)
        return streams

    def run_region(self, region: Region, args) -> list:
        streams = self._plan(region)
        if not streams:
            return super().run_region(region, args)
        return self._run_scheduled(region, streams, args)

    def _run_scheduled(self, region: Region, streams: list[Stream], args) -> list:
        """Runs ops and streams in program order as far as data dependencies allow."""
        env: dict = dict(zip(region.params, args))
        position = {id(op): i for i, op in enumerate(region.ops)}
        in_stream = {}
        for s in streams:
            for op in (s.map_op, *s.absorbed, *s.reductions, *s.ordered):
                in_stream[id(op)] = s
        items: list = [op for op in region.ops if id(op) not in in_stream] + streams
        key = {id(it): position[id(it.map_op if isinstance(it, Stream) else it)] for it in items}
        produced_by: dict[Value, object] = {}
        for it in items:
            outs = it.outputs if isinstance(it, Stream) else it.results
            for v in outs:
                produced_by[v] = it
        waiting: dict[int, int] = {}
        dependents: dict[int, list] = {}
        ready: list = []
        for it in items:
            needs = it.inputs if isinstance(it, Stream) else it.operands
            deps = {id(produced_by[v]) for v in needs if v in produced_by}
            waiting[id(it)] = len(deps)
            for d in deps:
                dependents.setdefault(d, []).append(it)
            if not deps:
                heapq.heappush(ready, (key[id(it)], id(it), it))
        done = 0
        while ready:
            _, _, it = heapq.heappop(ready)
            if isinstance(it, Stream):
                env.update(zip(it.outputs, self._run_stream(it, env)))
            else:
                try:
                    vals = [env[v] for v in it.operands]
                except KeyError:
                    raise InterpreterError(f"{it.name}: operand used before definition") from None
                env.update(zip(it.results, self.run_op(it, vals)))
            done += 1
            for d in dependents.get(id(it), ()):
                waiting[id(d)] -= 1
                if waiting[id(d)] == 0:
                    heapq.heappush(ready, (key[id(d)], id(d), d))
        if done != len(items):  # the plan never absorbs an op that depends on its stream
            raise InterpreterError(f"streaming plan of a region left {len(items) - done} ops unrun")
        return [env[v] for v in region.results]

    # -- running a stream ----------------------------------------------------------------

    def _members(self) -> StreamingInterpreter:
        """The interpreter for member regions: no mesh (inside shard_map and vmap the
        member axis is the chunk's), same budget for nested placements, same class (a
        subclass's own op rules reach the member regions)."""
        if self._member_interp is None:
            self._member_interp = type(self)(None, clients_per_step=self.k)
            self._member_interp.module = self.module
        return self._member_interp

    def _run_stream(self, s: Stream, env: dict) -> list:
        if not s.outputs:
            return []  # every value it defines is recomputed by the streams reading it
        batched = [jnp.asarray(env[v]) for v in s.batched]
        unbatched = [env[v] for v in s.unbatched]
        mesh = self._stream_mesh(s)
        axis = self._mesh_axis(s, mesh)
        if axis is None:
            _check_member_layouts(s, env)
            batched = [_unshard_members(x) for x in batched]
        outs = self._differentiable(s, mesh, axis)(batched, unbatched)
        # A materialized value a layout op defines: that op on the whole buffer, so it
        # lives where the program put it (per member the stream passed it through).
        laid_out = {r: op for op in s.absorbed if op.name in LAYOUT for r in op.results}
        first = len(outs) - len(s.materialized)
        for i, v in enumerate(s.materialized, first):
            if v in laid_out:
                outs[i] = self.run_op(laid_out[v], [outs[i]])[0]
        return outs

    def _differentiable(self, s: Stream, mesh, axis):
        """The stream as a function of its inputs whose reverse-mode derivative is a
        second loop over the chunks (:meth:`_backward`): each chunk's forward runs again
        under ``jax.vjp`` with its share of the results' cotangent, so no per-member
        residual is kept (``jax.grad`` of a scan would stack one per step)."""

        @jax.custom_vjp
        def stream(batched, unbatched):
            return self._forward(s, mesh, axis, batched, unbatched)[0]

        def fwd(batched, unbatched):
            # symbolic_zeros: inputs say whether they are differentiated, so the
            # backward loop computes no cotangent nobody reads (the client data's).
            perturbed = _Static(tuple(x.perturbed for x in (*batched, *unbatched)))
            batched = [x.value for x in batched]
            unbatched = [x.value for x in unbatched]
            outs, accs = self._forward(s, mesh, axis, batched, unbatched)
            return outs, (batched, unbatched, accs, perturbed)

        def bwd(res, cts):
            return self._backward(s, mesh, axis, *res, list(cts))

        stream.defvjp(fwd, bwd, symbolic_zeros=True)
        return stream

    def _forward(self, s: Stream, mesh, axis, batched, unbatched):
        """(the stream's outputs, its combined accumulators)."""
        if axis is None:
            accs, bufs = self._stream_local(s, batched, unbatched, s.n)
            if self.mesh is not None:
                bufs = [self.constrain(b, s.placement) for b in bufs]
            bufs = self._ordered(s, batched, unbatched, s.n) + list(bufs)
        else:
            devices = mesh.shape[axis]

            def local(batched, unbatched):
                n = s.n // devices
                accs, bufs = self._stream_local(
                    s, batched, unbatched, n, offset=lax.axis_index(axis) * n
                )
                return [[a[None] for a in acc] for acc in accs], bufs

            # Each device returns its partial accumulators along the mesh axis; they are
            # combined outside (XLA's all-reduce), so no collective sits inside the
            # shard_map and its transpose stays plain. The interpreter binds primitives
            # directly (no automatic pvary), hence check_vma=False.
            member = PartitionSpec(axis)
            partial, bufs = jax.shard_map(
                local,
                mesh=mesh,
                in_specs=([member] * len(batched), [PartitionSpec()] * len(unbatched)),
                out_specs=(
                    [[member] * _accumulator(op).parts(op) for op in s.reductions],
                    [member] * len(s.materialized),
                ),
                axis_names={axis},
                check_vma=False,
            )(batched, unbatched)
            accs = [_accumulator(op).combine(op, acc) for op, acc in zip(s.reductions, partial)]
            bufs = list(bufs)
        server = dict(zip(s.unbatched, unbatched))
        outs = []
        for op, a in zip(s.reductions, accs):
            outs += _accumulator(op).finish(op, a, s.n, server)
        return outs + list(bufs), accs

    def _backward(self, s: Stream, mesh, axis, batched, unbatched, accs, perturbed, cts):
        """Cotangents of (batched, unbatched) from those of the stream's outputs
        (``cts``: arrays or ``SymbolicZero``s; ``perturbed``: which inputs need one)."""
        seeds, pos = [], 0
        for op, acc in zip(s.reductions, accs):
            seeds.append(_seed(op, acc, cts[pos : pos + len(op.results)], s.n))
            pos += len(op.results)
        if not all(_zero(c) for c in cts[pos : pos + len(s.ordered)]):
            raise InterpreterError(
                f"{s.ordered[0].name}: a streamed order statistic has no derivative here: "
                "compile without clients_per_step to differentiate it"
            )
        buf_cts = cts[pos + len(s.ordered) :]
        mats = [j for j, c in enumerate(buf_cts) if not _zero(c) and _inexact(c.dtype)]
        buf_cts = [buf_cts[j] for j in mats]
        wanted = perturbed.value
        diff_b = [j for j, x in enumerate(batched) if wanted[j] and _inexact(x.dtype)]
        diff_u = [
            j
            for j, x in enumerate(unbatched)
            if wanted[len(batched) + j] and _inexact(jnp.result_type(x))
        ]
        out_b: list = [None] * len(batched)
        out_u: list = [None] * len(unbatched)
        if not (diff_b or diff_u) or not (mats or any(sd is not None for sd in seeds)):
            return out_b, out_u
        if axis is None:
            ct_b, ct_u = self._backward_local(
                s, batched, unbatched, seeds, buf_cts, mats, diff_b, diff_u, s.n
            )
        else:
            devices = mesh.shape[axis]

            def local(batched, unbatched, seeds, buf_cts):
                n = s.n // devices
                ct_b, ct_u = self._backward_local(
                    s,
                    batched,
                    unbatched,
                    seeds,
                    buf_cts,
                    mats,
                    diff_b,
                    diff_u,
                    n,
                    offset=lax.axis_index(axis) * n,
                )
                return ct_b, [c[None] for c in ct_u]

            member = PartitionSpec(axis)
            ct_b, ct_u = jax.shard_map(
                local,
                mesh=mesh,
                in_specs=(member, PartitionSpec(), PartitionSpec(), member),
                out_specs=(member, member),
                axis_names={axis},
                check_vma=False,
            )(batched, unbatched, seeds, buf_cts)
            ct_u = [jnp.sum(c, axis=0, dtype=c.dtype) for c in ct_u]
        for j, c in zip(diff_b, ct_b):
            out_b[j] = c
        for j, c in zip(diff_u, ct_u):
            out_u[j] = c
        return out_b, out_u

    def _stream_mesh(self, s: Stream):
        """The compile's mesh. Without one, the loop runs unsharded (under ``jax.set_mesh``
        with Explicit axes its inputs are resharded first: ``_unshard_members``)."""
        return self.mesh

    def _mesh_axis(self, s: Stream, mesh) -> str | None:
        # An order statistic's passes count over every member: its stream runs unsharded.
        if mesh is None or s.placement not in mesh.axis_names or s.ordered:
            return None
        return s.placement if s.n % mesh.shape[s.placement] == 0 else None

    def _chunk_values(self, s: Stream, k: int):
        """``values(b_chunk, unbatched, members) -> {Value: [k, ...]}``: the per-member
        values a step reads (reduction operands, materialized values, the chunk's own
        inputs); ``members``: the chunk's cohort indices (int32[k])."""
        inner = self._members()

        def one_member(b_vals, u_vals, index):
            env = dict(zip(s.batched, b_vals))
            env.update(zip(s.unbatched, u_vals))
            env.update({v: env[src] for v, src in s.source.items()})
            for op in s.member_ops:
                vals = [env[v] for v in op.operands]
                if _stream_head(op):
                    outs = inner.run_region(op.regions[0], vals)
                elif op.name in LAYOUT:
                    outs = vals  # one member's value: nothing to lay out
                elif isinstance(_rule(op), MemberPosition):
                    outs = _rule(op)(index)
                else:
                    outs = inner.run_op(op, vals)
                env.update(zip(op.results, outs))
            return [env[v] for v in needed]

        # (a list, in a fixed order: Values are not pytree keys)
        needed = list(
            dict.fromkeys(
                v
                for v in [
                    *(u for op in (*s.reductions, *s.ordered) for u in op.operands),
                    *s.materialized,
                ]
                if v not in s.batched and v not in s.unbatched
            )
        )
        # axis_size: a map whose operands are all broadcast values has nothing batched.
        vmapped = jax.vmap(one_member, in_axes=(0, None, 0), axis_size=k)

        def values(b_chunk, unbatched, members, shapes_only=False) -> dict:
            if shapes_only:  # b_chunk: ShapeDtypeStructs
                outs = jax.eval_shape(lambda b: vmapped(b, unbatched, members), b_chunk)
            else:
                outs = vmapped(b_chunk, unbatched, members)
            vals = dict(zip(needed, outs))
            vals.update(zip(s.batched, b_chunk))
            return vals

        return values

    def _stream_local(self, s: Stream, batched, unbatched, n: int, offset=0):
        """Loops over ``n`` local members in chunks; (accumulators, full-shape outputs).
        ``offset``: the cohort index of the first local member (a device's share)."""
        k = min(self.k, n)
        values = self._chunk_values(s, k)
        chunk_specs = [jax.ShapeDtypeStruct((k, *x.shape[1:]), x.dtype) for x in batched]
        shapes = values(chunk_specs, unbatched, _cohort(0, k), shapes_only=True)
        accs0 = [_accumulator(op).init(op, shapes, s.n) for op in s.reductions]
        bufs0 = [_zeros((n, *shapes[v].shape[1:]), shapes[v].dtype) for v in s.materialized]

        def step(state, start, valid):
            accs, bufs = state
            members = _cohort(offset + start, k)
            vals = values(
                [lax.dynamic_slice_in_dim(x, start, k, 0) for x in batched], unbatched, members
            )
            accs = [
                _accumulator(op).step(op, a, vals, valid, s.n, members=members)
                for op, a in zip(s.reductions, accs)
            ]
            new_bufs = []
            for v, buf in zip(s.materialized, bufs):
                x = vals[v]
                if valid is not None:
                    x = _select(valid, x, lax.dynamic_slice_in_dim(buf, start, k, 0))
                new_bufs.append(lax.dynamic_update_slice_in_dim(buf, x, start, 0))
            return accs, new_bufs

        return _chunk_loop(n, k, step, (accs0, bufs0))

    def _ordered(self, s: Stream, batched, unbatched, n: int) -> list:
        """The stream's reductions computed by passes over the chunks (the order
        statistics, the robust aggregates): every pass runs the member ops again on each
        chunk (streaming_order.py, streaming_robust.py), so no per-member value is kept."""
        if not s.ordered:
            return []
        k = min(self.k, n)
        values = self._chunk_values(s, k)
        chunk_specs = [jax.ShapeDtypeStruct((k, *x.shape[1:]), x.dtype) for x in batched]
        shapes = values(chunk_specs, unbatched, _cohort(0, k), shapes_only=True)
        outs = []
        for op in s.ordered:
            v = op.operands[0]

            def operand(start, v=v):
                b = [lax.dynamic_slice_in_dim(x, start, k, 0) for x in batched]
                return values(b, unbatched, _cohort(start, k))[v]

            cls = F.ops()[op.name]
            shape, dtype = shapes[v].shape[1:], shapes[v].dtype
            outs.append(_by_passes(op).run(cls, op.attrs, Chunks(n, k, operand), shape, dtype))
        return outs

    def _backward_local(
        self, s, batched, unbatched, seeds, buf_cts, mats, diff_b, diff_u, n, offset=0
    ):
        """The reverse loop over ``n`` local members (the first at cohort index
        ``offset``): each chunk's values recomputed under ``jax.vjp``, pulled back with
        the chunk's share of the cotangents; (cotangents of the differentiable batched
        inputs, of the unbatched ones)."""
        k = min(self.k, n)
        values = self._chunk_values(s, k)
        mat_values = [s.materialized[j] for j in mats]

        def contributions(db, du, b_chunk, valid, members):
            b_vals, u_vals = list(b_chunk), list(unbatched)
            for j, x in zip(diff_b, db):
                b_vals[j] = x
            for j, x in zip(diff_u, du):
                u_vals[j] = x
            vals = values(b_vals, u_vals, members)
            parts = [
                None if seed is None else _accumulator(op).contribution(op, vals, valid)
                for op, seed in zip(s.reductions, seeds)
            ]
            return parts, [vals[v] for v in mat_values]

        def step(state, start, valid):
            ct_b, ct_u = state
            b_chunk = [lax.dynamic_slice_in_dim(x, start, k, 0) for x in batched]
            members = _cohort(offset + start, k)
            (parts, _), pull = jax.vjp(
                lambda db, du: contributions(db, du, b_chunk, valid, members),
                [b_chunk[j] for j in diff_b],
                [unbatched[j] for j in diff_u],
            )
            part_cts = [
                None
                if seed is None
                else _accumulator(op).part_cotangent(op, seed, part, valid, members=members)
                for op, seed, part in zip(s.reductions, seeds, parts)
            ]
            mat_cts = [_mask(lax.dynamic_slice_in_dim(c, start, k, 0), valid) for c in buf_cts]
            db, du = pull((part_cts, mat_cts))
            ct_u = [a + c for a, c in zip(ct_u, du)]
            ct_b = [
                lax.dynamic_update_slice_in_dim(
                    a, lax.dynamic_slice_in_dim(a, start, k, 0) + _mask(c, valid), start, 0
                )
                for a, c in zip(ct_b, db)
            ]
            return ct_b, ct_u

        init = (
            [jnp.zeros_like(batched[j]) for j in diff_b],
            [jnp.zeros_like(unbatched[j]) for j in diff_u],
        )
        return _chunk_loop(n, k, step, init, differentiable=True)


@dataclasses.dataclass(frozen=True)
class Chunks:
    """A stream value's ``n`` members ``k`` at a time, as the by-passes families read it
    (``streaming_order.py``, ``streaming_robust.py``): ``values(start)`` computes the
    members ``start .. start + k - 1`` (running the stream's member ops on them)."""

    n: int
    k: int
    values: object

    @property
    def count(self) -> int:
        """How many chunks cover the members."""
        return -(-self.n // self.k)

    def bounds(self, i):
        """(start, valid) of chunk ``i`` (traced), laid out as ``_chunk_loop`` lays them."""
        return _chunk_bounds(self.n, self.k, i)

    def at(self, i):
        """(values, valid, start) of chunk ``i``: ``valid`` (None when ``k`` divides
        ``n``) masks the members an earlier chunk holds."""
        start, valid = self.bounds(i)
        return self.values(start), valid, start

    def fold(self, step, acc0):
        """One pass: ``acc0`` through ``step(acc, values, valid, start)`` for every
        chunk (``start``: the cohort index of its first member)."""
        return _chunk_loop(
            self.n,
            self.k,
            lambda acc, start, valid: step(acc, self.values(start), valid, start),
            acc0,
        )


def _cohort(start, k: int):
    """The cohort indices of a chunk of ``k`` members from ``start`` (int32[k])."""
    return start + jnp.arange(k, dtype=jnp.int32)


def _chunk_bounds(n: int, k: int, i):
    """(start, valid) of chunk ``i`` of ``n`` members ``k`` at a time: the last chunk
    starts at ``n - k`` when ``k`` does not divide ``n``, and ``valid`` (None otherwise)
    masks the members the chunk before it already holds."""
    if -(-n // k) * k == n:
        return i * k, None
    start = jnp.minimum(i * k, n - k)
    return start, (start + jnp.arange(k)) >= i * k


def _chunk_loop(n: int, k: int, step, state, *, differentiable: bool = False):
    """``state`` through ``step(state, start, valid)`` for the chunks of ``n`` members,
    ``k`` at a time (one step inlined). The last chunk starts at ``n - k`` when ``k``
    does not divide ``n``; ``valid`` (None otherwise) masks the members an earlier chunk
    already counted.

    The forward loop is a ``lax.while_loop``: it runs inside the stream's custom VJP,
    so JAX never differentiates it, and a while loop gives partial evaluation nothing to
    hoist (around a scan of rounds, JAX would hoist a scan's slicing of loop-invariant
    client data out of the rounds loop and stack every chunk: the whole cohort again).
    The backward loop (``differentiable``) is a ``lax.scan``, so a second derivative
    still goes through it."""
    steps = -(-n // k)

    def body(carry):
        # The step number is carried, not scanned over: nothing in the loop's state
        # grows with the number of steps.
        i, state = carry
        start, valid = _chunk_bounds(n, k, i)
        return i + 1, step(state, start, valid)

    init = (jnp.zeros((), jnp.int32), state)
    if steps == 1:
        _, state = body(init)
    elif differentiable:
        (_, state), _ = lax.scan(lambda c, _: (body(c), None), init, None, length=steps)
    else:
        _, state = lax.while_loop(lambda c: c[0] < steps, body, init)
    return state


def _explicit_member_axis(x):
    """The mesh axis (or axes) ``x``'s member axis is Explicit-sharded over, or None."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    spec = getattr(sharding, "spec", None)
    if not spec or spec[0] is None or getattr(sharding.mesh, "empty", True):
        return None
    if all(t != jax.sharding.AxisType.Explicit for t in sharding.mesh.axis_types):
        return None
    return spec[0]


def _check_member_layouts(s: Stream, env: dict) -> None:
    """The unstreamed map's layout check (``fcir.fed.map``), for a stream run without a
    mesh context: a broadcast operand is unsharded there, so beside client data
    Explicit-sharded over the mesh its member axis is laid out differently, and the
    unstreamed program is refused with a PlacementError saying what to do. The stream
    never binds the map to its whole operands, so it checks them here, alike."""
    if not jax.sharding.get_abstract_mesh().empty:
        return
    axes, avals = [], []
    for v in s.map_op.operands:
        x = env.get(s.source[v]) if v in s.source else env.get(v)
        if x is None:  # recomputed in this stream's prelude
            continue
        axes.append(None if v in s.source else _explicit_member_axis(x))
        avals.append(jax.typeof(x))
    if len(set(axes)) > 1:
        raise mixed_layout_error(s.placement, axes, avals)


def _unshard_members(x):
    """``x`` with its member axis not explicitly sharded: a chunk is a dynamic slice of
    it, which JAX refuses on an Explicit-sharded axis (``jax.set_mesh`` with Explicit
    axes, or client data placed on such a mesh, when the loop does not run under
    shard_map)."""
    if _explicit_member_axis(x) is None:
        return x
    sharding = jax.typeof(x).sharding
    spec = PartitionSpec(None, *sharding.spec[1:])
    if jax.sharding.get_abstract_mesh().empty:  # no mesh in context: name x's own
        spec = jax.sharding.NamedSharding(sharding.mesh, spec)
    return jax.sharding.reshard(x, spec)


# --- the backward loop's cotangents -----------------------------------------------------


def _inexact(dtype) -> bool:
    return not _is_key(dtype) and jnp.issubdtype(dtype, jnp.inexact)


class _Static:
    """A pytree with no leaves carrying ``value`` (hashable) in its structure: static
    data through a custom_vjp's residuals."""

    def __init__(self, value):
        self.value = value


jax.tree_util.register_pytree_node(_Static, lambda x: ((), x.value), lambda v, _: _Static(v))


def _zero(ct) -> bool:
    return isinstance(ct, SymbolicZero)


def _seed(op: Op, acc: list, cts: list, n: int):
    """What every chunk's contribution (``Accumulator.contribution``) is pulled back
    with, from the cotangents ``cts`` of the reduction's results; None when none is
    needed."""
    if all(_zero(c) for c in cts) or not all(_inexact(c.dtype) for c in cts):
        return None
    cts = [jnp.zeros(c.aval.shape, c.aval.dtype) if _zero(c) else c for c in cts]
    return _accumulator(op).seed(op, acc, cts, n)


def _mask(x, valid):
    """``x`` with the members an earlier chunk already counted zeroed."""
    return x if valid is None else A.masked(x, valid, jnp.zeros((), x.dtype))


# --- arrays of any dtype (PRNG keys included) ---------------------------------------------


def _is_key(dtype) -> bool:
    return jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def _zeros(shape, dtype):
    if _is_key(dtype):
        data = jnp.zeros((*shape, *dtype._impl.key_shape), jnp.uint32)
        return jax.random.wrap_key_data(data, impl=dtype._impl.name)
    return jnp.zeros(shape, dtype)


def _select(valid, new, old):
    mask = valid.reshape((-1,) + (1,) * (new.ndim - 1))
    if _is_key(new.dtype):
        impl = new.dtype._impl.name
        a, b = jax.random.key_data(new), jax.random.key_data(old)
        mask = mask.reshape(mask.shape + (1,) * (a.ndim - mask.ndim))
        return jax.random.wrap_key_data(jnp.where(mask, a, b), impl=impl)
    return jnp.where(mask, new, old)
