"""Where the PRNG key of each DP release comes from: ``privacy/C4``.

A DP op adds Gaussian noise drawn from its key. The accountant (``fcir.privacy.epsilon``)
counts every release as an independent Gaussian mechanism: an op inside a
``jax.scan`` of length L as L releases, two ops as two. That holds only if no two
releases draw the same noise: the difference of two releases with the same noise is
noise-free. This pass proves it, or names the op it cannot prove it for.

Each key is described by a *term*: a root (an argument of ``main``, or a constant) and
the path of derivations from it, each ``jax.random.fold_in(k, d)`` or
``jax.random.split(k, n)[d]`` one step with an integer ``d`` (the two are one kind of
step: with ``jax_threefry_partitionable`` they compute the same key). A step's integer
is a constant, one per iteration of a scan (its ``xs`` sliced from ``iota``/``arange``
or a constant vector, or a ``fori_loop`` counter: a carry that starts at a constant and
adds 1), or unknown. A key carried by a scan that derives its next value from itself
(``key, sub = jax.random.split(key)``) advances every iteration. Two releases draw
distinct noise if their terms differ provably for every pair of iterations that can
run both: a step whose integers differ (``fold_in(key, i)`` with the scan index, once
per iteration), or one path longer than the other (a key and what is derived from it).
Different arguments are not provably different keys (a caller may pass one key twice),
and a key that is a constant of the program draws the same noise every run.

Releases inside a ``fed.map`` run once per member: a key broadcast to the members draws
the same noise for each, a per-member key (client-placed, the caller's) is trusted to
differ like an argument. Releases in different branches of one ``cond`` never run in
the same iteration. The keys of separate runs of the program (rounds driven from
Python) are the caller's: pass a fresh key each run (``jax.random.fold_in(key, round)``).

The distributed DP ops (kind ``ddp``, ``fcir.ddp_sum`` / ``fcir.ddp_mean``) are releases
of the same analysis with the same rules: their operand is an array of per-client keys,
described by the same terms (a client-placed argument, or what a ``fed.map`` derives
member by member from one: ``fcir.map_fn(lambda k: fold_in(k, i), keys)`` is the term
of ``keys`` with the step ``i``, as the per-client keys of different clients are the
caller's and trusted to differ, like the members of a central release inside a map).
Two ``ddp_*`` releases, or one in two iterations, must draw provably different keys, as
two central releases must (``privacy/C4``). Central and distributed releases are
compared within their kind: one draws from a key at the server, the other from the
clients' keys, which no program derives from the server's. And with the set of values
derived from client data (``fcir.privacy.leaks`` passes it), the analysis adds the
rule only distributed releases have, ``privacy/C5``: their keys are derived from client
data (keys computed from server values alone are the same at every client; a key
broadcast to the clients is already rejected by the op's type).
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np

from fcir.fed import Broadcast, Map, of_kind, op_class
from fcir.ir import Module, Op, Region, Value
from fcir.ir import control_flow as cf
from fcir.ir.types import PlacedType

__all__ = [
    "KeyProblem",
    "check_member_keys",
    "ddp_key_arguments",
    "duplicate_members",
    "key_arguments",
    "problems",
]

_CALL_OPS = frozenset(f"jax.{n}" for n in cf.CALLS)
_PASS = frozenset(
    {
        "jax.convert_element_type",
        "jax.copy",
        "jax.random_wrap",
        "jax.random_unwrap",
        "jax.sharding_constraint",
        "jax.reshard",
        "jax.mesh_cast",
        "jax.copy_p",
        "jax.optimization_barrier",
    }
)
# The central DP ops, whose key is local to where the result lives, and the distributed
# ones, whose last operand holds one key per client.
_CENTRAL_DP = of_kind("dp")
_DDP = of_kind("ddp")
_BIG = 1 << 40  # the trip count of a while loop: unknown, so unbounded
# The ops ``_local`` follows a key through (a key in, a key out); any other op that
# reads a key uses it (privacy/C7).
_DERIVE = _PASS | {
    "jax.random_seed",
    "jax.random_fold_in",
    "jax.random_split",
    "jax.slice",
    "jax.dynamic_slice",
    "jax.squeeze",
    "jax.reshape",
}
_KEYS = ("key", "keys", "one")


@dataclasses.dataclass(frozen=True)
class KeyProblem:
    message: str
    path: tuple
    op: Op
    code: str = "privacy/C4"


_MSG_CLIENT = (
    "privacy/C5: {op} takes keys that are the same at every client (derived from server "
    "values only), so every client would add the same noise; pass one key per client as "
    "client data, e.g. jax.random.split(jax.random.fold_in(key, round), n)"
)
_MSG_REUSE = (
    "privacy/C4: {op} reuses the keys of {where}, so two releases would carry the same "
    "noise; derive each release's keys with jax.random.fold_in(keys, i) (per client, "
    "inside fcir.map_fn) or pass fresh ones"
)


@dataclasses.dataclass
class _Release:
    op: Op
    path: tuple
    key: tuple | None
    frames: tuple  # ("loop", id) / ("map", id) / ("cond", id, branch), outermost first


# Integers: ("c", v) a constant; ("vec", seq) a constant vector; ("it", s, seq): seq[t]
# in iteration t of loop s; ("sym", s, k, off): loop s's carry k plus off (while
# resolving a loop). Keys: ("key", root, path); ("keys", root, path, n): split(.., n).
# A path step is ("d", int-or-None) or ("adv", s, steps): the carried key of loop s,
# advanced by ``steps`` once per iteration.


def _seq_in(v, seq) -> bool:
    return v in seq


def _disjoint(a, b) -> bool:
    if isinstance(a, range) and isinstance(b, range):
        return a.stop <= b.start or b.stop <= a.start or not a or not b
    if isinstance(a, range) and len(a) > 1 << 16:
        return not any(x in a for x in b)
    if isinstance(b, range) and len(b) > 1 << 16:
        return not any(x in b for x in a)
    return not set(a) & set(b)


def _distinct_entries(a) -> bool:
    return isinstance(a, range) or len(set(a)) == len(a)


def _elementwise(a, b) -> str:
    if isinstance(a, range) and isinstance(b, range):
        if a == b:
            return "eq"
        return "ne" if a.start != b.start and a.step == b.step == 1 else "maybe"
    if len(a) > 1 << 16 or len(b) > 1 << 16:
        return "maybe"
    pairs = list(zip(a, b))
    if all(x == y for x, y in pairs):
        return "eq"
    return "ne" if all(x != y for x, y in pairs) else "maybe"


def _int_cmp(x, y, equal: frozenset, differ: frozenset) -> str:
    """ "ne" if the integers differ for every pair of iterations (loops in ``equal`` at
    the same iteration on both sides, those in ``differ`` at different ones, any other
    independent), "eq" if they are equal for all, else "maybe"."""
    if x is None or y is None or x[0] not in ("c", "it") or y[0] not in ("c", "it"):
        return "maybe"
    if x[0] == "c" and y[0] == "c":
        return "eq" if x[1] == y[1] else "ne"
    if x[0] == "c" or y[0] == "c":
        c, it = (x, y) if x[0] == "c" else (y, x)
        return "maybe" if _seq_in(c[1], it[2]) else "ne"
    (_, s1, q1), (_, s2, q2) = x, y
    if s1 == s2 and s1 in equal:
        return _elementwise(q1, q2)
    if s1 == s2 and s1 in differ and q1 == q2 and _distinct_entries(q1):
        return "ne"
    return "ne" if _disjoint(q1, q2) else "maybe"


def _paths_differ(p1: tuple, p2: tuple, equal, differ) -> bool:
    """True if two derivation paths from one root give different keys."""
    i = 0
    while True:
        if i == len(p1) or i == len(p2):
            rest = p1[i:] or p2[i:]
            # A key and a key derived from it differ (an advance may be empty: at t=0).
            return any(step[0] == "d" for step in rest)
        a, b = p1[i], p2[i]
        if a[0] == "d" and b[0] == "d":
            if _int_cmp(a[1], b[1], equal, differ) == "ne":
                return True
            i += 1  # equal, or perhaps equal: the rest must tell them apart
            continue
        if a[0] == b[0] == "adv" and a[1:] == b[1:]:
            s, steps = a[1], a[2]
            if s in equal:
                i += 1
                continue
            if s in differ:
                return _advanced_differ(steps, p1[i + 1 :], p2[i + 1 :], equal, differ)
        return False


def _advanced_differ(steps: tuple, r1: tuple, r2: tuple, equal, differ) -> bool:
    """``steps^t r1`` against ``steps^t' r2`` for t != t'."""

    def strip(r):
        j = 0
        while len(r) >= len(steps) and r[: len(steps)] == steps:
            r, j = r[len(steps) :], j + 1
        return j, r

    (j1, r1), (j2, r2) = strip(r1), strip(r2)
    for r in (r1, r2):
        if r and not (r[0][0] == "d" and _int_cmp(r[0][1], steps[0][1], equal, differ) == "ne"):
            return False
    return j1 == j2 or _paths_differ(r1, r2, equal, differ)


def _keys_differ(k1: tuple, k2: tuple, equal, differ) -> bool:
    (_, r1, p1), (_, r2, p2) = k1, k2
    if r1 != r2 and r1[0] == "const" and r2[0] == "const":
        return True
    if r1 == r2 and r1[0] == "member" and r1[1] in differ:
        return True  # per-member keys of different members (the caller's)
    return _paths_differ(p1, p2, equal, differ)


class _Keys:
    def __init__(self, module: Module):
        self.module = module
        self.env: dict[Value, tuple] = {}
        self.releases: list[_Release] = []
        # A loop's carried key after its last iteration: ("fin", s, steps) ends its
        # path. Kept apart from env, for main's results only (privacy/C7): a release
        # after the loop still finds no key it can follow, as before.
        self.final: dict[Value, tuple] = {}
        self.results: list = []
        # Every other op that reads a key fcir follows (random_bits, arithmetic on key
        # data, ...): (op, path, term), for privacy/C7.
        self.uses: list[tuple[Op, tuple, tuple]] = []

    def run(self) -> list[_Release]:
        body = self.module.main.body
        for k, v in enumerate(body.params):
            self.env[v] = ("key", ("arg", k), ())
        got = self.region(body, (), (), True)
        self.results = [
            a if a is not None else self.final.get(v) for a, v in zip(got, body.results)
        ]
        return self.releases

    def get(self, v):
        return self.env.get(v)

    def region(self, region: Region, path: tuple, frames: tuple, record: bool) -> list:
        for i, op in enumerate(region.ops):
            self.op(op, (*path, i), frames, record)
        return [self.get(v) for v in region.results]

    def set(self, values, abstract) -> None:
        for v, a in zip(values, abstract):
            if a is None:
                self.env.pop(v, None)
            else:
                self.env[v] = a

    def op(self, op: Op, path, frames, record) -> None:
        name = op.name
        ins = [self.get(v) for v in op.operands]
        if name in _CENTRAL_DP or name in _DDP:
            if record:
                self.releases.append(_Release(op, path, _as_key(ins[-1]), frames))
            outs = [None] * len(op.results)
        elif op_class(op) is Broadcast:
            outs = ins[:1]
        elif op_class(op) is Map:
            outs = self.fed_map(op, ins, path, frames, record)
        elif name == "jax.scan":
            outs = self.loop(op, ins, path, frames, record, scan=True)
        elif name == "jax.while":
            outs = self.loop(op, ins, path, frames, record, scan=False)
        elif name == "jax.cond":
            outs = self.cond(op, ins, path, frames, record)
        elif name == "jax.unstack":  # JAX 0.12's `k1, k2 = split(key)`; 0.10 slices
            outs = _unstack(op, ins[0] if ins else None)
        elif name in _CALL_OPS and len(op.regions) == 1:
            sub = op.regions[0]
            self.set(sub.params, ins)
            outs = self.region(sub, (*path, 0), frames, record)
        else:
            for r, sub in enumerate(op.regions):  # an op that is not modelled: no keys
                self.region(sub, (*path, r), frames, record)
            try:
                first = _local(op, ins)
            except (KeyError, TypeError, ValueError, IndexError, AttributeError):
                first = None  # attributes it cannot read: nothing known of the result
            if name not in _DERIVE:
                self.uses.extend((op, path, a) for a in ins if a is not None and a[0] in _KEYS)
            outs = [first] + [None] * (len(op.results) - 1)
        self.set(op.results, outs)

    def fed_map(self, op, ins, path, frames, record):
        sub = op.regions[0]
        params = []
        for v, a in zip(op.operands, ins):
            t = v.type
            if a is not None and a[0] == "key" and not (isinstance(t, PlacedType) and t.all_equal):
                a = ("key", ("member", id(op), a[1]), a[2])  # one key per member
            params.append(a)
        self.set(sub.params, params)
        got = self.region(sub, (*path, 0), (*frames, ("map", id(op))), record)
        return [_lift(a, id(op)) for a in got]

    def cond(self, op, ins, path, frames, record):
        outs = None
        for b, bind in enumerate(cf.bindings_of(op) or []):
            sub = op.regions[bind.region]
            self.set(sub.params, [ins[j] for j, _ in bind.params])
            got = self.region(sub, (*path, bind.region), (*frames, ("cond", id(op), b)), record)
            outs = got if outs is None else [x if x == y else None for x, y in zip(outs, got)]
        return outs or [None] * len(op.results)

    def loop(self, op, ins, path, frames, record, scan: bool):
        binds = cf.bindings_of(op)
        if binds is None:
            for r, sub in enumerate(op.regions):
                self.region(sub, (*path, r), frames, record)
            return [None] * len(op.results)
        bind = binds[-1]  # the body (a while loop's condition draws no noise)
        sub = op.regions[bind.region]
        s = id(op)
        length = int(op.attrs.get("length", 1)) if scan else _BIG
        reverse = bool(op.attrs.get("reverse", False)) if scan else False
        carried = {k: j for j, (kind, k) in enumerate(bind.results) if kind == "carry"}

        def params(resolved):
            out = []
            for k, (j, sliced) in enumerate(bind.params):
                if sliced:
                    out.append(_slice(ins[j], s, length, reverse))
                elif k in carried:
                    out.append(resolved.get(k))
                else:
                    out.append(ins[j])
            return out

        # First pass: each carry a placeholder, to see how the body derives it.
        placeholders = {}
        for k in carried:
            init = ins[bind.params[k][0]]
            if init is not None and init[0] == "key":
                placeholders[k] = ("key", ("carry", s, k), ())
            elif init is not None and init[0] == "c":
                placeholders[k] = ("sym", s, k, 0)
        self.set(sub.params, params(placeholders))
        yielded = self.region(sub, (*path, bind.region), (), False)
        resolved = {}
        for k, j in carried.items():
            init, y = ins[bind.params[k][0]], yielded[j]
            resolved[k] = got = _resolve_carry(init, y, s, k, length)
            if got is not None and got[0] == "key" and j < len(op.results):
                last = got[2][-1] if len(got[2]) > len(init[2]) else None
                fin = got if last is None else ("key", got[1], (*init[2], ("fin", *last[1:])))
                self.final[op.results[j]] = fin
        self.set(sub.params, params(resolved))
        frame = (*frames, ("loop", s))
        self.region(sub, (*path, bind.region), frame, record)
        for r, other in enumerate(op.regions):
            if r != bind.region:
                self.set(other.params, [None] * len(other.params))
                self.region(other, (*path, r), frame, record)
        return [None] * len(op.results)


def _lift(a, m):
    """A ``fed.map`` result from what its region yields: the members' keys derived from
    their own keys of an operand (root ``("member", m, R)``) make the per-member array
    of ``R`` with the same steps; anything else is not followed out of the map."""
    if a is not None and a[0] == "key" and a[1][0] == "member" and a[1][1] == m:
        return ("key", a[1][2], a[2])
    return None


def _as_key(a):
    if a is None:
        return None
    return a if a[0] == "key" else None


def _resolve_carry(init, y, s, k, length):
    if init is None or y is None:
        return None
    if init[0] == "key" and y[0] == "key" and y[1] == ("carry", s, k):
        steps = y[2]
        if not steps:
            return init  # carried unchanged
        if all(st[0] == "d" and st[1] is not None and st[1][0] == "c" for st in steps):
            return ("key", init[1], (*init[2], ("adv", s, steps)))
        return None
    if init[0] == "c" and y == ("sym", s, k, 0):
        return init
    if init[0] == "c" and y == ("sym", s, k, 1) and isinstance(init[1], int):
        return ("it", s, range(init[1], init[1] + length))
    return None


def _slice(a, s, length, reverse):
    """The per-iteration slice of a scan's ``xs`` operand."""
    if a is None:
        return None
    if a[0] == "vec" and len(a[1]) == length:
        seq = a[1][::-1] if reverse else a[1]
        return ("it", s, seq)
    if a[0] == "keys" and a[3] == length:
        seq = range(length)[::-1] if reverse else range(length)
        return ("key", a[1], (*a[2], ("d", ("it", s, seq))))
    return None


