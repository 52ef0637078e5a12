"""Canonical forms of captured IR that do not depend on the JAX that traced it.

Capture (``fcir.capture``) applies :func:`canonicalize` to every module it converts, so
that a program prints the same text under every supported JAX. What JAX decides itself
and changes between versions is normalized here, in fcir's own IR; what can only be
decided while tracing is pinned there (``fcir.jaxcompat.ad_rules``: derivative rules;
``fcir.jaxcompat.canonical_eqns``: literals of loop bodies).

- Sums of cotangents. JAX's transposition accumulates the cotangents of a value with
  ``add_any`` in an order that changed between versions (JAX 0.10.2 adds the first two
  contributions as soon as both exist, JAX 0.12 adds each when the value's last use is
  transposed). A tree of ``add_any`` ops whose inner results are used once, by the next
  ``add_any``, is one sum: the canonical form adds its terms left to right in the order
  they are defined, right after the last of them is defined.
- Stacked results. A ``jax.scan`` (its ys) or a ``fed.map`` with two results for one
  value its region yields (JAX 0.10.2 saves some residuals of a gradient twice) has one:
  the later ones are dropped and their uses read the first.
"""

from __future__ import annotations

from fcir.ir import Module, Op, Region, Value

ADD_ANY = "jax.add_any"


def canonicalize(module: Module) -> Module:
    """``module`` in canonical form (changed in place; also returned)."""
    for func in module.funcs:
        # Merging a fed.map's parameters can make a scan inside it receive one value
        # twice, and so on: repeat until nothing merges.
        while _merge_duplicates(func.body):
            pass
        _canonical_sums(func.body)
    return module


def _merge_duplicates(region: Region) -> bool:
    changed = False
    for op in region.ops:
        for sub in op.regions:
            changed |= _merge_duplicates(sub)
    changed |= _one_result_per_stacked_value(region)
    changed |= _one_parameter_per_operand(region)
    return changed


def _canonical_sums(region: Region) -> None:
    for op in region.ops:
        for sub in op.regions:
            _canonical_sums(sub)
    _sums_in_definition_order(region)


def _stacked_from(op: Op) -> int | None:
    """Index of the first result of ``op`` that stacks (scan) or collects (fed.map) a
    value its region yields, one result per yield; None for other ops."""
    if len(op.regions) != 1 or len(op.regions[0].results) != len(op.results):
        return None
    if op.name == "fed.map":
        return 0
    if op.name == "jax.scan" and isinstance(op.attrs.get("num_carry"), int):
        return op.attrs["num_carry"]
    return None


def _mergeable_operands(op: Op) -> list[range]:
    """Groups of operand indices of ``op`` whose region parameters may be merged when they
    receive the same value: a fed.map's operands; a scan's consts, and its xs."""
    if len(op.regions) != 1 or len(op.regions[0].params) != len(op.operands):
        return []
    if op.name == "fed.map":
        return [range(len(op.operands))]
    nc, nk = op.attrs.get("num_consts"), op.attrs.get("num_carry")
    if op.name == "jax.scan" and isinstance(nc, int) and isinstance(nk, int):
        return [range(nc), range(nc + nk, len(op.operands))]
    return []


def _replace_uses(region: Region, replaced: dict[Value, Value]) -> None:
    for op in region.ops:
        op.operands = [replaced.get(v, v) for v in op.operands]
    region.results = [replaced.get(v, v) for v in region.results]


