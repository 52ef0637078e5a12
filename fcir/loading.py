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

from fcir.errors import FcirError, ParseError
from fcir.ir import Module

IR_SUFFIXES = (".fcir", ".pb")


def is_ir_file(target: str) -> bool:
    return target.endswith(IR_SUFFIXES)


def load_ir(path: str) -> Module:
    """Reads a ``.fcir`` text or ``.pb`` binary IR file."""
    p = pathlib.Path(path)
    if not p.is_file():
        raise FcirError(f"no such IR file: {path}")
    if path.endswith(".pb"):
        return Module.deserialize(p.read_bytes())
    from fcir.text import parse

    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ParseError(f"{path} is not UTF-8 text (binary IR files end in .pb)") from None
    return parse(text)


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
            raise FcirError(f"cannot import {where!r}: {e}") from None
    fn = getattr(module, name, None)
    if fn is None or not callable(fn):
        raise FcirError(f"{where} has no function {name!r}")
    return fn, module


def parse_arg_specs(specs: list[str]) -> tuple:
    """``["f32[16,1]", "(f32[8,32,16], f32[8,32,1])"]`` -> ShapeDtypeStruct pytrees."""
    from fcir.text import _Parser

    out = []
    for spec in specs:
        parser = _Parser(spec)
        out.append(_spec(parser))
        if parser.tok[0] != "eof":
            raise parser.error("unexpected text after the type")
    return tuple(out)


def _spec(parser):
    if parser.accept("("):
        items = []
        while not parser.accept(")"):
            if items:
                parser.expect(",")
            items.append(_spec(parser))
        return tuple(items)
    t = parser.tensor_type()
    return jax.ShapeDtypeStruct(t.shape, t.np_dtype)


def example_args(fn_name: str, module) -> tuple:
    table = getattr(module, "EXAMPLE_ARGS", None)
    if not isinstance(table, dict) or fn_name not in table:
        raise FcirError(
            f"no --args given and the file defines no EXAMPLE_ARGS[{fn_name!r}]; pass "
            "--args with one type per argument, e.g. --args 'f32[16,1]' '(f32[8,32,16])'"
        )
    args = table[fn_name]()
    return args if isinstance(args, tuple) else (args,)


def load_module(target: str, arg_specs: list[str] | None = None) -> Module:
    """Any target -> a captured (or loaded) Module."""
    if is_ir_file(target):
        if arg_specs:
            raise FcirError("--args applies to Python targets only; IR files carry their types")
        return load_ir(target)
    fn, module = load_function(target)
    name = target.rpartition(":")[2]
    args = parse_arg_specs(arg_specs) if arg_specs else example_args(name, module)
    from fcir.capture import capture

    return capture(fn, *args, name=name)


def load_python_target(target: str, arg_specs: list[str] | None = None):
    """(function, example args) of a Python target, for commands that run it."""
    fn, module = load_function(target)
    name = target.rpartition(":")[2]
    args = parse_arg_specs(arg_specs) if arg_specs else example_args(name, module)
    return fn, args