def _const_int(tensor):
    try:
        arr = np.asarray(tensor.numpy())
    except Exception:
        return None
    if arr.dtype.kind not in "iu":
        return None
    if arr.ndim == 0:
        return ("c", int(arr))
    if arr.ndim == 1 and arr.size <= 1 << 16:
        return ("vec", tuple(int(x) for x in arr))
    return None


def _shape(v):
    t = v.type
    while isinstance(t, PlacedType):
        t = t.member
    return tuple(getattr(t, "shape", ()) or ())


def _local(op: Op, ins: list):
    """The abstract value of a local op's (first) result."""
    name, attrs = op.name, op.attrs
    a = ins[0] if ins else None
    if name == "fcir.constant":
        value = _const_int(attrs.get("value"))
        if value is None and attrs.get("value") is not None:
            arr = np.asarray(attrs["value"].numpy())
            if arr.dtype == np.uint32 and arr.shape == (2,):  # a raw key
                return ("key", ("const", tuple(int(x) for x in arr)), ())
        return value
    if name in _PASS:
        return a
    if name == "jax.iota":
        shape = tuple(attrs.get("shape", ()))
        return ("vec", range(shape[0])) if len(shape) == 1 else None
    if name in ("jax.add", "jax.sub") and len(ins) == 2:
        return _arith(name, ins[0], ins[1])
    if name == "jax.random_seed":
        if a is not None and a[0] == "c":
            return ("key", ("const", "seed", a[1]), ())
        if a is not None and a[0] == "key" and not a[2]:
            return a  # random.key(seed argument): the argument is the root
        return None
    if name == "jax.random_fold_in" and a is not None and a[0] == "key":
        return ("key", a[1], (*a[2], ("d", _int(ins[1]))))
    if name == "jax.random_split" and a is not None and a[0] == "key":
        shape = tuple(attrs.get("shape", ()))
        return ("keys", a[1], a[2], shape[0]) if len(shape) == 1 else None
    if name == "jax.slice" and a is not None and a[0] in ("keys", "vec"):
        start, limit = tuple(attrs.get("start_indices", ())), tuple(attrs.get("limit_indices", ()))
        strides = attrs.get("strides")
        if len(start) == 1 and limit[0] - start[0] == 1 and strides in (None, (1,)):
            return ("one", a, ("c", start[0]))
        return None
    if name == "jax.dynamic_slice" and a is not None and a[0] in ("keys", "vec"):
        if tuple(attrs.get("slice_sizes", ())) == (1,) and len(ins) == 2:
            return ("one", a, _int(ins[1]))
        return None
    if name in ("jax.squeeze", "jax.reshape") and a is not None and a[0] == "one":
        if _shape(op.results[0]) != ():
            return None
        inner, index = a[1], a[2]
        if inner[0] == "keys":
            return ("key", inner[1], (*inner[2], ("d", index)))
        if index is not None and index[0] == "c" and 0 <= index[1] < len(inner[1]):
            return ("c", inner[1][index[1]])
        return None
    return None


