"""Loading a program: an IR file (``.fcir`` canonical text, ``.pb`` serialized
protobuf), or a Python function named ``file.py:function`` / ``package.module:function``
captured with example arguments. The core's one loader, for the command lines of
fcir and of its backends (``fcir compile``, ``fcir export``, ...).

Python targets get their example arguments from ``--args`` specs written in the IR's
type syntax (``f32[16,1]``, ``(f32[8,32,16], f32[8,32,1])``) or, if none are given,
from the file's ``EXAMPLE_ARGS = {"function": zero-arg callable}`` dict.
"""

from __future__ import annotations

import importlib
import importlib.util
import pathlib
import sys

import jax

from fcir.base_interpreter import as_input
from fcir.errors import FcirError, ParseError
from fcir.frontend.capture import capture
from fcir.ir import Module
from fcir.ir.text import _Parser, parse, parse_located
from fcir.ir.types import dtype_name, runtime_type

IR_SUFFIXES = (".fcir", ".pb")


def is_ir_file(target: str) -> bool:
    return target.endswith(IR_SUFFIXES)


def load_ir(path: str, *, located: bool = False) -> Module:
    """Reads a ``.fcir`` text or ``.pb`` binary IR file. ``located``: each op of a text
    file carries its line of the file as its location (``fcir.text.parse_located``)."""
    p = pathlib.Path(path)
    if p.is_dir():
        # `fcir compile ... -o r.fcir` writes a directory of that name: point into it.
        inside = sorted(str(f) for f in p.iterdir() if f.is_file() and is_ir_file(f.name))
        hint = f": did you mean {' or '.join(inside[:2])}?" if inside else ""
        raise FcirError(f"{path} is a directory, not an IR file (a .fcir or .pb file){hint}")
    if not p.is_file():
        raise FcirError(f"no such IR file: {path}")
    if path.endswith(".pb"):
        data = p.read_bytes()
        if data.lstrip().startswith(b"fcir.module"):  # the mirror of the check below
            raise ParseError(f"{path} is IR text, not a serialized module (text IR files end "
                             "in .fcir): rename it")
        return Module.deserialize(data)
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ParseError(f"{path} is not UTF-8 text (binary IR files end in .pb)") from None
    return parse_located(text, p.name) if located else parse(text)


def load_function(target: str):
    """``file.py:fn`` or ``pkg.mod:fn`` -> (function, module object)."""
    if ":" not in target:
        raise FcirError(
            f"target {target!r} must be file.py:function, package.module:function, or an IR "
            "file ending in .fcir or .pb"
        )
    where, _, name = target.rpartition(":")
    if where.endswith(".py"):
        path = pathlib.Path(where)
        if not path.is_file():
            raise FcirError(f"no such file: {where}")
        mod_name = "_fcir_target_" + "".join(c if c.isalnum() else "_" for c in path.stem)
        spec = importlib.util.spec_from_file_location(mod_name, path)
        module = importlib.util.module_from_spec(spec)
        # Registered before it runs, as `import` does: @dataclass (and typing under
        # `from __future__ import annotations`) looks the defining module up in
        # sys.modules while the file executes.
        sys.modules[mod_name] = module
        sys.path.insert(0, str(path.resolve().parent))
        try:
            spec.loader.exec_module(module)
        except BaseException:
            sys.modules.pop(mod_name, None)
            raise
        finally:
            sys.path.pop(0)
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as e:
            raise FcirError(f"cannot import {where!r}: {e}{_file_hint(where, name)}") from None
    fn = getattr(module, name, None)
    if fn is None or not callable(fn):
        raise FcirError(f"{where} has no function {name!r}{_function_hint(module, where, name)}")
    return fn, module


def _function_hint(module, where: str, name: str) -> str:
    """``; did you mean f.py:fedprox_adam?`` naming the closest public function of
    ``module`` (its @fcir.program functions first), or the programs it defines."""
    import difflib

    functions = {
        k: v for k, v in vars(module).items()
        if callable(v) and not k.startswith("_") and not isinstance(v, type)
    }
    programs = sorted(k for k, v in functions.items() if hasattr(v, "fcir_placements"))
    near = difflib.get_close_matches(name, programs, n=1) or difflib.get_close_matches(
        name, sorted(functions), n=1
    )
    if near:
        return f"; did you mean {where}:{near[0]}?"
    if programs:
        return f"; its @fcir.program functions: {', '.join(programs)}"
    return ""


