"""Differential privacy as a property of the program: the leak check and the accountant.

**The check** (``leaks``; ``fcir.check`` runs it on a module captured from
``@fcir.program(..., private=True)``). A dataflow pass marks every value *derived from
client data*: the client-placed arguments of ``main`` and whatever is computed from
them. It follows values into every region by position (an op's operands become its
regions' parameters, the regions' yielded values its results), so it sees through
``fed.map`` and through server control flow (``jax.cond``, ``jax.scan``,
``jax.while``) alike, loops to a fixpoint. An operand that feeds no region parameter
(a ``cond`` index) or a yielded value that is no result (a ``while`` predicate) is
*control*: if it is derived from client data, every result is. In a hierarchy
(``{"silos": S, "clients": n}``) the mark is the depth of the placement whose data a
value derives from, and a region inside a ``fed.map`` over silos runs at the silos'
depth: a silo's own value derived from its clients' data is a leak as a server value
is (the silo is a party above its clients; a DP op of the server over silos would
bound what one silo adds, not what one client adds), while a silo's own data
(``{T}@silos``) is free at the silo. Then:

* ``privacy/C1``: a fed op whose result (at the server, or at a silo) is derived from
  data of the placement it aggregates (``fed.sum``, ``fed.mean``, ``fed.min``,
  ``fed.max``, ``fed.weighted_mean``, ``fed.secure_sum``) releases it without noise;
* ``privacy/C2``: ``main`` returns a client-placed value derived from client data
  (a per-client result returned as-is);
* ``privacy/C3``: any other op whose server result is derived from client data (e.g.
  server control flow whose branch or trip count depends on client data);
* ``privacy/C4``: a DP op whose noise is not provably distinct from that of every other
  release the accountant counts (the same key in every iteration of a scan, or for two
  DP ops; a constant key): ``fcir.privacy.keys`` follows each key to its origin;
* ``privacy/C6``: a DP op inside a ``jax.while``, whose releases the accountant cannot
  count (``epsilon`` refuses such a module too);
* ``privacy/C7``: ``main`` returns a key that is, or is derived from, or derives to the
  key of a DP release (the key argument returned unchanged, the key itself):
  ``fcir.privacy.keys`` again (``epsilon`` refuses such a module too).

``fed.dp_sum`` and ``fed.dp_mean`` are the only way through: their results are not
derived from client data in this sense (the Gaussian mechanism makes them safe to
release). Values computed only from server data (broadcast models, their per-client
copies, aggregates of those) pass. A reported value is not reported again downstream.

**The accountant** (``epsilon``). Each DP op is one Gaussian mechanism per round with
L2 sensitivity ``clip_norm`` (one client added or removed: the clip bounds its whole
contribution, so this is client-level DP) and noise ``noise_multiplier * clip_norm``.
The ops of one round compose (``releases``: an op inside a ``jax.scan`` counts
``length`` times, an op in either branch of a ``cond`` counts, an op in a ``while``
loop cannot be counted and is an error; an op inside a ``fed.map`` releases to the
placement above it, for disjoint groups of clients, so it counts once). Rounds compose
``rounds`` times, each with Poisson sampling of clients at ``sampling_rate`` when it is
below 1 (refused for a round with a ``fed.ddp_*`` op: only the sampled clients would
add their shares of its noise). The figures come from Google's ``dp-accounting``: RDP (Rényi DP, the
default: fast, and it handles every event) or PLD (privacy loss distributions,
``accountant="pld"``: tighter, several seconds for hundreds of rounds).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import threading
from collections.abc import Iterator

import numpy as np

from fcir import fed as F
from fcir.errors import PrivacyError
from fcir.fed.dp_sum import exact_params_of
from fcir.ir import Module, Op, Region, Value, expect_module, value_numbering
from fcir.ir import control_flow as cf
from fcir.ir.types import SERVER, PlacedType
from fcir.mechanisms.ddgauss import op_params, rdp_noise_multiplier
from fcir.privacy import sampler_error
from fcir.privacy.keys import problems
from fcir.privacy.sampler_error import delta_with_sampler
from fcir.report.traffic import call_unit

__all__ = [
    "CONSTRAINTS",
    "DP_OPS",
    "ExactRelease",
    "Release",
    "epsilon",
    "leaks",
    "releases",
    "round_cost",
    "sampler_tv",
]
CONSTRAINTS = {
    "privacy/C1": "a fed op releases client data to the server only with noise",
    "privacy/C2": "main returns no per-client value derived from client data",
    "privacy/C3": "no other server value depends on client data (operands, branch index, "
    "loop condition)",
    "privacy/C4": "every DP release draws noise from a key provably distinct from every other "
    "release's, for central and distributed DP ops alike (fcir.privacy.keys)",
    "privacy/C5": "a distributed DP op's keys are derived from client data, one key per "
    "client (fcir.privacy.keys)",
    "privacy/C6": "no DP op inside a jax.while loop (its releases could not be counted)",
    "privacy/C7": "main returns no key a DP release draws from, derives its noise from or "
    "is derived from (fcir.privacy.keys)",
}

# The ops that release client data to the placement above only through the Gaussian
# mechanism: the leak check lets their results through, the accountant counts them.
DP_OPS = F.of_kind("dp", "ddp")
_AGGREGATES = F.of_kind("reduction")
_DDP = F.of_kind("ddp")


def _at_clients(t) -> bool:
    return isinstance(t, PlacedType) and t.placement != SERVER


def _at_server(t) -> bool:
    return isinstance(t, PlacedType) and t.placement == SERVER


def _local(t, level: int) -> bool:
    """A value held by the party a region at ``level`` runs on: ``T@server`` at the
    server, an unplaced ``T`` inside a ``fed.map``."""
    return _at_server(t) if level == 0 else not isinstance(t, PlacedType)


# --- the leak check -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Leak:
    code: str
    message: str
    path: tuple
    op: Op | None


class _Taint:
    """The leak check's dataflow pass. A value's taint is the depth of the deepest
    placement whose data it is derived from (0: none; the first placement below the
    server is 1): under ``{"silos": 2, "clients": 3}`` a client argument has taint 2, a
    silo's own argument taint 1. A region runs at a level (0 at the server, inside a
    ``fed.map`` the depth of its members' placement); a value local to that level whose
    taint is deeper holds data of the parties below it without noise, a leak."""

    def __init__(self, module: Module):
        self.module = module
        self.depth = {name: i + 1 for i, (name, _) in enumerate(module.placements)}
        self.taint: dict[Value, int] = {}
        self.found: dict = {}  # id(op) (and ("C6", id(op))) -> first leak found at it
        self.defined: dict[Value, tuple[tuple, Op]] = {}

    @property
    def tainted(self) -> set[Value]:
        """The values derived from client data (for ``fcir.privacy.keys``' ``privacy/C5``)."""
        return set(self.taint)

    def data_depth(self, t) -> int:
        """The taint of an argument of type ``t``: the depth of its innermost placement."""
        d = 0
        while isinstance(t, PlacedType):
            if t.placement != SERVER:
                d = max(d, self.depth.get(t.placement, len(self.depth)))
            t = t.member
        return d

    def run(self) -> list[Leak]:
        body = self.module.main.body
        self.region(body, [self.data_depth(v.type) for v in body.params], (), 0)
        names = None
        for v in body.results:
            if self.taint.get(v, 0) and _at_clients(v.type):
                names = names or value_numbering(self.module.main)
                path, op = self.defined.get(v, ((), None))
                what = f"%{names[v]} ({v.type})"
                if op is None:
                    what += ", a client argument,"
                self.found[id(v)] = Leak(
                    "privacy/C2",
                    f"privacy/C2: the program returns {what} a per-client value derived "
                    "from client data, as-is; in a private program return only what "
                    "fcir.dp_sum / fcir.dp_mean release",
                    path,
                    op,
                )
        return list(self.found.values())

    def region(self, region: Region, taints: list[int], path: tuple, level: int) -> list[int]:
        for v, t in zip(region.params, taints):
            if t:
                self.taint[v] = max(self.taint.get(v, 0), t)
        for i, op in enumerate(region.ops):
            p = (*path, i)
            for v in op.results:
                self.defined[v] = (p, op)
            self.op(op, p, level)
        return [self.taint.get(v, 0) for v in region.results]

    def op(self, op: Op, path: tuple, level: int) -> None:
        ins = [self.taint.get(v, 0) for v in op.operands]
        if op.name == "jax.while" and any(_has_dp(r) for r in op.regions):
            self.report_while(op, path)
        rule = RULES.get(F.op_class(op))
        if rule is not None:
            outs = rule(self, op, ins, path, level)
        elif op.regions:
            outs = self.control_flow(op, ins, path, level)
        else:  # local ops: results follow operands
            outs = _follows(self, op, ins, path, level)
        for v, t in zip(op.results, outs):
            if t > level and _local(v.type, level):
                # The first value of this level derived from the data of the parties
                # below it: reported, and not followed further.
                self.report(op, path, level)
            elif t:
                self.taint[v] = max(self.taint.get(v, 0), t)

    def members_level(self, op: Op, level: int) -> int:
        """The level of a ``fed.map``'s region: the depth of its operands' placement."""
        for v in op.operands:
            t = v.type
            if isinstance(t, PlacedType) and t.placement != SERVER:
                return self.depth.get(t.placement, level + 1)
        return level + 1

    def report_while(self, op: Op, path: tuple) -> None:
        self.found.setdefault(
            ("C6", id(op)),
            Leak(
                "privacy/C6",
                f"privacy/C6: a DP op inside {op.name} runs a number of times known only "
                "at run time, so the accountant cannot count its releases: use "
                "jax.lax.scan or jax.lax.fori_loop with Python int bounds (a static "
                "length), or move the DP op out of the loop",
                path,
                op,
            ),
        )

    def report(self, op: Op, path: tuple, level: int) -> None:
        if id(op) in self.found:
            return
        if level == 0:
            to = "the server"
        else:
            names = [name for name, d in self.depth.items() if d == level] or ["?"]
            to = f"each member of {names[0]!r}"
        if op.name in DP_OPS:
            msg = (
                f"privacy/C1: {op.name} has noise_multiplier=0, so it releases the clipped "
                "sum of client data without noise; in a private program pass a "
                "noise_multiplier > 0 (0 is for a program without private=True, e.g. to "
                "measure what clipping alone costs)"
            )
            code = "privacy/C1"
        elif op.name in _AGGREGATES:
            msg = (
                f"privacy/C1: {op.name} releases a value derived from client data to {to} "
                "without noise; in a private program aggregate client data with "
                "fcir.dp_sum / fcir.dp_mean"
            )
            if level:  # inside a fed.map over silos: the member holds its clients' data
                msg += (
                    f" inside the map (a DP op above would bound what one member of "
                    f"{names[0]!r} adds, not what one client adds)"
                )
            code = "privacy/C1"
        else:
            where = "a server value" if level == 0 else f"a value at {to}"
            msg = (
                f"privacy/C3: {op.name} computes {where} that depends on client data "
                "(through its operands or its control flow); in a private program client "
                f"data reaches {'the server' if level == 0 else 'a placement above the clients'}"
                " only through fcir.dp_sum / fcir.dp_mean"
            )
            code = "privacy/C3"
        self.found[id(op)] = Leak(code, msg, path, op)

    def control_flow(self, op: Op, ins: list[int], path: tuple, level: int) -> list[int]:
        """Regions of a local op, wired as ``fcir.ir.control_flow.bindings`` says: params
        from operands, yields to results; loops (a yield that feeds a parameter again)
        iterate to a fixpoint. A tainted operand that feeds no parameter (a branch
        index) or a tainted loop predicate taints every result."""
        wiring = _wiring(op)
        fed_by: dict[int, list[tuple[int, int]]] = {}  # operand -> the params it feeds
        for r, (feeds, _) in enumerate(wiring):
            for k, j in enumerate(feeds):
                if j is not None:
                    fed_by.setdefault(j, []).append((r, k))
        control = max((t for j, t in enumerate(ins) if j not in fed_by), default=0)
        carried: dict[tuple[int, int], int] = {}
        outs = [0] * len(op.results)
        while True:  # taints only grow, so this reaches its fixpoint
            before = (dict(carried), list(outs), control)
            for r, sub in enumerate(op.regions):
                feeds, yields = wiring[r]
                taints = [
                    max(ins[j] if j is not None else control, carried.get((r, k), 0))
                    for k, j in enumerate(feeds)
                ]
                yielded = self.region(sub, taints, (*path, r), level)
                if yields is None:  # not a known control-flow op: yields line up with results
                    if len(yielded) == len(op.results):
                        outs = [max(o, t) for o, t in zip(outs, yielded)]
                    elif any(yielded):
                        control = max(control, *yielded)
                    continue
                for j, (t, (kind, k)) in enumerate(zip(yielded, yields)):
                    if not t:
                        continue
                    if kind == "predicate":
                        control = max(control, t)
                        continue
                    outs[j] = max(outs[j], t)
                    if kind == "carry":  # next iteration: every param its operand feeds
                        for target in fed_by.get(feeds[k], ()):
                            carried[target] = max(carried.get(target, 0), t)
            if control:
                outs = [max(o, control) for o in outs]
            if (carried, outs, control) == before:
                break
        return outs


# What the leak check does with each fed op (tests/fed/test_op_coverage.py reads RULES): a
# rule gives the taints of the op's results from its operands' (``_Taint.op``). A plain
# reduction releases its operands' information to the placement above in the clear
# (``_Taint.report`` makes that privacy/C1 on client data), a DP aggregate releases it
# through the Gaussian mechanism, a broadcast passes it on, a map's region is checked.


def _follows(taint: _Taint, op: Op, ins: list[int], path: tuple, level: int) -> list[int]:
    """Results derive from every operand (broadcast, plain reductions, local ops)."""
    return [max(ins, default=0)] * len(op.results)


def _region(taint: _Taint, op: Op, ins: list[int], path: tuple, level: int) -> list[int]:
    """The region runs at the level of its members: taint follows its dataflow."""
    return taint.region(op.regions[0], ins, (*path, 0), taint.members_level(op, level))


def _noised(taint: _Taint, op: Op, ins: list[int], path: tuple, level: int) -> list[int]:
    """A noised release is untainted (the accountant counts it); with
    noise_multiplier=0 it is the clipped sum, un-noised, and follows its operands."""
    if op.attrs["noise_multiplier"] > 0:
        return [0] * len(op.results)
    return _follows(taint, op, ins, path, level)


def _untainted(taint: _Taint, op: Op, ins: list[int], path: tuple, level: int) -> list[int]:
    """Results that carry nothing of the operands' values (a member's position)."""
    return [0] * len(op.results)


_BY_KIND = {
    "broadcast": _follows,
    "map": _region,
    "reduction": _follows,
    "dp": _noised,
    "ddp": _noised,  # noised at the clients; its keys are checked (privacy/C4, privacy/C5)
    "index": _untainted,
}
RULES = F.resolve(_BY_KIND)


def _wiring(op: Op) -> list[tuple[list[int | None], list[tuple[str, int]] | None]]:
    """Per region of ``op``: the operand each parameter receives (None: none), and what
    each yield becomes (``Binding.results``), or None for an op with regions that
    ``fcir.ir.control_flow`` does not describe, whose parameters then line up with the last
    operands and whose yields with its results."""
    wiring: list = [None] * len(op.regions)
    for b in cf.bindings_of(op) or []:
        wiring[b.region] = ([j for j, _ in b.params], b.results)
    n = len(op.operands)
    for r, sub in enumerate(op.regions):
        if wiring[r] is None:
            params = len(sub.params)
            feeds = list(range(n - params, n)) if params <= n else [None] * params
            wiring[r] = (feeds, None)
    return wiring


def leaks(module: Module) -> list[Leak]:
    """Every path by which client data reaches the server other than through the DP
    aggregates (empty for a leak-free program), each naming its op; every DP op whose
    noise another release may repeat (``privacy/C4``); and every distributed DP op
    whose keys are not the clients' own (``privacy/C5``)."""
    expect_module(module, "fcir.privacy.leaks")
    taint = _Taint(module)
    found = taint.run()
    return found + [Leak(p.code, p.message, p.path, p.op) for p in problems(module, taint.tainted)]


# --- accounting -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Release:
    """One DP op of the round: ``count`` Gaussian releases per round."""

    op: str
    clip_norm: float
    noise_multiplier: float
    count: int


@dataclasses.dataclass(frozen=True)
class DdpRelease(Release):
    """A distributed DP op (``fed.ddp_*``): accounted as the Gaussian mechanism with
    ``accounted_noise_multiplier`` (``fcir.mechanisms.ddgauss.rdp_noise_multiplier``, at most
    ``noise_multiplier``)."""

    bits: int = 0
    accounted_noise_multiplier: float = 0.0
    local_stddev: float = 0.0  # each client's discrete Gaussian std, integer units
    coordinates: int = 0  # noise coordinates per release: clients x padded dimension
    # the fewest clients whose noise shares the release carries (the op's min_clients,
    # else the cardinality): ε holds for any number of replies from it up, and the
    # runtimes refuse fewer
    min_clients: int = 0

    @property
    def sampler_tv(self) -> float:
        """A bound on the total variation between one round's noise of this op as
        sampled (integer inverse CDF, ``fcir.mechanisms.ddgauss.sampler_tv``) and the exact discrete
        Gaussian's: ``count * coordinates`` times one coordinate's."""
        return self.count * self.coordinates * sampler_error.sampler_tv(self.local_stddev)


@dataclasses.dataclass(frozen=True)
class ExactRelease(Release):
    """A central DP op in exact mode (``gamma`` set; ``fcir.mechanisms.lattice``):
    integer discrete Gaussian noise on the grid-rounded sum, accounted as the Gaussian
    mechanism with ``accounted_noise_multiplier = noise_multiplier / (1 + sqrt(d) gamma
    / (2 clip_norm))`` (the rounding's share of the sensitivity)."""

    gamma: float = 0.0
    accounted_noise_multiplier: float = 0.0
    local_stddev: float = 0.0  # the discrete Gaussian's std, grid units
    coordinates: int = 0  # noise coordinates per release: the member's elements

    @property
    def sampler_tv(self) -> float:
        """As ``DdpRelease.sampler_tv``: ``count * coordinates`` times one coordinate's."""
        return self.count * self.coordinates * sampler_error.sampler_tv(self.local_stddev)


# Releases with integer-exact noise from the sampler: accounted by their RDP bound,
# with the sampler's total variation in δ.
_DISCRETE = (DdpRelease, ExactRelease)


def releases(module: Module) -> list[Release]:
    """The DP ops of one round, in program order, with how often each runs."""
    expect_module(module, "fcir.privacy.releases")
    return list(_releases(module.main.body, 1, module))


def _releases(region: Region, times: int, module: Module) -> Iterator[Release]:
    for op in region.ops:
        if op.name in _DDP:  # fed.ddp_*: fcir.mechanisms.ddgauss
            p = op_params(module, op)
            yield DdpRelease(
                op.name,
                op.attrs["clip_norm"],
                op.attrs["noise_multiplier"],
                times,
                op.attrs["bits"],
                rdp_noise_multiplier(p),
                p.local_stddev,
                p.n * p.padded_dim,
                p.shares,
            )
        elif op.name in DP_OPS and "gamma" in op.attrs:  # exact mode: fcir.mechanisms.lattice
            p = exact_params_of(op, module.cardinality(op.operands[0].type.placement))
            yield ExactRelease(
                op.name,
                op.attrs["clip_norm"],
                op.attrs["noise_multiplier"],
                times,
                op.attrs["gamma"],
                p.accounted_noise_multiplier,
                p.stddev,
                p.dim,
            )
        elif op.name in DP_OPS:
            yield Release(op.name, op.attrs["clip_norm"], op.attrs["noise_multiplier"], times)
        elif op.name == "jax.while" and any(_has_dp(r) for r in op.regions):
            raise PrivacyError(
                f"fcir.privacy: a DP op inside {op.name} runs a number of times known only "
                "at run time, so its privacy cost cannot be accounted: use jax.lax.scan "
                "(a static length) or move the DP op out of the loop"
            )
        elif op.name == "jax.scan":
            for sub in op.regions:
                yield from _releases(sub, times * cf.scan_length(op), module)
        else:
            for sub in op.regions:
                yield from _releases(sub, times, module)


def _has_dp(region: Region) -> bool:
    return any(op.name in DP_OPS or any(_has_dp(r) for r in op.regions) for op in region.ops)


def _z(r: Release) -> float:
    return r.accounted_noise_multiplier if isinstance(r, _DISCRETE) else r.noise_multiplier


def _round_event(rels: list[Release], sampling_rate: float):
    import dp_accounting as dpa

    if any(_z(r) == 0 for r in rels):
        return dpa.NonPrivateDpEvent()
    if any(isinstance(r, _DISCRETE) for r in rels):
        sampling_rate = (
            1.0  # fcir.mechanisms.ddgauss: no amplification by sampling is claimed (epsilon
        )
        # refuses a sampled round; round_cost states every client taking part)
    if sampling_rate >= 1.0:
        events = [
            dpa.SelfComposedDpEvent(dpa.GaussianDpEvent(_z(r)), r.count)
            if r.count > 1
            else dpa.GaussianDpEvent(_z(r))
            for r in rels
        ]
        return events[0] if len(events) == 1 else dpa.ComposedDpEvent(events)
    # Under sampling one round's releases see the same sampled clients, so the round is
    # one sampled event. Releases of one client's clipped data with noise multipliers
    # z_i are together exactly one Gaussian mechanism with 1/z^2 = sum 1/z_i^2 (the
    # subsampled events of the accountants take a single Gaussian inside).
    z = 1.0 / math.sqrt(sum(r.count / _z(r) ** 2 for r in rels))
    return dpa.PoissonSampledDpEvent(sampling_rate, dpa.GaussianDpEvent(z))


def rounds_arg(who: str, value) -> int:
    """A number of rounds as an int: Python or NumPy integers >= 0 (``np.int64`` from a
    config or ``np.arange`` is a count too); bools, floats and negatives are a
    PrivacyError naming ``who``. The one check of ``epsilon``, ``sampler_tv`` and
    ``Budget``."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral) or value < 0:
        raise PrivacyError(f"{who}: rounds must be an int >= 0, got {value!r}")
    return int(value)


def _probability(who: str, name: str, value, interval: str) -> float:
    """``value`` as a float in ``interval`` ("(0, 1)" or "(0, 1]"), else a PrivacyError
    that names the argument (None, strings and NaN included)."""
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if ok:
        value = float(value)
        ok = 0.0 < value < 1.0 or (interval == "(0, 1]" and value == 1.0)
    if not ok:
        raise PrivacyError(f"{who}: {name} must be a number in {interval}, got {value!r}")
    return value


def epsilon(
    module: Module,
    rounds: int,
    delta: float,
    sampling_rate: float = 1.0,
    *,
    accountant: str = "rdp",
) -> float:
    """ε of ``rounds`` rounds of ``module`` at ``delta``, clients Poisson-sampled at
    ``sampling_rate`` each round (1.0: every client takes part).

    Reads every DP op of the module (its noise multiplier, how often one round runs
    it) and composes them with dp-accounting: ``accountant="rdp"`` (default) or
    ``"pld"``. A module without DP ops has ε = 0 if it is private (it releases no
    client data); otherwise nothing bounds what it releases, a PrivacyError.
    """
    import dp_accounting as dpa

    expect_module(module, "fcir.privacy.epsilon")
    rounds = rounds_arg("fcir.privacy.epsilon", rounds)
    delta = _probability("fcir.privacy.epsilon", "delta", delta, "(0, 1)")
    sampling_rate = _probability("fcir.privacy.epsilon", "sampling_rate", sampling_rate, "(0, 1]")
    rels = releases(module)
    _distinct_noise(module)
    if not rels:
        if module.private:
            return 0.0
        raise PrivacyError(
            f"fcir.privacy.epsilon: @{module.name} has no fed.dp_sum / fed.dp_mean and is "
            "not private, so nothing bounds what it releases: aggregate with "
            "fcir.dp_sum / fcir.dp_mean and declare @fcir.program(..., private=True)"
        )
    if rounds == 0:
        return 0.0
    if sampling_rate < 1.0 and any(isinstance(r, DdpRelease) for r in rels):
        raise PrivacyError(
            f"fcir.privacy.epsilon: @{module.name} has a fed.ddp_* op, whose noise is "
            "shared by all the clients of its placement (each adds 1/n of the variance); "
            f"a round sampled at rate {sampling_rate:g} sums only the sampled clients' "
            "shares, less noise than the op states, so no epsilon holds for it: run "
            "every client each round (sampling_rate=1.0; on Flower, clients=n), or use "
            "fcir.dp_sum / fcir.dp_mean, whose noise the server adds"
        )
    if sampling_rate < 1.0 and any(isinstance(r, ExactRelease) for r in rels):
        raise PrivacyError(
            f"fcir.privacy.epsilon: @{module.name} has an exact-mode fed.dp_* op (discrete "
            "Gaussian noise, fcir.mechanisms.lattice), for which no amplification by "
            f"sampling is claimed: account it at sampling_rate=1.0, not {sampling_rate:g}"
        )
    if accountant == "pld" and any(isinstance(r, _DISCRETE) for r in rels):
        raise PrivacyError(
            "fcir.privacy.epsilon: fed.ddp_* ops and exact-mode fed.dp_* ops are accounted "
            "by their Rényi DP bound (fcir.mechanisms.ddgauss, fcir.mechanisms.lattice), "
            "which a privacy loss distribution does not use: pass accountant='rdp'"
        )
    if accountant not in ("rdp", "pld"):
        raise PrivacyError(
            f"fcir.privacy.epsilon: accountant must be 'rdp' or 'pld', got {accountant!r}"
        )
    event = _round_event(rels, float(sampling_rate))
    event = dpa.SelfComposedDpEvent(event, rounds) if rounds > 1 else event
    if accountant == "pld":
        return float(dpa.pld.PLDAccountant().compose(event).get_epsilon(float(delta)))
    return _rdp_epsilon(event, float(delta))


# dp-accounting's warning for a fractional RDP order whose series it gave up on.
_GAVE_UP = "_compute_log_a_frac failed to converge"


def _rdp_epsilon(event, delta: float) -> float:
    """ε of ``event`` by dp-accounting's RDP accountant at its default orders, without
    its warnings about orders that cannot change the result.

    A sampled Gaussian's RDP at a fractional order is a series that dp-accounting gives
    up on after 1000 terms for some orders near 1 (q = 0.1, σ = 1: orders 1.1 to 1.5),
    logging a warning per order and leaving the order out, which can only make ε
    larger. Whatever the order's RDP r >= 0, order a gives dp-accounting's conversion
    ε >= log1p(-1/a) - log(δ a) / (a - 1): 23 at a = 1.5 and δ = 1e-5, far above any
    useful ε. (Its other shortcut, ε = 0 when r < -log1p(-δ²), needs an RDP the
    given-up orders do not come near: 1e-3 a round at least, over q in 1e-6..0.9 and
    σ in 0.3..10.) So the ε is what all orders would give, and a warning is kept only
    for an order that could have given a smaller one."""
    import logging

    import dp_accounting as dpa

    gave_up: list[logging.LogRecord] = []

    def withhold(record: logging.LogRecord) -> bool:
        mine = record.thread == threading.get_ident() and str(record.msg).startswith(_GAVE_UP)
        if mine:
            gave_up.append(record)
        return not mine

    absl = logging.getLogger("absl")
    absl.addFilter(withhold)
    try:
        accountant = dpa.rdp.RdpAccountant().compose(event)
    finally:
        absl.removeFilter(withhold)
    eps = float(accountant.get_epsilon(delta))
    for record in gave_up:
        a = float(record.args[-1])  # (iterations, q, sigma, alpha)
        if a > 1.01 and math.log1p(-1 / a) - math.log(delta * a) / (a - 1) < eps:
            absl.handle(record)
    return eps


def sampler_tv(module: Module, rounds: int) -> float:
    """A bound on the total variation between ``rounds`` rounds of ``module`` as run
    (the sampled discrete Gaussian of the ``ddp_*`` ops, ``fcir.mechanisms.ddgauss.sampler_tv``) and
    the exact mechanism the accountant bounds; 0 for a module without ``ddp_*`` ops. The run
    is ``(ε, δ + (1 + e**ε) tv)``-DP where ``epsilon`` gives ``(ε, δ)``."""
    expect_module(module, "fcir.privacy.sampler_tv")
    rounds = rounds_arg("fcir.privacy.sampler_tv", rounds)
    return rounds * sum(r.sampler_tv for r in releases(module) if isinstance(r, _DISCRETE))


def _distinct_noise(module: Module) -> None:
    """The accountant counts each release as independent: refuse a module where two
    may draw the same noise (private or not)."""
    found = problems(module)
    if found:
        raise PrivacyError(f"fcir.privacy.epsilon: {found[0].message}")


def round_cost(module: Module, delta: float = 1e-5) -> dict | None:
    """The privacy cost of one round (every client taking part), for the cost report
    and ``fcir show``; None when the module has no DP ops."""
    delta = _probability("fcir.privacy.round_cost", "delta", delta, "(0, 1)")
    try:
        rels = releases(module)
        if not rels:
            return None
        per_round = epsilon(module, 1, delta)
    except PrivacyError as e:
        return {"error": str(e)}
    cost = {
        "releases": [dataclasses.asdict(r) for r in rels],
        "delta": delta,
        "epsilon_per_round": per_round,
        "accountant": "rdp",
        "unit": call_unit(module),  # "round", or a call of a program that loops over rounds
    }
    if any(isinstance(r, _DISCRETE) for r in rels):
        # The sampler's distance from the exact law (a bound), and the δ it makes.
        tv = sum(r.sampler_tv for r in rels if isinstance(r, _DISCRETE))
        cost["sampler_tv_per_round"] = tv
        cost["delta_with_sampler"] = delta_with_sampler(per_round, delta, tv)
    return cost


def format_round_cost(cost: dict | None) -> list[str]:
    """Lines for humans (``fcir show`` prefixes them with ``//``)."""
    if cost is None:
        return []
    if "error" in cost:
        return [f"privacy: {cost['error']}"]
    lines = [f"privacy (per {cost.get('unit', 'round')}, every client taking part):"]
    for r in cost["releases"]:
        times = f" x{r['count']}" if r["count"] > 1 else ""
        ddp = (
            f" bits={r['bits']} (accounted as {r['accounted_noise_multiplier']:.4g}"
            + (f", at {r['min_clients']} clients" if r.get("min_clients") else "")
            + ")"
            if "bits" in r
            else f" exact gamma={r['gamma']:g} (accounted as {r['accounted_noise_multiplier']:.4g})"
            if "gamma" in r
            else ""
        )
        lines.append(
            f"  {r['op']}{times}: clip_norm={r['clip_norm']:g} "
            f"noise_multiplier={r['noise_multiplier']:g}{ddp}"
        )
    lines.append(
        f"  epsilon={cost['epsilon_per_round']:.4g} at delta={cost['delta']:g} "
        f"({cost['accountant'].upper()}; fcir.privacy.epsilon composes "
        f"{'rounds' if cost.get('unit', 'round') == 'round' else 'calls'})"
    )
    if "sampler_tv_per_round" in cost:
        lines.append(
            f"  discrete Gaussian sampler: within TV {cost['sampler_tv_per_round']:.3g} of the "
            f"exact law, so as run delta={cost['delta_with_sampler']:.3g} "
            "(fcir.mechanisms.ddgauss.sampler_tv)"
        )
    return lines