def _unstack(op: Op, a) -> list:
    """Each result of unstacking ``a`` along axis 0: what slice + squeeze of entry i give."""
    n = len(op.results)
    if a is None or op.attrs.get("axis", 0) != 0 or any(_shape(r) != () for r in op.results):
        return [None] * n
    if a[0] == "keys":
        return [("key", a[1], (*a[2], ("d", ("c", i)))) for i in range(n)]
    if a[0] == "vec" and len(a[1]) == n:
        return [("c", a[1][i]) for i in range(n)]
    return [None] * n


def _int(a):
    return a if a is not None and a[0] in ("c", "it") else None


def _arith(name, x, y):
    if x is None or y is None:
        return None
    sign = 1 if name == "jax.add" else -1
    if y[0] == "c" and isinstance(y[1], int):
        c = sign * y[1]
        if x[0] == "c":
            return ("c", x[1] + c)
        if x[0] == "vec":
            return ("vec", _shift(x[1], c))
        if x[0] == "it":
            return ("it", x[1], _shift(x[2], c))
        if x[0] == "sym":
            return ("sym", x[1], x[2], x[3] + c)
        return None
    if name == "jax.add" and x[0] == "c":
        return _arith(name, y, x)
    return None


def _shift(seq, c):
    if isinstance(seq, range):
        return range(seq.start + c, seq.stop + c, seq.step)
    return tuple(v + c for v in seq)