def _file_hint(where: str, name: str) -> str:
    """``; did you mean examples/fedavg.py:fedavg_round?`` when ``where`` names a Python
    file without its ``.py`` (``examples/fedavg``) or as a module path that is not
    importable from here (``examples.fedavg``: the current directory is not on the
    ``fcir`` command's import path); empty otherwise."""
    for guess in (where + ".py", where.replace(".", "/") + ".py"):
        if pathlib.Path(guess).is_file():
            return f"; did you mean {guess}:{name}?"
    return ""


SPEC_SYNTAX = (
    "one type per argument in the IR's syntax: an array f32[16,1] (key<fry>[] for a PRNG "
    "key), a tuple (f32[8,32,16], f32[8,32,1]), a list [f32[3], f32[3]], a dict "
    '{"w": f32[64,10], "b": f32[10]}, none'
)


def parse_arg_specs(specs: list[str]) -> tuple:
    """``["f32[16,1]", "(f32[8,32,16], f32[8,32,1])", '{"w": f32[3]}']`` ->
    ShapeDtypeStruct pytrees (tuples, lists, dicts with string keys, None)."""
    out = []
    for spec in specs:
        try:
            parser = _Parser(spec)
            out.append(_spec(parser))
            if parser.tok[0] != "eof":
                raise parser.error("unexpected text after the type")
        except ParseError as e:  # which of several specs, not just "line 1, column 9"
            raise ParseError(f"--args {spec!r}: {e}") from None
    return tuple(out)


def _spec(parser):
    parser.enter()
    try:
        return _spec_node(parser)
    finally:
        parser.depth -= 1


def _items(parser, close: str, item):
    items = []
    while not parser.accept(close):
        if items:
            parser.expect(",")
            if parser.accept(close):  # a trailing comma: (f32[3],)
                break
        items.append(item())
    return items


def _spec_node(parser):
    if parser.accept("("):
        return tuple(_items(parser, ")", lambda: _spec(parser)))
    if parser.accept("["):
        return _items(parser, "]", lambda: _spec(parser))
    if parser.accept("{"):
        seen: set[str] = set()

        def entry():
            t = parser.tok
            if t[0] == "string":
                key = parser.string()
            elif t[0] == "ident":
                key = parser.next()[1]
            else:
                raise parser.error('expected a dict key such as "w"', t)
            if key in seen:
                raise parser.error(f"the dict names key {key!r} twice", t)
            seen.add(key)
            parser.expect(":")
            return key, _spec(parser)

        return dict(_items(parser, "}", entry))
    if parser.tok[0] == "ident" and parser.tok[1] == "none":
        parser.next()
        return None
    t = parser.tensor_type()
    return jax.ShapeDtypeStruct(t.shape, t.np_dtype)


def format_arg_spec(tree) -> str | None:
    """The ``--args`` spec of one argument (a pytree of arrays or ShapeDtypeStructs),
    which :func:`parse_arg_specs` reads back; None when the pytree holds containers the
    syntax has no form for (namedtuples, dataclasses)."""
    import json

    if tree is None:
        return "none"
    if isinstance(tree, dict) and type(tree) is dict and all(isinstance(k, str) for k in tree):
        parts = []
        for k in sorted(tree):  # jax flattens dicts in sorted key order
            v = format_arg_spec(tree[k])
            if v is None:
                return None
            parts.append(f"{json.dumps(k)}: {v}")
        return "{" + ", ".join(parts) + "}"
    if type(tree) in (tuple, list):
        parts = [format_arg_spec(v) for v in tree]
        if any(p is None for p in parts):
            return None
        body = ", ".join(parts)
        if type(tree) is list:
            return f"[{body}]"
        return f"({body},)" if len(parts) == 1 else f"({body})"
    if hasattr(tree, "shape") and hasattr(tree, "dtype"):
        return f"{dtype_name(tree.dtype)}[{','.join(str(int(d)) for d in tree.shape)}]"
    if isinstance(tree, (bool, int, float)):
        return format_arg_spec(jax.ShapeDtypeStruct((), jax.numpy.asarray(tree).dtype))
    return None


def _parameters(fn) -> list[str] | None:
    import inspect

    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params):
        return None
    return [p.name for p in params]


