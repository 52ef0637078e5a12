"""Results with the program's own pytree classes, in the process that captured it.

The IR records a result pytree as a :class:`fcir.ir.types.Structure`: plain data, so a
module read from disk rebuilds dicts, tuples and stand-in namedtuples, never the
program's classes (that would mean importing classes named by a file). In the process
that captured the program the real ``PyTreeDef`` is known: capture keeps it on
``Func.result_treedef`` and here, keyed by the Structure, so a module that went through
text, protobuf or a production bundle in the same process still returns an equinox
model, an optax state or a dict with int keys, exactly as ``jax.jit`` of the program.

Two captures whose results have one Structure but different treedefs (``{1: x}`` and
``{"1": x}``) make that Structure ambiguous; such modules, once deserialized, fall back
to the Structure's containers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

from fcir.errors import InterpreterError
from fcir.ir.types import Structure, runtime_type

_AMBIGUOUS = object()
_BY_STRUCTURE: dict[Structure, Any] = {}


def remember(structure: Structure | None, treedef) -> None:
    """Records the treedef capture flattened a program's results with."""
    if structure is None or treedef is None:
        return
    known = _BY_STRUCTURE.get(structure, treedef)
    _BY_STRUCTURE[structure] = treedef if known == treedef else _AMBIGUOUS


def result_treedef(func) -> Any:
    """The PyTreeDef that rebuilds ``func``'s results with the program's own classes, or
    None when this process did not capture it (rebuild from the Structure then)."""
    treedef = getattr(func, "result_treedef", None)
    if treedef is None and func.result_structure is not None:
        treedef = _BY_STRUCTURE.get(func.result_structure)
    if treedef is None or treedef is _AMBIGUOUS:
        return None
    return treedef if treedef.num_leaves == len(func.body.results) else None


def unflatten_results(func, outs: Sequence) -> Any:
    """``func``'s flat results as the pytree the program returns."""
    treedef = result_treedef(func)
    if treedef is not None:
        return treedef.unflatten(list(outs))
    structure = func.result_structure
    return structure.unflatten(list(outs)) if structure is not None else tuple(outs)


def call_arguments(module, args: tuple, kwargs: dict, who: str) -> Any:
    """The pytree a call ``run(module, *args, **kwargs)`` flattens into ``main``'s
    parameters: ``args`` without keywords (as before), ``(args, kwargs)`` with them, the
    way ``fcir.capture(f, *args, **kwargs)`` flattened and recorded them (``.args
    ((...), {"x": ...})``). Keyword names must be those the module was captured with."""
    if not kwargs:
        return args
    structure = module.main.arg_structure
    captured = _captured_keywords(structure)
    expected = _expected_arguments(structure, captured)
    if captured is None:
        raise InterpreterError(
            f"{who}: @{module.name} was captured without keyword arguments "
            f"(it takes {expected}); got keyword(s) {', '.join(sorted(map(str, kwargs)))}: "
            "pass the arguments positionally, as they were passed to fcir.capture"
        )
    positional, names = captured
    if sorted(map(str, kwargs)) != sorted(names) or len(args) != positional:
        got = ", ".join([f"{len(args)} positional"] + [f"{k}=" for k in sorted(map(str, kwargs))])
        raise InterpreterError(
            f"{who}: @{module.name} was captured as f({expected}); got ({got}): "
            "pass the same positional arguments and keyword names as to fcir.capture"
        )
    return (args, kwargs)