def _vars(frames) -> list:
    return [f[1] for f in frames if f[0] in ("loop", "map")]


def _common(f1: tuple, f2: tuple) -> tuple[tuple, bool]:
    """The frames enclosing both releases, and whether they part in two branches of
    one cond (they never run in one iteration of the common loops)."""
    n = 0
    while n < len(f1) and n < len(f2) and f1[n] == f2[n]:
        n += 1
    exclusive = (
        n < len(f1) and n < len(f2) and f1[n][0] == f2[n][0] == "cond" and f1[n][1] == f2[n][1]
    )
    return f1[:n], exclusive


def _where(rel: _Release) -> str:
    return f"the {rel.op.name} at op {'/'.join(map(str, rel.path))}"


def problems(module: Module, client_derived: set[Value] | None = None) -> list[KeyProblem]:
    """Every DP release whose noise is not provably distinct from every other's
    (``privacy/C4``), and, given ``client_derived`` (the values derived from client
    data), every distributed release whose keys are not (``privacy/C5``)."""
    keys = _Keys(module)
    rels = keys.run()
    found: dict[int, KeyProblem] = {}

    def report(rel: _Release, message: str, full: str | None = None) -> None:
        if full is None:
            full = f"privacy/C4: {rel.op.name} {message}"
        code = full.split(":", 1)[0]
        found.setdefault(id(rel.op), KeyProblem(full, rel.path, rel.op, code))

    usable = []
    for rel in rels:
        ddp = rel.op.name in _DDP
        if ddp and client_derived is not None and rel.op.operands[-1] not in client_derived:
            report(rel, "", _MSG_CLIENT.format(op=rel.op.name))
        elif rel.key is None:
            report(
                rel,
                "draws its noise from a key whose origin fcir cannot follow, so it "
                "cannot prove that no other release draws the same noise: derive the key "
                "from a key argument with jax.random.fold_in / jax.random.split",
            )
        elif rel.key[1][0] == "const":
            report(
                rel,
                "draws its noise from a key that is a constant of the program, so "
                "every run (every round) adds the same noise: pass the key as an argument "
                "(a fresh one per round)",
            )
        else:
            usable.append(rel)
    for a, b in itertools.combinations_with_replacement(usable, 2):
        if id(a.op) in found or id(b.op) in found:
            continue
        ddp = b.op.name in _DDP
        if (a.op.name in _DDP) != ddp:
            continue  # a server key and the clients' keys: compared within each kind
        common, exclusive = _common(a.frames, b.frames)
        shared = _vars(common)
        same = a is b
        for n in range(len(shared) + 1):
            for differ in itertools.combinations(shared, n):
                if same and not differ:
                    continue  # one release against itself
                if exclusive and not differ:
                    continue
                differ = frozenset(differ)
                equal = frozenset(shared) - differ
                if _keys_differ(a.key, b.key, equal, differ):
                    continue
                maps = {f[1] for f in common if f[0] == "map"}
                if ddp and not (same and differ & maps):
                    where = "every iteration of its loop" if same else _where(a)
                    report(b, "", _MSG_REUSE.format(op=b.op.name, where=where))
                elif same and differ & maps:
                    report(
                        b,
                        "draws the same noise for every member of the fed.map around it "
                        "(its key is the same for each, e.g. broadcast), but each member's "
                        "release counts: pass the members distinct keys (client-placed), or "
                        "move the DP op out of the map",
                    )
                elif same:
                    report(
                        b,
                        "draws the same noise in every iteration of the loop around it "
                        "(its key does not change from one iteration to the next), but each "
                        "iteration counts as an independent release: derive the key per "
                        "iteration, e.g. jax.random.fold_in(key, i) with the loop index, or "
                        "scan over jax.random.split(key, length)",
                    )
                else:
                    report(
                        b,
                        f"may draw the same noise as {a.op.name} (op "
                        f"{'/'.join(map(str, a.path))}): their keys are not provably "
                        "different, but they count as independent releases: derive one key "
                        "per release from one key argument, e.g. jax.random.fold_in(key, 0) "
                        "and jax.random.fold_in(key, 1)",
                    )
                break
            else:
                continue
            break
    return list(found.values()) + _returned(module, keys, rels)


