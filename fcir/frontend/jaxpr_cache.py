"""The jaxpr a Module was converted from, kept while the Module is unchanged.

``fcir.capture`` traces the program once; converting the jaxpr to the IR loses
nothing a backend needs, but rebuilding a jaxpr from the IR means tracing every op
again (``fcir.Interpreter`` binds each one). A backend that only needs the same
jaxpr (``fcir.interpreters.xla`` on one device) asks :func:`captured_jaxpr` for the
original instead, like ``jax.jit`` reuses the trace of ``jax.make_jaxpr`` for the same
function. In-process only: nothing here is serialized.

"Unchanged" is checked, not assumed: the Module remembers every object its ``main``
is made of (ops, their names, operands, results, types, attribute values, regions,
placements), and the jaxpr is returned only while each is still the very same object.
An edit in place (a new type on a value, an op appended, an attribute replaced) makes
it return None, and the backend traces the IR as it is.

The same record says whether capture's ``fcir.check`` passed on the module
(:func:`checked`): ``xla.compile`` then skips checking it a second time, while the
module (its funcs, names and ``private`` flag included) is unchanged.
"""

from __future__ import annotations

import weakref

from fcir import jaxcompat as jc
from fcir.ir import Module, Region

__all__ = [
    "captured_jaxpr",
    "checked",
    "forget",
    "mark_checked",
    "remember",
    "snapshot",
    "unchanged",
]

_JAXPRS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


# The IR holds its own copy of the jaxpr's constants; past this many bytes keeping the
# jaxpr too would hold them twice, so the module is traced from its IR instead.
MAX_CONSTANT_BYTES = 16 << 20


def remember(module: Module, closed: jc.ClosedJaxpr) -> None:
    """Records that ``module``'s ``main`` is ``closed`` (called by capture)."""
    if _constant_bytes(closed) > MAX_CONSTANT_BYTES:
        return
    if jc.scan_outputs.has_stacked_copies(closed):  # the backend binds those scans merged
        return
    _JAXPRS[module] = (closed, snapshot(module))


def _constant_bytes(closed: jc.ClosedJaxpr) -> int:
    """Bytes of the constants of ``closed`` and of every closed jaxpr in its eqns."""
    total = sum(getattr(c, "nbytes", 0) for c in closed.consts)
    stack = [closed.jaxpr]
    while stack:
        for eqn in stack.pop().eqns:
            for value in eqn.params.values():
                for sub in value if isinstance(value, (tuple, list)) else (value,):
                    if isinstance(sub, jc.ClosedJaxpr):
                        total += sum(getattr(c, "nbytes", 0) for c in sub.consts)
                        stack.append(sub.jaxpr)
                    elif isinstance(sub, jc.core.Jaxpr):
                        stack.append(sub)
    return total


def mark_checked(module: Module) -> None:
    """Records that ``module``, as :func:`remember` saw it (or as it is now, when it
    kept no jaxpr), passed ``fcir.check`` (called right after checking it: by capture,
    and by the reference interpreter for a module from a file)."""
    entry = _JAXPRS.get(module)
    _CHECKED[module] = entry[1] if entry is not None else snapshot(module)


def checked(module: Module) -> bool:
    """Whether ``module`` passed ``fcir.check`` in capture and is unchanged since, so a
    backend need not check it again."""
    if not isinstance(module, Module):  # fcir.check then names what was given instead
        return False
    parts = _CHECKED.get(module)
    return parts is not None and unchanged(module, parts)


_CHECKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def forget(module: Module) -> None:
    """Drops the record: backends then rebuild the jaxpr from the IR (tests use it to
    exercise that path on captured modules)."""
    _JAXPRS.pop(module, None)
    _CHECKED.pop(module, None)


def captured_jaxpr(module: Module) -> jc.ClosedJaxpr | None:
    """The jaxpr ``main`` was converted from, or None when unknown or edited since."""
    entry = _JAXPRS.get(module)
    if entry is None:
        return None
    closed, parts = entry
    return closed if unchanged(module, parts) else None


def unchanged(module: Module, parts: list) -> bool:
    """Whether ``module`` is still made of the objects of ``snapshot(module)`` then."""
    now = snapshot(module)
    return len(now) == len(parts) and all(a is b for a, b in zip(now, parts))


def snapshot(module: Module) -> list:
    """Every object ``module.main`` is built from, in a fixed order (references, so no
    object compared is freed and its id reused)."""
    main = module.main
    out: list = [
        module.name,
        module.placements,
        *module.placements,
        module.private,
        module.funcs,
        *module.funcs,
        *(f.name for f in module.funcs),
        main,
        main.body,
    ]

    def region(r: Region) -> None:
        out.append(r.ops)
        out.extend(r.params)
        out.extend(v.type for v in r.params)
        for op in r.ops:
            out.extend((op, op.name, op.attrs, op.operands, op.results, op.regions))
            out.extend(op.operands)
            out.extend(op.results)
            out.extend(v.type for v in op.results)
            out.extend(op.attrs.values())
            for sub in op.regions:
                region(sub)
        out.append(r.results)
        out.extend(r.results)

    region(main.body)
    return out
