"""The key rules of the distributed DP ops, part of the privacy check of a private
program (``fcir.privacy.leaks``).

Each client's noise share is drawn from its own key, so the keys must differ between
clients and between releases; a key shared by the clients lets any one of them (or the
server, colluding) subtract the noise. Statically the check demands:

* ``privacy/C5``: the keys operand of a ``fed.ddp_*`` op is derived from client data
  (client-placed arguments such as ``jax.random.split(key, n)`` passed in, or what is
  computed from them). A value computed from server data alone, e.g. a broadcast key
  passed through a ``fed.map``, is the same at every client. (A broadcast itself, an
  all-equal type, is already ``fed.ddp_sum/C3``.)
* ``privacy/C4`` (the rule ``fcir.dp_keys`` checks for the central DP ops' keys): no
  two ``fed.ddp_*`` ops take the same keys value, and an op inside a
  ``jax.scan`` or ``jax.while`` body takes keys that change from iteration to iteration
  (derived from the carry or the scanned inputs, not only from the loop's constants).

Keys reused across calls of the program (rounds) are outside what the IR shows: pass
fresh keys each round (``fold_in`` the round number), as the examples do.
"""

from __future__ import annotations

from fcir import control_flow as cf
from fcir.fed import of_kind
from fcir.ir import Module, Op, Region, Value

__all__ = ["key_leaks"]

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


_DDP = of_kind("ddp")


def _is_ddp(op: Op) -> bool:
    return op.name in _DDP


def key_leaks(module: Module, client_derived: set[Value], leak_cls) -> list:
    """The key problems of ``module``'s ``fed.ddp_*`` ops as ``leak_cls(code, message,
    path, op)``; ``client_derived``: the values the privacy check found derived from
    client data."""
    found: list = []
    seen: dict[Value, tuple] = {}

    def walk(region: Region, path: tuple, invariant: set[Value] | None) -> None:
        for i, op in enumerate(region.ops):
            p = (*path, i)
            if _is_ddp(op):
                keys = op.operands[-1]
                if keys not in client_derived:
                    found.append(leak_cls("privacy/C5", _MSG_CLIENT.format(op=op.name), p, op))
                elif keys in seen:
                    where = f"the {seen[keys][1]} at op {'/'.join(map(str, seen[keys][0]))}"
                    found.append(
                        leak_cls("privacy/C4", _MSG_REUSE.format(op=op.name, where=where), p, op)
                    )
                elif invariant is not None and keys in invariant:
                    where = "every iteration of its loop"
                    found.append(
                        leak_cls("privacy/C4", _MSG_REUSE.format(op=op.name, where=where), p, op)
                    )
                seen.setdefault(keys, (p, op.name))
            loop_body = _loop_body_invariants(op)
            for r, sub in enumerate(op.regions):
                if r in loop_body:
                    inner = _invariant_values(sub, loop_body[r])
                elif invariant is not None and op.name == "fed.map":
                    inner = None  # per-client keys inside a map vary by member anyway
                else:
                    inner = _carry_in(invariant, op, sub)
                walk(sub, (*p, r), inner)

    walk(module.main.body, (), None)
    return found


def _loop_body_invariants(op: Op) -> dict[int, list[bool]]:
    """region index -> which of its parameters are loop constants, for loop bodies."""
    name = op.name.removeprefix("jax.")
    if name not in ("scan", "while"):
        return {}
    try:
        binds = cf.bindings(name, op.attrs, len(op.operands), len(op.results), len(op.regions))
    except cf.BindingError:
        return {}
    out = {}
    for b in binds:
        kinds = [k for k, _ in b.results] if b.results else []
        if "predicate" in kinds:
            continue  # a while loop's condition releases nothing
        consts = _int_attr(op, "num_consts" if name == "scan" else "body_nconsts")
        out[b.region] = [k < consts for k in range(len(b.params))]
    return out


def _int_attr(op: Op, key: str) -> int:
    try:
        return int(op.attrs.get(key, 0))
    except (TypeError, ValueError):
        return 0


def _carry_in(invariant, op: Op, sub: Region):
    """Inside a non-loop region (a cond branch, a call) of a loop body: a parameter is
    invariant when the operand it receives is (positionally, the last operands)."""
    if invariant is None:
        return None
    n = len(op.operands)
    params = len(sub.params)
    if params > n:
        return set()
    return {v for v, o in zip(sub.params, op.operands[n - params :]) if o in invariant}


def _invariant_values(region: Region, const_params: list[bool]) -> set[Value]:
    """Values of a loop body that are the same in every iteration: its constant
    parameters and what is computed from them alone (and from literals)."""
    inv = {v for v, c in zip(region.params, const_params) if c}
    for op in region.ops:
        if all(v in inv for v in op.operands):
            inv.update(op.results)
    return inv