_MSG_RETURNED = (
    "privacy/C7: main returns (result {j}) {what} the key of the {op} at op {where}, "
    "so a caller that feeds it back as the next round's key repeats that release's "
    "noise, and whoever reads the results can recompute it: return only a key split "
    "off before the release, e.g. key, sub = jax.random.split(key), the DP op on sub, "
    "return key"
)


def _is_keyish(t) -> bool:
    """A PRNG key type (any shape), or raw uint32 key words (last axis 2)."""
    while isinstance(t, PlacedType):
        t = t.member
    dtype, shape = getattr(t, "dtype", ""), tuple(getattr(t, "shape", ()) or ())
    return str(dtype).startswith("key<") or (dtype == "u32" and shape[-1:] == (2,))


def _path_of(a):
    """A returned key's (root, path): a split array is its parent's path and one more
    step with an integer of the array's range."""
    if a is None:
        return None
    if a[0] == "key":
        return a[1], a[2]
    if a[0] == "keys":
        return a[1], (*a[2], ("d", ("vec", range(a[3]))))
    if a[0] == "one" and a[1][0] == "keys":
        return a[1][1], (*a[1][2], ("d", a[2]))
    return None


def _arg_root(root):
    """The argument a per-member key comes from (a fed.map's member of an operand)."""
    while root[0] == "member":
        root = root[2]
    return root