def check_arguments(module, called: tuple, who: str) -> None:
    """Refuses arguments that do not have the structure capture recorded (``.args``),
    naming the argument; ``called`` is what :func:`call_arguments` returns.

    * A dict whose keys are not those capture recorded. Leaves are matched to
      parameters by position, and a dict flattens in sorted key order, so
      ``{"w": W, "z": Z}`` given for a capture of ``{"b": B, "w": W}`` would run with
      ``b=W, w=Z``: a silently wrong answer (jax.jit raises a KeyError).
    * Something other than an array where capture saw one: a string or None (a JAX
      TypeError, or one leaf too few), a list of numbers for an ``f32[3]`` when the
      leaves do not add up (the same leaves in other containers are matched by
      position).
    * A tuple or list of another length than capture saw, when the leaves do not add up
      either (one argument too few or too many).

    Only containers met at the same path as a captured one are compared; otherwise
    leaves are matched by position as before."""
    structure = module.main.arg_structure
    if structure is None:
        return
    params = module.main.body.params
    counted = len(jax.tree_util.tree_leaves(called)) == len(params)

    def takes(s) -> str:
        if s.kind == "leaf" and 0 <= s.leaf < len(params):
            return str(runtime_type(params[s.leaf].type, module.cardinality))
        return str(s)

    def walk(s, given, path: str) -> None:
        where = f"argument {path}" if path else "the arguments"
        if s.kind == "leaf":
            if isinstance(given, (bool, int, float, complex)) or (
                hasattr(given, "shape") and hasattr(given, "dtype")
            ):
                return
            if isinstance(given, (tuple, list, dict)):
                if counted:  # the same leaves in another pytree: matched by position
                    return
                what = f"a {type(given).__name__} of {len(given)} item(s)"
            elif given is None:
                what = "None"
            else:
                what = f"of type {type(given).__name__} ({given!r:.40})"
            raise InterpreterError(
                f"{who}: {where} of @{module.name} is {what}, where the program takes an "
                f"array of {takes(s)}: pass a numpy or jax array"
            )
        if s.kind == "dict" and isinstance(given, dict):
            keys = sorted(map(str, given))
            if keys != sorted(s.names):
                missing = sorted(set(s.names) - set(keys))
                extra = sorted(set(keys) - set(s.names))
                raise InterpreterError(
                    f"{who}: {where} of @{module.name} is a dict with keys "
                    f"{keys}, but the program was captured with {sorted(s.names)} "
                    f"(missing {missing}, unexpected {extra}); its values would be matched "
                    "to the captured keys by sorted position: pass the keys capture saw"
                )
            for name, child in zip(s.names, s.children):
                walk(child, given[next(k for k in given if str(k) == name)], f"{path}[{name!r}]")
        elif s.kind in ("tuple", "list", "namedtuple") and isinstance(given, (tuple, list)):
            if len(given) == len(s.children):
                for i, (child, g) in enumerate(zip(s.children, given)):
                    walk(child, g, f"{path}[{i}]")
            elif not counted:
                shown = ", ".join(takes(c) for c in s.children)
                what = f"{len(s.children)} arguments" if not path else (
                    f"{len(s.children)} items in argument {path}")
                raise InterpreterError(
                    f"{who}: @{module.name} takes {what} ({shown}), as it was captured; "
                    f"got {len(given)}"
                )

    walk(structure, called, "")


def captured_keyword_names(module) -> tuple[str, ...]:
    """The keyword names ``module`` was captured with (none when captured positionally)."""
    captured = _captured_keywords(module.main.arg_structure)
    return () if captured is None else tuple(captured[1])


def _captured_keywords(structure: Structure | None) -> tuple[int, tuple[str, ...]] | None:
    """(number of positional arguments, keyword names) of a capture with keywords."""
    if (
        structure is None
        or structure.kind != "tuple"
        or len(structure.children) != 2
        or structure.children[0].kind != "tuple"
        or structure.children[1].kind != "dict"
    ):
        return None
    return len(structure.children[0].children), structure.children[1].names


def _expected_arguments(structure: Structure | None, captured) -> str:
    """How the module was captured, in words (``captured``: ``_captured_keywords``)."""
    if captured is not None:
        positional, names = captured
        return ", ".join([f"{positional} positional"] + [f"{n}=" for n in names])
    if structure is not None and structure.kind == "tuple":
        return f"{len(structure.children)} positional"
    return "its arguments positionally"


def leaf_names(structure: Structure | None, n: int) -> list[str]:
    """A name for each of ``n`` flat leaves, from the pytree's own keys: dict keys and
    namedtuple fields joined by dots (``{"params": {"w": ..}, "train_loss": ..}`` gives
    ``params.w`` and ``train_loss``). The position in the outermost tuple (a function's
    several results or arguments) is left out where the rest of the name is unique;
    list and inner tuple positions are kept as numbers. A leaf with no key on its path
    (``(params, loss)``'s ``loss``) is named by its flat position, ``arr_<i>``, as the
    ``.npz`` files name it."""
    parts: list[list[str] | None] = [None] * n
    top_tuple = structure is not None and structure.kind in ("tuple", "list")

    def walk(s: Structure, prefix: list[str]) -> None:
        if s.kind == "leaf":
            if 0 <= s.leaf < n:
                parts[s.leaf] = prefix
            return
        for i, child in enumerate(s.children):
            keyed = s.kind in ("dict", "namedtuple", "custom") and i < len(s.names)
            walk(child, [*prefix, s.names[i] if keyed else str(i)])

    if structure is not None:
        walk(structure, [])

    def keyed(p: list[str] | None) -> bool:
        return bool(p) and any(not x.isdigit() for x in p)

    short = [p[1:] if top_tuple and keyed(p) and keyed(p[1:]) else p for p in parts]
    names = []
    for i, (p, s) in enumerate(zip(parts, short)):
        if not keyed(p):
            names.append(f"arr_{i}")
        else:
            names.append(".".join(s if short.count(s) == 1 else p))
    return names
