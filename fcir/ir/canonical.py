"""Capture's canonical form: where JAX versions emit the same computation in another
layout, one layout for all.

Two rewrites, applied to every region of a freshly converted module, that change no
value (ir.md guarantee 1 holds on every JAX; tests/interpreters/xla/test_xla.py):

- **A scan's weakly typed scalar literals live in its body.** Capture names the
  constants it made from weakly typed scalar literals (a Python number, e.g. an
  optimizer's betas); one passed to a ``jax.scan`` as a leading (constant) operand
  becomes a constant at each of its uses in the body: JAX 0.12's partial evaluation
  passes such literals into the scan it keeps for the forward pass of a gradient, JAX
  0.10.2 keeps them in the body. Strongly typed ones stay operands on both (JAX passes
  those on both). An outer constant left without uses goes.
- **Each cotangent sum follows what it adds.** A ``jax.add_any`` is the sum of two
  cotangents (JAX's transposition makes it). Where JAX 0.12 transposes k ops in a row
  and only then sums their k cotangents, in reverse order (each into a cotangent made
  before them), JAX 0.10.2 sums each right after the op that made it; capture moves
  each such sum there. Only the order of independent ops changes, never an operand, so
  no sum is associated differently; every other run of sums, and every other op,
  keeps its captured place (JAX's own order: tests/interpreters/xla/test_xla.py compares the StableHLO
  text of the non-gradient programs with ``jax.jit``'s).

Both run in time linear in the module's size.
"""

from __future__ import annotations

from collections.abc import Set

from fcir.ir.nodes import Module, Op, Region, Value

__all__ = ["canonicalize"]


def canonicalize(module: Module, weak_literals: Set[Value] = frozenset()) -> Module:
    """Rewrites ``module`` in place into capture's canonical form (and returns it).
    ``weak_literals``: the scalar constants capture made from weakly typed literals."""
    for func in module.funcs:
        _region(func.body, weak_literals)
    return module


def _region(region: Region, weak: Set[Value]) -> None:
    for op in region.ops:
        for sub in op.regions:
            _region(sub, weak)
    if weak and any(op.name == "jax.scan" for op in region.ops):
        _scan_constants(region, weak)
    if any(op.name == "jax.add_any" for op in region.ops):
        _sums_after_operands(region)


# -- scalar constants of a scan ---------------------------------------------------------


def _scan_constants(region: Region, weak: Set[Value]) -> None:
    constant_of: dict[Value, Op] = {
        op.results[0]: op
        for op in region.ops
        if op.name == "fcir.constant" and op.results[0] in weak
    }
    if not constant_of:
        return
    inlined = False
    for op in region.ops:
        if op.name == "jax.scan" and _inline_scan_constants(op, constant_of):
            inlined = True
    if inlined:
        used = _uses(region)
        region.ops = [
            op
            for op in region.ops
            if not (
                op.name == "fcir.constant"
                and op.results[0] in constant_of
                and op.results[0] not in used
            )
        ]


def _inline_scan_constants(scan: Op, constant_of: dict[Value, Op]) -> bool:
    num_consts = int(scan.attrs["num_consts"])
    ref = scan.attrs.get("jaxpr")
    if ref is None or not hasattr(ref, "index"):
        return False
    body = scan.regions[ref.index]
    if len(body.params) != len(scan.operands):
        return False
    # Only a constant whose body parameter has its very type and is read directly by
    # ops of the body (not yielded, not read inside a nested region).
    direct = _direct_uses_only(body)
    moved = [
        i
        for i in range(num_consts)
        if scan.operands[i] in constant_of
        and body.params[i] in direct
        and body.params[i].type == scan.operands[i].type
    ]
    if not moved:
        return False
    values = {body.params[i]: constant_of[scan.operands[i]].attrs["value"] for i in moved}
    ops: list[Op] = []
    for op in body.ops:
        if any(o in values for o in op.operands):
            operands = []
            for o in op.operands:
                if o in values:
                    c = Value(o.type)
                    ops.append(Op("fcir.constant", [], [c], {"value": values[o]}))
                    o = c
                operands.append(o)
            op.operands = operands
        ops.append(op)
    body.ops = ops
    gone = set(moved)
    body.params = [p for i, p in enumerate(body.params) if i not in gone]
    scan.operands = [o for i, o in enumerate(scan.operands) if i not in gone]
    scan.attrs = {**scan.attrs, "num_consts": num_consts - len(moved)}
    return True


def _direct_uses_only(body: Region) -> set[Value]:
    """The body's parameters read only as operands of the body's own ops."""
    params = set(body.params)
    indirect = {v for v in body.results if v in params}
    for op in body.ops:
        for sub in op.regions:
            indirect |= _uses(sub) & params
    return params - indirect


def _uses(region: Region) -> set[Value]:
    used: set[Value] = set(region.results)
    for op in region.ops:
        used.update(op.operands)
        for sub in op.regions:
            used |= _uses(sub)
    return used


# -- cotangent sums ---------------------------------------------------------------------


def _sums_after_operands(region: Region) -> None:
    """Interleaves each run of k sums that add the results of the k ops just before the
    run in reverse order (JAX 0.12's deferred sums) into producer, sum, producer, sum
    (JAX 0.10.2's): the j-th sum of the run moves to just after the (k-1-j)-th of those
    ops. A run of any other shape, and every other op, keeps its place."""
    ops = region.ops
    out: list[Op] = []
    i, n = 0, len(ops)
    while i < n:
        if ops[i].name != "jax.add_any":
            out.append(ops[i])
            i += 1
            continue
        end = i
        while end < n and ops[end].name == "jax.add_any":
            end += 1
        k = end - i
        pairs = None
        if 2 <= k <= len(out) and all(a is b for a, b in zip(out[-k:], ops[i - k : i])):
            pairs = _deferred_sums(ops, i, k)
        if pairs is None:
            out.extend(ops[i:end])
        else:
            del out[len(out) - k :]
            for producer, total in pairs:
                out += (producer, total)
        i = end
    if len(out) == n and any(a is not b for a, b in zip(out, ops)):
        region.ops = out


def _deferred_sums(ops: list[Op], start: int, k: int) -> list[tuple[Op, Op]] | None:
    """(producer, sum) in producer order when the k sums at ``start`` add the results of
    ops[start-k:start] in reverse order, each to a value made before those ops."""
    producers = ops[start - k : start]
    made = {r for p in producers for r in p.results} | {
        r for s in ops[start : start + k] for r in s.results
    }
    pairs = []
    for j, total in enumerate(ops[start : start + k]):
        producer = producers[k - 1 - j]
        if len(producer.results) != 1 or len(total.operands) != 2:
            return None
        new = producer.results[0]
        others = [o for o in total.operands if o is not new]
        if len(others) != 1 or others[0] in made:
            return None
        pairs.append((producer, total))
    pairs.reverse()
    return pairs