def _diverge(p: tuple, q: tuple) -> bool:
    """True if two derivation paths from one root provably part: at some step both
    fold in integers that differ (whatever iterations), so neither key is the other
    nor derived from it. A release's loop-advanced key (``adv``) against a loop's final
    carry (``fin``, one or more advances later) parts if what the release derives
    after its advances parts from one advance."""
    none = frozenset()
    for i, (a, b) in enumerate(zip(p, q)):
        if a[0] == "d" and b[0] == "d":
            if _int_cmp(a[1], b[1], none, none) == "ne":
                return True
            continue
        if {a[0], b[0]} == {"adv", "fin"} and a[1:] == b[1:]:
            rest = q[i + 1 :] if b[0] == "adv" else p[i + 1 :]
            return _diverge(a[2], rest)
        return False
    return False


def _returned(module: Module, keys: _Keys, rels: list[_Release]) -> list[KeyProblem]:
    """``privacy/C7``: every result of main that is, derives from or derives to the key
    of a DP release (or a key fcir cannot follow that depends on a release's key
    argument). The noise of a release with key ``k`` is drawn from keys derived from
    ``k``: returning ``k`` or one of those publishes the noise, and returning an
    ancestor (the key argument itself, unchanged) lets the caller feed it back and draw
    the same noise next round. A returned key that parts from every release key at
    some step (``split(key)[0]`` when the release used ``split(key)[1]``) is safe."""
    body = module.main.body
    deps = _dependencies(module)
    found = []
    for j, (v, a) in enumerate(zip(body.results, keys.results)):
        if not _is_keyish(v.type):
            continue
        term = _path_of(a)
        for rel in rels:
            if rel.key is None or rel.key[1][0] != "arg":
                continue  # reported already (privacy/C4 / C5)
            root = rel.key[1]
            where = "/".join(map(str, rel.path))
            if term is None:
                if root[1] in deps.get(v, frozenset()):
                    what = "a key fcir cannot follow, derived from"
                    found.append((j, what, rel, where))
                    break
                continue
            if term[0] == root and not _diverge(term[1], rel.key[2]):
                found.append((j, "a key not provably apart from", rel, where))
                break
    out = [
        KeyProblem(
            _MSG_RETURNED.format(j=j, what=what, op=rel.op.name, where=where),
            rel.path,
            rel.op,
            "privacy/C7",
        )
        for j, what, rel, where in found
    ]
    for use, path, a in keys.uses:
        term = _path_of(a)
        if term is None:
            continue
        for rel in rels:
            if rel.key is None or rel.key[1][0] != "arg":
                continue
            if _arg_root(term[0]) == rel.key[1] and not _diverge(term[1], rel.key[2]):
                out.append(
                    KeyProblem(
                        _MSG_USED.format(
                            use=use.name,
                            at="/".join(map(str, path)),
                            op=rel.op.name,
                            where="/".join(map(str, rel.path)),
                        ),
                        path,
                        use,
                        "privacy/C7",
                    )
                )
                break
    return out