def _one_parameter_per_operand(region: Region) -> bool:
    """A value passed twice to a fed.map (or twice as a scan const, or twice as xs) is
    one region parameter (JAX 0.10.2 passes some residuals of a gradient twice)."""
    changed = False
    for op in region.ops:
        groups = _mergeable_operands(op)
        if not groups:
            continue
        body = op.regions[0]
        replaced: dict[Value, Value] = {}
        drop: set[int] = set()
        for group in groups:
            first: dict[Value, int] = {}
            for i in group:
                v = op.operands[i]
                if v in first and body.params[i].type == body.params[first[v]].type:
                    replaced[body.params[i]] = body.params[first[v]]
                    drop.add(i)
                else:
                    first.setdefault(v, i)
        if not drop:
            continue
        _replace_uses(body, replaced)
        keep = [i for i in range(len(op.operands)) if i not in drop]
        if op.name == "jax.scan":
            nc = op.attrs["num_consts"]
            op.attrs["num_consts"] = nc - sum(1 for i in drop if i < nc)
        if isinstance(op.attrs.get("linear"), (tuple, list)):
            op.attrs["linear"] = type(op.attrs["linear"])(op.attrs["linear"][i] for i in keep)
        op.operands = [op.operands[i] for i in keep]
        body.params = [body.params[i] for i in keep]
        changed = True
    return changed


def _one_result_per_stacked_value(region: Region) -> bool:
    replaced: dict[Value, Value] = {}
    for op in region.ops:
        op.operands = [replaced.get(v, v) for v in op.operands]
        first = _stacked_from(op)
        if first is None:
            continue
        body = op.regions[0]
        seen: dict[Value, int] = {}
        keep = list(range(first))
        for i in range(first, len(op.results)):
            y = body.results[i]
            if y in seen:
                replaced[op.results[i]] = op.results[seen[y]]
            else:
                seen[y] = i
                keep.append(i)
        if len(keep) < len(op.results):
            op.results = [op.results[i] for i in keep]
            body.results = [body.results[i] for i in keep]
    region.results = [replaced.get(v, v) for v in region.results]
    return bool(replaced)


def _sums_in_definition_order(region: Region) -> None:
    users: dict[Value, list] = {}
    for op in region.ops:
        for v in op.operands:
            users.setdefault(v, []).append(op)
    for v in region.results:
        users.setdefault(v, []).append(None)
    producer = {v: op for op in region.ops for v in op.results}

    def is_sum(op) -> bool:
        return op is not None and op.name == ADD_ANY and not op.attrs and len(op.operands) == 2

    def inner(v: Value) -> bool:  # an add_any result that only the enclosing sum reads
        read_by = users.get(v, [])
        return is_sum(producer.get(v)) and len(read_by) == 1 and is_sum(read_by[0])

    roots = [op for op in region.ops if is_sum(op) and not inner(op.results[0])]
    if not roots:
        return
    position = {v: (-1, 0, i) for i, v in enumerate(region.params)}
    for i, op in enumerate(region.ops):
        for k, v in enumerate(op.results):
            position[v] = (i, 0, k)
    removed: set[int] = set()
    chains: list[tuple[tuple, list[Op]]] = []  # (where, the sum's ops)
    for root in roots:  # program order: a sum that is a term of another comes first
        terms: list[Value] = []
        members: list[Op] = [root]
        pending = list(root.operands)
        while pending:  # no recursion: a sum may have thousands of terms
            v = pending.pop()
            if inner(v):
                members.append(producer[v])
                pending.extend(producer[v].operands)
            else:
                terms.append(v)
        # Stable: the same value twice keeps its place in the sum.
        terms.sort(key=lambda v: position[v])
        chain: list[Op] = []
        acc = terms[0]
        for k, t in enumerate(terms[1:], 1):
            out = root.results[0] if k == len(terms) - 1 else Value(root.results[0].type)
            chain.append(Op(ADD_ANY, [acc, t], [out], {}, location=root.location))
            acc = out
        removed.update(id(m) for m in members)
        # Right after the last term; a sum of sums after the sums it adds.
        last = position[terms[-1]]
        where = (last[0], last[1] + 1, tuple(position[t] for t in terms))
        position[root.results[0]] = where
        chains.append((where, chain))
    chains.sort(key=lambda c: c[0])
    after: dict[int, list[Op]] = {}
    for where, chain in chains:
        after.setdefault(where[0], []).extend(chain)
    ops: list[Op] = list(after.get(-1, []))
    for i, op in enumerate(region.ops):
        if id(op) not in removed:
            ops.append(op)
        ops.extend(after.get(i, []))
    region.ops = ops