def _suggested_args(fn, module) -> str | None:
    """``--args ...`` for ``fn`` from another EXAMPLE_ARGS entry of the same file whose
    function has parameters of the same names (``fedavg_round(model, client_data)``
    from ``dp_fedavg_round(model, key, client_data)``); None when there is none."""
    import shlex

    table = getattr(module, "EXAMPLE_ARGS", None)
    wanted = _parameters(fn)
    if not isinstance(table, dict) or not wanted:
        return None
    for other, make in table.items():
        sibling = getattr(module, other, None) if isinstance(other, str) else None
        names = _parameters(sibling) if callable(sibling) else None
        if not names or not set(wanted) <= set(names):
            continue
        try:
            args = make()
        except Exception:  # noqa: BLE001  a hint only: the user's loader failed
            return None
        args = args if isinstance(args, tuple) else (args,)
        if len(args) != len(names):
            continue
        by_name = dict(zip(names, args))
        specs = [format_arg_spec(by_name[n]) for n in wanted]
        if all(s is not None for s in specs):
            return "--args " + " ".join(shlex.quote(s) for s in specs)
    return None


def example_args(fn_name: str, module, fn=None) -> tuple:
    table = getattr(module, "EXAMPLE_ARGS", None)
    if not isinstance(table, dict) or fn_name not in table:
        where = getattr(module, "__file__", None) or getattr(module, "__name__", "the file")
        hint = _suggested_args(fn, module) if fn is not None else None
        shown = (
            f"e.g. (from EXAMPLE_ARGS of a function with the same parameters) {hint}"
            if hint
            else "e.g. --args 'f32[16,1]' '(f32[8,32,16], f32[8,32,1])'"
        )
        raise FcirError(
            f"no --args given and {where} defines no EXAMPLE_ARGS[{fn_name!r}]; pass --args "
            f"with {SPEC_SYNTAX}; {shown}"
        )
    args = table[fn_name]()
    return args if isinstance(args, tuple) else (args,)


def _check_arity(fn, name: str, args: tuple) -> None:
    """``--args`` gives one type per parameter of ``fn``: say so before tracing (a
    missing one was a bare Python TypeError from inside the trace)."""
    import inspect

    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in positional if p.default is p.empty]
    if len(required) <= len(args) <= len(positional):
        return
    names = ", ".join(p.name for p in positional)
    want = (
        str(len(required))
        if len(required) == len(positional)
        else f"{len(required)} to {len(positional)}"
    )
    raise FcirError(
        f"{name}({names}) takes {want} argument(s) but --args gave {len(args)} type(s): "
        f"give {SPEC_SYNTAX}, in the order of the parameters"
    )


def load_module(
    target: str, arg_specs: list[str] | None = None, *, locations: bool = False
) -> Module:
    """Any target -> a captured (or loaded) Module (``locations``: capture records each
    op's source line)."""
    return load_module_and_names(target, arg_specs, locations=locations)[0]


def load_module_and_names(
    target: str, arg_specs: list[str] | None = None, *, locations: bool = False
) -> tuple[Module, list[str] | None]:
    """``load_module``, and the names of the function's positional parameters (None for
    an IR file, which does not keep them): messages about argument leaves name them."""
    if is_ir_file(target):
        if arg_specs:
            raise FcirError("--args applies to Python targets only; IR files carry their types")
        return load_ir(target), None
    fn, module = load_function(target)
    name = target.rpartition(":")[2]
    args = parse_arg_specs(arg_specs) if arg_specs else example_args(name, module, fn)
    if arg_specs:
        _check_arity(fn, name, args)
    return capture(fn, *args, name=name, locations=locations), _positional_names(fn)