_MSG_USED = (
    "privacy/C7: {use} (op {at}) reads a key not provably apart from the key of the "
    "{op} at op {where}: the noise is drawn from that key, so whatever {use} computes "
    "can repeat or cancel it (e.g. the release minus the same draw is the exact sum); "
    "split the key first and give the DP op a key nothing else reads, e.g. k_dp, k_other "
    "= jax.random.split(key)"
)


def _dependencies(module: Module) -> dict[Value, frozenset[int]]:
    """The arguments of ``main`` (indices) each of its top-level values may depend on:
    an op's results on all its operands (regions are closed, values enter by
    operands). An over-approximation."""
    body = module.main.body
    deps: dict[Value, frozenset[int]] = {v: frozenset({i}) for i, v in enumerate(body.params)}
    for op in body.ops:
        ins = frozenset().union(*(deps.get(v, frozenset()) for v in op.operands))
        for v in op.results:
            deps[v] = ins
    return deps


def key_arguments(module: Module) -> list[tuple[Op, frozenset[int]]]:
    """Each DP release (``fed.dp_*`` and ``fed.ddp_*``, in program order) with the
    arguments of ``main`` (indices) its key may depend on.

    A conservative dataflow: an op's results depend on all its operands (regions are
    closed, values enter by operands), and a release nested in a region takes what the
    enclosing top-level op's operands depend on. It over-approximates, so a key that
    depends on none of the arguments that change from one run to the next (a Flower
    app's state-fed server inputs) is the same every run."""
    body = module.main.body
    deps = _dependencies(module)
    found = []

    def nested(region: Region, ins: frozenset[int]) -> None:
        for op in region.ops:
            if op.name in _CENTRAL_DP or op.name in _DDP:
                found.append((op, ins))
            for sub in op.regions:
                nested(sub, ins)

    for op in body.ops:
        ins = frozenset().union(*(deps.get(v, frozenset()) for v in op.operands))
        if op.name in _CENTRAL_DP or op.name in _DDP:
            found.append((op, deps.get(op.operands[-1], frozenset())))
        for sub in op.regions:
            nested(sub, ins)
    return found


