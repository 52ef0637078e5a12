"""The federated frontend's shared machinery: ``program`` and the placement context.

Placement context is a thread-local stack pushed by a program call and by each
``map_fn`` body being traced, so nothing global is patched: two programs with
different placements interleave and run from threads. The public function of each
fed op (``fcir.broadcast``, ``fcir.map_fn``, ``fcir.reduce_sum``, ...) lives in the
op's module in ``fcir.fed`` and reads the context here (``_current``, ``_pushed``),
binding its primitive with the placement name and cardinality as params
(``_reduce`` for the one-operand aggregates).
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from fcir.errors import PlacementError
from fcir.ir import is_name

__all__ = ["PRIVATE_SCOPE", "Placements", "program"]

SERVER = "server"


@dataclasses.dataclass(frozen=True)
class Placements:
    """A placement hierarchy: ``server`` above ``names[0]`` above ``names[1]`` ..."""

    names: tuple[str, ...]
    sizes: tuple[int, ...]

    @classmethod
    def from_mapping(cls, placements: Mapping[str, int]) -> Placements:
        if not isinstance(placements, Mapping) or not placements:
            raise PlacementError(
                f"fcir.program: placements must be a non-empty mapping of name -> cardinality, "
                f"got {placements!r}"
            )
        names, sizes = [], []
        for name, size in placements.items():
            if not is_name(name) or name == SERVER:
                raise PlacementError(
                    f"fcir.program: placement name {name!r} must be an ASCII identifier "
                    f"([A-Za-z_][A-Za-z0-9_]*) other than '{SERVER}'"
                )
            if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 1:
                raise PlacementError(
                    f"fcir.program: cardinality of '{name}' must be a positive int, got {size!r}"
                )
            names.append(name)
            sizes.append(int(size))
        return cls(tuple(names), tuple(sizes))

    def size(self, name: str) -> int:
        return self.sizes[self.names.index(name)]


@dataclasses.dataclass(frozen=True)
class _Frame:
    placements: Placements
    level: int  # -1: server; i: inside a map body over members of names[i]
    mesh: Any
    # (leaf, "w['dense']") of the program's own arguments, for errors that name them.
    arguments: tuple = ()
    client_data: tuple = ()  # the names fcir.program(client_data=...) declares

    def child(self, what: str) -> tuple[str, int]:
        if self.level + 1 >= len(self.placements.names):
            here = SERVER if self.level < 0 else self.placements.names[self.level]
            raise PlacementError(
                f"{what}: there is no placement below '{here}' in this program "
                f"(placements: {list(self.placements.names)})"
            )
        name = self.placements.names[self.level + 1]
        return name, self.placements.sizes[self.level + 1]


class _Context(threading.local):
    def __init__(self):
        self.stack: list[_Frame] = []


_CONTEXT = _Context()


def _current(what: str) -> _Frame:
    if not _CONTEXT.stack:
        raise PlacementError(
            f"{what} is only defined inside a function decorated with @fcir.program(...): "
            "decorate the round function that calls it"
        )
    return _CONTEXT.stack[-1]


class _pushed:
    def __init__(self, frame: _Frame):
        self.frame = frame

    def __enter__(self):
        _CONTEXT.stack.append(self.frame)

    def __exit__(self, *exc):
        _CONTEXT.stack.pop()


# The name scope of the ops a private program traces (see ``program``).
PRIVATE_SCOPE = "fcir_private_program"


def program(
    fn: Callable | None = None,
    /,
    *,
    placements: Mapping[str, int] | None = None,
    mesh=None,
    private: bool = False,
    client_data=None,
    evaluate: Callable | None = None,
) -> Callable[[Callable], Callable]:
    """Declares a federated program's placements, outermost first.

    ``@fcir.program(placements={"clients": 8})`` or, for a hierarchy,
    ``placements={"silos": 4, "clients": 16}``. The decorated function is an ordinary
    JAX function: ``jax.jit``, ``jax.grad``, ``jax.vmap`` and ``fcir.capture`` apply.

    ``private=True`` marks the captured Module private: ``fcir.check`` then rejects
    every path by which client data reaches the server other than through
    ``fcir.dp_sum`` / ``fcir.dp_mean`` (see ``fcir.privacy``).

    ``client_data=("x", "y")`` names the arguments that hold client data (one entry per
    member of the outermost placement along each leaf's leading axis). Calls check
    their leading axes, and ``fcir.capture`` refuses a program that uses any other
    argument as client data: a server model passed to ``map_fn`` without
    ``fcir.broadcast`` (silently client data when its leading axis happens to equal the
    cohort size).

    ``evaluate=fn`` declares the program's federated evaluation, as Flower's evaluate
    stage runs it: ``fn(params, x, y) -> {"test_loss": ...}`` is one client's metrics
    (scalars, named by the dict's keys) on the server's values and that client's data;
    its arguments named in ``client_data`` are the client's data, the others server
    values. ``fcir.evaluation(program)`` is the program that computes them over every
    member, weighted by each member's number of examples.
    """
    if fn is not None or placements is None:
        raise PlacementError(
            "fcir.program needs its placements: write @fcir.program(placements={'clients': "
            "8}) above the round, with the number of members of each placement"
        )
    spec = Placements.from_mapping(placements)
    if not isinstance(private, bool):
        raise PlacementError(f"fcir.program: private must be True or False, got {private!r}")
    if isinstance(client_data, str):
        client_data = (client_data,)
    if client_data is not None and (
        not isinstance(client_data, (tuple, list))
        or not all(isinstance(c, str) for c in client_data)
    ):
        raise PlacementError(
            f"fcir.program: client_data must name arguments, e.g. client_data=('x', 'y'), "
            f"got {client_data!r}"
        )

    if evaluate is not None and not callable(evaluate):
        raise PlacementError(
            f"fcir.program: evaluate must be a function (server values, one client's data) "
            f"-> {{name: metric}}, got {evaluate!r}"
        )
    if evaluate is not None and client_data is None:
        raise PlacementError(
            "fcir.program(evaluate=...): declare which arguments are client data "
            "(client_data=('x', 'y')), so that the evaluation knows which of its arguments "
            "each client holds"
        )

    def decorate(fn: Callable) -> Callable:
        declared = None if client_data is None else _client_data_indices(fn, client_data)
        outer, n = spec.names[0], spec.sizes[0]

        @functools.wraps(fn)
        def run(*args, **kwargs):
            for i, arg_name in declared or ():
                if i < len(args):
                    _check_client_data(args[i], arg_name, outer, n)
            named = _named_leaves(fn, args, kwargs)
            declared_names = tuple(c for _, c in declared or ())
            with _pushed(_Frame(spec, -1, mesh, named, declared_names)):
                if not private:
                    return fn(*args, **kwargs)
                # Every op traced here carries the scope in its name stack, through
                # jit, grad, vmap, scan bodies: capture of any function that calls this
                # one sees it and makes the module private.
                with jax.named_scope(PRIVATE_SCOPE):
                    return fn(*args, **kwargs)

        run.fcir_placements = spec
        run.fcir_private = private
        run.fcir_client_data = declared
        run.fcir_evaluate = evaluate
        return run

    return decorate


def _client_data_indices(fn, names) -> tuple[tuple[int, str], ...]:
    """(position, name) of each argument ``client_data`` names; PlacementError for a
    name ``fn`` does not take positionally."""
    import inspect

    params = [
        p.name for p in inspect.signature(fn).parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    unknown = [c for c in names if c not in params]
    if unknown:
        raise PlacementError(
            f"fcir.program(client_data=...): {fn.__name__}({', '.join(params)}) has no "
            f"argument {', '.join(map(repr, unknown))}"
        )
    return tuple((params.index(c), c) for c in names)


def _named_leaves(fn, args, kwargs) -> tuple:
    """(leaf, its name in ``fn``'s signature: ``w``, ``params['dense']``) of each leaf of
    a program call's arguments."""
    import inspect

    try:
        params = [
            p.name for p in inspect.signature(fn).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
    except (TypeError, ValueError):  # a callable without a signature
        params = []
    given = [(params[i] if i < len(params) else f"argument {i}", a) for i, a in enumerate(args)]
    named = []
    for name, arg in [*given, *kwargs.items()]:
        for path, leaf in jax.tree_util.tree_flatten_with_path(arg)[0]:
            named.append((leaf, name + jax.tree_util.keystr(path)))
    return tuple(named)


def _check_client_data(arg, name: str, placement: str, n: int) -> None:
    for leaf in jax.tree_util.tree_leaves(arg):
        shape = np.shape(leaf)
        if len(shape) == 0 or shape[0] != n:
            raise PlacementError(
                f"argument {name!r} is declared client data (fcir.program(client_data=...)), "
                f"so each leaf needs a leading axis of {n}, one entry per member of "
                f"'{placement}'; got a leaf of shape {tuple(shape)}"
            )


def _flatten(x):
    return jax.tree_util.tree_flatten(x)


def _check_placed(tree, placement: str, n: int, what: str) -> None:
    """Every leaf of ``tree`` is placed at ``placement``: its leading axis holds the
    ``n`` members. A leaf with another leading axis is either a server value (which
    only fcir.broadcast places) or data of another number of members than the program
    declares; the error names the leaf (by the program's argument name when it is
    one) and the user's line, and says both, the likelier first: a forgotten broadcast
    when other client data in the call has the cohort's leading axis or the program
    declares client_data without this argument, else the cohort size."""
    from fcir.errors import call_site

    frame = _CONTEXT.stack[-1] if _CONTEXT.stack else None
    arguments = frame.arguments if frame is not None else ()
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]

    def argument(leaf):
        return next((name for x, name in arguments if x is leaf), None)

    for path, leaf in leaves:
        shape = tuple(np.shape(leaf))
        if shape and shape[0] == n:
            continue
        where = f"leaf {jax.tree_util.keystr(path)}" if path else "a leaf"
        arg = argument(leaf)
        at = call_site()
        site = f" (at {at})" if at else ""
        if arg is not None:
            where = f"argument {arg!r}, {where}"
        problem = (
            f"{where} of shape {shape} is not placed at '{placement}': its leading axis "
            f"must be the cardinality of '{placement}' ({n})"
        )
        if what != "fcir.map_fn":
            raise PlacementError(f"{what}: {problem}{site}")
        shown = arg or "w"
        broadcast = (
            f"did you mean fcir.broadcast({shown})? A server value (a model) reaches the "
            f"members only through fcir.broadcast: {what}(fn, (fcir.broadcast({shown}), x))"
        )
        cohort = (
            f"if it holds one entry per member, that is {shape[0]} members: declare "
            f"'{placement}': {shape[0]} in @fcir.program(placements=...) or pass {n} "
            "members' data" if shape else ""
        )
        declared = frame.client_data if frame is not None else ()
        name = arg.partition("[")[0] if arg is not None else None
        placed_data = any(
            np.shape(x)[:1] == (n,) and argument(x) is not None for _, x in leaves
        )
        if name is not None and (name in declared or (not declared and not placed_data)):
            # Declared client data, or no argument in the call has the cohort's axis:
            # the data is of another number of members.
            raise PlacementError(f"{what}: {problem}{site}; {cohort}; if it is a server "
                                 f"value, {broadcast}")
        raise PlacementError(
            f"{what}: {broadcast}. Here {problem}{site}" + (f"; {cohort}" if cohort else "")
        )


def _reduce(prim, what: str, x, **params):
    frame = _current(what)
    name, n = frame.child(what)
    _check_placed(x, name, n, what)
    leaves, tree = _flatten(x)
    out = [prim.bind(leaf, placement=name, n=n, **params) for leaf in leaves]
    return jax.tree_util.tree_unflatten(tree, out)


def _dp_static(what: str, name: str, value, low: float, strict: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise PlacementError(
            f"{what}: {name} must be a Python number known when the program is traced "
            f"(the accountant reads it from the IR), got {type(value).__name__}"
        )
    v = float(value)
    if not np.isfinite(v) or v < low or (strict and v == low):
        bound = f"> {low}" if strict else f">= {low}"
        raise PlacementError(f"{what}: {name} must be finite and {bound}, got {value!r}")
    return v