def _positional_names(fn) -> list[str] | None:
    import inspect

    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    return [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def load_python_target(target: str, arg_specs: list[str] | None = None):
    """(function, example args) of a Python target, for commands that run it."""
    fn, module = load_function(target)
    name = target.rpartition(":")[2]
    args = parse_arg_specs(arg_specs) if arg_specs else example_args(name, module, fn)
    if arg_specs:
        _check_arity(fn, name, args)
    return fn, args


def leaf_paths(structure, n: int) -> list[str]:
    """Where each of ``n`` argument leaves sits in the arguments, as
    ``jax.tree_util.keystr`` writes it with the argument tuple first: ``[0]['b1']``."""
    paths = [""] * n
    if structure is None:
        return [f"[{i}]" for i in range(n)]

    def walk(s, prefix):
        if s.kind == "leaf":
            if 0 <= s.leaf < n:
                paths[s.leaf] = prefix
            return
        for i, c in enumerate(s.children):
            if s.kind in ("tuple", "list"):
                walk(c, f"{prefix}[{i}]")
            elif s.kind == "dict":
                walk(c, f"{prefix}[{s.names[i]!r}]")
            else:
                walk(c, f"{prefix}.{s.names[i]}" if i < len(s.names) else f"{prefix}[{i}]")

    walk(structure, "")
    return paths


def _expected_leaves(module) -> list[str]:

    params = module.main.body.params
    paths = leaf_paths(module.main.arg_structure, len(params))
    return [
        f"arr_{i}: {runtime_type(v.type, module.cardinality)} (%{i}: {v.type}"
        + (f", argument {paths[i]})" if paths[i] else ")")
        for i, v in enumerate(params)
    ]


def load_inputs(path: str, module=None, names: list[str] | None = None) -> list:
    """The argument leaves of ``module`` from ``path``, an .npz of ``arr_0, arr_1, ...``
    in ``jax.tree_util`` flatten order (what ``np.savez(path, *leaves)`` writes). An
    error names each missing or unexpected array and lists the leaves the program
    takes (with no ``module``: every ``arr_i`` the file holds, which must be
    contiguous). Leaves are converted as ``jax.jit`` would (``fcir.base_interpreter.as_input``:
    float64 -> float32), with a note on stderr for each one converted naming the
    argument it is (by ``names``, the function's positional parameters, when given)."""
    import re
    import zipfile

    import numpy as np

    p = pathlib.Path(path)
    if not p.is_file():
        raise FcirError(f"no such inputs file: {path}")
    try:
        with np.load(p, allow_pickle=False) as data:
            arrays = {k: data[k] for k in data.files}
    except ValueError as e:
        if "pickled" not in str(e):
            raise FcirError(f"cannot read inputs {path}: {type(e).__name__}: {e}") from None
        # np.load's advice (allow_pickle=) is not ours: fcir never unpickles inputs.
        raise FcirError(
            f"cannot read inputs {path}: it is not an .npz of arrays: write the argument leaves with "
            "np.savez(path, *jax.tree_util.tree_leaves(args))"
        ) from None
    except (OSError, EOFError, zipfile.BadZipFile) as e:
        raise FcirError(f"cannot read inputs {path}: {type(e).__name__}: {e}") from None
    save = "save them in jax.tree_util flatten order with np.savez(path, *jax.tree_util.tree_leaves(args))"
    if module is None:
        n = len(arrays)
        expected = [f"arr_{i}" for i in range(n)]
        takes = save
    else:
        n = len(module.main.body.params)
        expected = _expected_leaves(module)
        listed = "; ".join(expected[:8]) + ("; ..." if n > 8 else "")
        takes = f"@{module.name} takes {n} argument leaves ({listed}): {save}"
    named = sorted(k for k in arrays if not re.fullmatch(r"arr_(0|[1-9][0-9]*)", k))
    if named:
        shown = ", ".join(named[:8]) + (" ..." if len(named) > 8 else "")
        raise FcirError(
            f"{path} holds arrays named {shown}: inputs are read by position, as "
            f"arr_0, arr_1, ...; {takes}"
        )
    index = {int(k[4:]) for k in arrays}
    missing = [i for i in range(n) if i not in index]
    extra = sorted(i for i in index if i >= n)
    if missing:
        raise FcirError(
            f"{path} has no {', '.join(expected[i] for i in missing[:8])}"
            f"{' ...' if len(missing) > 8 else ''}; {takes}"
        )
    if extra:
        raise FcirError(
            f"{path} holds {', '.join(f'arr_{i}' for i in extra)} beyond the "
            f"program's arguments; {takes}"
        )
    paths = leaf_paths(module.main.arg_structure, n) if module is not None else [""] * n
    leaves = []
    for i in range(n):
        x = arrays[f"arr_{i}"]
        y = as_input(x)
        if y.dtype != x.dtype:
            print(
                f"note: {path}: arr_{i} is {x.dtype}, converted to {y.dtype} as jax.jit "
                f"does (JAX's x64 mode is off){_argument(paths[i], names)}",
                file=sys.stderr,
            )
        leaves.append(y)
    return leaves


def _argument(path: str, names: list[str] | None) -> str:
    """``: argument w['b1']`` for a leaf at ``path`` (``[0]['b1']``), naming the
    positional parameter ``[0]`` is when ``names`` are known; ``""`` for no path."""
    import re

    m = re.match(r"\[(\d+)\]", path)
    if m is None:
        return f": argument {path}" if path else ""
    i = int(m.group(1))
    if names is not None and i < len(names):
        return f": argument {names[i]}{path[m.end():]}"
    return f": argument {path}"