# -- run time: the members' keys a backend is given ----------------------------------


def duplicate_members(keys) -> tuple[int, int, int] | None:
    """``(i, j, distinct)`` for the first two members ``i < j`` whose keys are equal and
    the number of distinct keys, or None when all differ. None too where the keys cannot
    be read cheaply: traced (inside ``jax.jit``/``grad``) or not all on this process.

    ``keys`` holds one key per member along axis 0: typed keys or their raw key data.
    """
    import jax

    if isinstance(keys, jax.core.Tracer) or not isinstance(keys, (jax.Array, np.ndarray)):
        return None  # abstract (ShapeDtypeStruct) or not an array: other checks speak
    if not keys.shape:
        return None
    if isinstance(keys, jax.Array):
        if not keys.is_fully_addressable:
            return None
        if jax.dtypes.issubdtype(keys.dtype, jax.dtypes.prng_key):
            keys = jax.random.key_data(keys)
    data = np.asarray(keys)
    rows = data.reshape(data.shape[0], -1)
    distinct, first, inverse = np.unique(rows, axis=0, return_index=True, return_inverse=True)
    if len(distinct) == len(rows):
        return None
    inverse = inverse.reshape(-1)
    repeated = np.flatnonzero(first[inverse] != np.arange(len(rows)))
    j = int(repeated[0])  # the first member whose key an earlier member holds
    return int(first[inverse[j]]), j, len(distinct)


def check_member_keys(op, keys) -> None:
    """Refuses the keys operand of a ``fed.ddp_*`` op ``op`` that gives two members one
    key (``jax.numpy.tile(key, n)``): they would draw the same rounding and noise shares,
    so the sum carries less noise than the op states. Raises InterpreterError citing the
    op's constraint C3; a no-op for keys it cannot read cheaply (``duplicate_members``)."""
    from fcir.errors import InterpreterError
    from fcir.fed import FedOp

    found = duplicate_members(keys)
    if found is None:
        return
    i, j, distinct = found
    n = np.shape(keys)[0]
    placement = getattr(op.operands[-1].type, "placement", "the members")
    what = (
        f"all {n} keys are equal"
        if distinct == 1
        else f"members {i} and {j} have the same key ({distinct} distinct keys for {n} members)"
    )
    detail = (
        f"{what} at run time: every member of '{placement}' needs its own key, or they "
        "draw the same rounding and noise shares; pass jax.random.split(key, n) as the "
        "keys, not one key tiled or repeated"
    )
    raise InterpreterError(FedOp.registry[op.name].message("C3", detail))


def ddp_key_arguments(module: Module) -> tuple[tuple[int, Op], ...]:
    """``(argument index, op)`` for each top-level ``fed.ddp_*`` op of ``main`` whose keys
    operand is an argument of ``main``: the keys a compiled backend can check on the host
    before it runs. (Keys a ``fed.map`` derives are computed inside the program.)"""
    body = module.main.body
    index = {v: i for i, v in enumerate(body.params)}
    return tuple(
        (index[op.operands[-1]], op)
        for op in body.ops
        if op.name in _DDP and op.operands[-1] in index
    )
