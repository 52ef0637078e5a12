"""The ``fcir`` command line.

Every command prints ``--help``, exits 2 on usage errors and never prints a Python
traceback for bad input (``--debug`` shows one). The core imports no backend: backends
and their commands come from entry points (``fcir.cli.plugins``).
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import pathlib
import sys

from fcir.checker.check import verify
from fcir.cli import plugins
from fcir.errors import FcirError, user_location
from fcir.frontend.capture import capture_unchecked
from fcir.frontend.loading import (
    is_ir_file,
    load_inputs,
    load_ir,
    load_module,
    load_module_and_names,
    load_python_target,
)
from fcir.privacy import format_round_cost, round_cost
from fcir.report import dot

EMIT_CHOICES = ("ir", "hlo", "stablehlo", "cost")


class _Parser(argparse.ArgumentParser):
    """argparse, with usage errors exiting 2 and naming the subcommand."""


def _add_target(p, what="TARGET"):
    p.add_argument(
        what,
        help="file.py:function, package.module:function, or an IR file (.fcir text, .pb binary)",
    )
    p.add_argument(
        "--args",
        nargs="+",
        metavar="SPEC",
        help="argument types, one per argument: arrays in IR syntax 'f32[16,1]' "
        "('key<fry>[]' a PRNG key), tuples '(f32[8,32,16], f32[8,32,1])', lists "
        "'[f32[3], f32[3]]', dicts '{\"w\": f32[64,10], \"b\": f32[10]}', 'none'; "
        "default: the file's EXAMPLE_ARGS",
    )


def _write_outputs(outputs, path: str | None) -> None:
    import jax
    import numpy as np

    from fcir.frontend.pytrees import leaf_names
    from fcir.ir.types import structure_of

    flat, treedef = jax.tree_util.tree_flatten(outputs)
    leaves = [np.asarray(x) for x in flat]
    names = leaf_names(structure_of(treedef), len(leaves))
    if path:
        np.savez(path, *leaves)
        print(f"wrote {len(leaves)} output array(s) to {path}")
        return
    for i, x in enumerate(leaves):
        flat = x.reshape(-1)
        preview = np.array2string(flat[:6], precision=6, separator=", ")
        more = " ..." if flat.size > 6 else ""
        named = f"  ({names[i]})" if names[i] != f"arr_{i}" else ""  # the program's own name
        print(f"arr_{i}: {x.dtype}{list(x.shape)} {preview}{more}{named}")


def _unflatten_args(module, leaves):
    structure = module.main.arg_structure
    if structure is None:
        return tuple(leaves)
    n = len(module.main.body.params)
    if len(leaves) != n:
        raise FcirError(f"@{module.name} takes {n} array leaves; the inputs hold {len(leaves)}")
    args = structure.unflatten(leaves)
    return args if isinstance(args, tuple) else (args,)


# --- commands ---------------------------------------------------------------------------


def cmd_compile(a) -> int:

    emit = [e.strip() for e in a.emit.split(",") if e.strip()]
    bad = [e for e in emit if e not in EMIT_CHOICES]
    if bad:
        raise _Usage(f"--emit: unknown {', '.join(bad)}; choose from {', '.join(EMIT_CHOICES)}")
    module = load_module(a.TARGET, a.args)
    mesh = _mesh(a.mesh) if a.mesh else None
    exe = None
    compiler = None
    if any(e in emit for e in ("hlo", "stablehlo", "cost")):
        compiler = plugins.compiler()
        if compiler is None:
            raise FcirError("--emit hlo, stablehlo and cost need a compiling backend "
                            "(fcir.interpreters.xla); none is installed")
        exe = compiler.compile_program(module, mesh=mesh, clients_per_step=a.clients_per_step)
    if not a.output:
        if "ir" in emit:
            sys.stdout.write(module.to_text())
        for kind in ("hlo", "stablehlo"):
            if kind in emit:
                sys.stdout.write(exe.as_text(kind))
        if "cost" in emit:
            print(compiler.format_cost(exe.cost()))
        return 0
    out = pathlib.Path(a.output)
    if out.exists() and not out.is_dir():
        raise FcirError(f"-o {a.output}: exists and is not a directory; compile writes a "
                        "directory of files")
    out.mkdir(parents=True, exist_ok=True)
    written = []

    def write(name, data):
        path = out / name
        (path.write_bytes if isinstance(data, bytes) else path.write_text)(data)
        written.append(str(path))

    stem = module.name
    if "ir" in emit:
        write(f"{stem}.fcir", module.to_text(full_constants=True))
        write(f"{stem}.pb", module.serialize())
    if "hlo" in emit:
        write(f"{stem}.hlo.txt", exe.as_text("hlo"))
    if "stablehlo" in emit:
        write(f"{stem}.stablehlo.mlir", exe.as_text("stablehlo"))
    if "cost" in emit:
        cost = exe.cost()
        write(f"{stem}.cost.json", json.dumps(cost, indent=2, sort_keys=True) + "\n")
        table = compiler.format_cost(cost)
        write(f"{stem}.cost.txt", table + "\n")
        print(table)
    for w in written:
        print(f"wrote {w}")
    return 0


def _mesh(spec: str):
    import jax
    import numpy as np

    names, sizes = [], []
    for part in spec.split(","):
        name, _, size = part.partition("=")
        if not name.isidentifier() or not size.isdigit():
            raise _Usage(f"--mesh: expected NAME=SIZE[,NAME=SIZE], got {spec!r}")
        names.append(name)
        sizes.append(int(size))
    devices = jax.devices()
    total = int(np.prod(sizes))
    if total > len(devices):
        raise FcirError(f"--mesh {spec} needs {total} devices; {len(devices)} available")
    return jax.sharding.Mesh(np.array(devices[:total]).reshape(sizes), tuple(names))


def cmd_show(a) -> int:

    module = load_module(a.FILE, a.args, locations=a.locations)
    if a.format == "text":

        text = module.to_text(full_constants=a.full_constants, locations=a.locations)
        # As comments, so the output still parses as IR.
        try:
            notes = format_round_cost(round_cost(module))
        except FcirError as e:  # an ill-formed file is still shown, with why not costed
            notes = [f"privacy: not accounted: {e}"]
        text += "".join(f"// {line}\n" for line in notes)
    else:

        text = dot.to_dot(module) if a.format == "dot" else dot.to_svg(module)
    if a.output:
        pathlib.Path(a.output).write_text(text)
        print(f"wrote {a.output}")
    else:
        sys.stdout.write(text)
    return 0


def cmd_check(a) -> int:

    if is_ir_file(a.FILE):
        module = load_ir(a.FILE, located=True)  # each error names its line of the file
    else:
        module = _capture_unchecked(a.FILE, a.args)
    diags = verify(module)
    if not diags:
        print(f"@{module.name}: ok")
        return 0
    for d in diags:
        print(f"error: {d}")
    print(f"@{module.name}: {len(diags)} error(s)")
    return 1


def _capture_unchecked(target, specs):

    fn, args = load_python_target(target, specs)
    # With locations, so each error names the user's source line.
    return capture_unchecked(fn, *args, name=target.rpartition(":")[2], locations=True)


def cmd_diff(a) -> int:
    def text(target: str) -> str:
        # --args are the types of a Python target's arguments; an IR file has its own.
        return load_module(target, None if is_ir_file(target) else a.args).to_text()

    try:
        ta, tb = text(a.A), text(a.B)
    except KeyboardInterrupt:
        raise
    except Exception as e:  # exit 1 means "different": any failure to load is 2
        if a.debug:
            raise
        what = str(e) if isinstance(e, FcirError) else f"{type(e).__name__}: {e}"
        print(f"fcir diff: error: {what}{_at(e)}", file=sys.stderr)
        return 2
    if ta == tb:
        return 0
    sys.stdout.writelines(
        difflib.unified_diff(
            ta.splitlines(keepends=True), tb.splitlines(keepends=True), a.A, a.B,
            n=a.context,
        )
    )
    return 1


def cmd_run(a) -> int:

    backend = plugins.backend(a.backend)
    if a.clients_per_step is not None and not getattr(backend, "STREAMS", False):
        streaming = plugins.streaming_backends()
        raise _Usage(f"--clients-per-step streams members on the {' and '.join(streaming)} "
                     f"backend: add --backend {streaming[0]}" if streaming else
                     "--clients-per-step: no installed backend streams members")
    module, names = load_module_and_names(a.FILE, a.args)
    leaves = load_inputs(a.inputs, module, names)
    args = _unflatten_args(module, leaves)
    outputs = backend.run_program(module, args, clients_per_step=a.clients_per_step)
    _write_outputs(outputs, a.output)
    return 0


class _Usage(Exception):
    pass


def _clients_per_step(text: str):
    if text == "auto":
        return text
    try:
        k = int(text)
    except ValueError:
        k = 0
    if k < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer or 'auto', got {text!r}")
    return k


def _add_clients_per_step(p) -> None:
    p.add_argument("--clients-per-step", metavar="K", type=_clients_per_step, default=None,
                   help="xla: stream each fed.map K members at a time per device, reductions "
                   "as running sums ('auto': K from the device's memory)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="fcir",
        description="Capture, check, print, compile, run and export federated JAX programs.",
        epilog="Example: fcir compile examples/fedavg.py:fedavg_round -o out/",
    )
    parser.add_argument("--debug", action="store_true", help="show Python tracebacks on errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    p = sub.add_parser("compile", help="capture a program and write IR, HLO, StableHLO, cost",
                       description="Capture TARGET into the fcir IR and compile it with XLA.")
    _add_target(p)
    p.add_argument("-o", "--output", metavar="DIR", help="write files into DIR (else print)")
    p.add_argument("--emit", default="ir,hlo,stablehlo,cost",
                   help="comma-separated: ir, hlo, stablehlo, cost (default: all)")
    p.add_argument("--mesh", metavar="AXES", help="device mesh, e.g. clients=8 (default: none)")
    _add_clients_per_step(p)
    p.set_defaults(func=cmd_compile)

    p = sub.add_parser("show", help="print IR as text, or draw it (dot/svg)",
                       description="Print the canonical text of an IR file or Python target.")
    _add_target(p, "FILE")
    p.add_argument("--format", choices=("text", "dot", "svg"), default="text",
                   help="text: the canonical IR with the privacy cost as comments "
                   "(default); dot: the dataflow graph for graphviz; svg: that graph drawn "
                   "(needs graphviz's dot)")
    p.add_argument("--full-constants", action="store_true",
                   help="print every constant in full instead of type + sha256")
    p.add_argument("-o", "--output", metavar="FILE",
                   help="write the text, dot or svg to FILE (else print it)")
    p.add_argument("--locations", action="store_true",
                   help="text: print each op's source line, loc(\"file.py:12\") (Python "
                   "targets; errors name it without this flag)")
    p.set_defaults(func=cmd_show)

    p = sub.add_parser("check", help="type and placement check; exit 1 with the errors",
                       description="Check FILE's types and placements.")
    _add_target(p, "FILE")
    p.set_defaults(func=cmd_check)

    p = sub.add_parser("diff", help="diff two programs' IR: exit 0 same, 1 different, 2 error",
                       description="Unified diff of the canonical text of two programs: IR "
                       "files (text or binary) or Python targets, captured as `fcir show` "
                       "captures them. Exit 0 same, 1 different, 2 error.")
    p.add_argument("A", help="file.py:function, package.module:function, or an IR file "
                   "(.fcir text, .pb binary)")
    p.add_argument("B", help="the program to compare it with (any of the same)")
    p.add_argument("--args", nargs="+", metavar="SPEC",
                   help="argument types of each Python target, as `fcir compile --args` "
                   "takes them (default: the file's EXAMPLE_ARGS); IR files carry their own")
    p.add_argument("-U", "--context", type=int, default=3, help="lines of context (default 3)")
    p.set_defaults(func=cmd_diff)

    p = sub.add_parser("run", help="execute a program on a backend",
                       description="Run FILE with inputs from an .npz of flattened argument "
                       "leaves (arr_0, arr_1, ... as np.savez(*leaves) writes them).")
    _add_target(p, "FILE")
    p.add_argument("--backend", choices=plugins.backend_names(), default="reference",
                   help="'reference': the eager oracle, one Python step per member "
                   "(default); 'xla': compiled by XLA")
    p.add_argument("--inputs", required=True, metavar="IN.npz",
                   help="the argument leaves, written by "
                   "np.savez('IN.npz', *jax.tree_util.tree_leaves(args)); an error lists "
                   "the leaves FILE takes")
    p.add_argument("-o", "--output", metavar="OUT.npz",
                   help="write the output leaves (arr_0, arr_1, ...) to OUT.npz (else print "
                   "a preview of each)")
    _add_clients_per_step(p)
    p.set_defaults(func=cmd_run)

    plugins.register_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        try:
            return _main(argv)
        finally:
            # What is still buffered goes out here, inside the handler below, rather
            # than in the interpreter's own flush at exit.
            sys.stdout.flush()
    except BrokenPipeError:
        return _reader_left()


def _reader_left() -> int:
    """The reader of the output left before its end (``fcir diff A B | head``): exit 1
    with no traceback and no message, as Python's documentation recommends (its
    "Note on SIGPIPE"). Standard output goes to /dev/null, so that the interpreter's
    flush at exit does not fail on the closed pipe again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 1


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    # Errors name the command as typed, `fcir ckpt inspect`, as its usage errors do: a
    # command's subcommands are stored as `<command>_command` (ckpt_command, ...), each
    # set after its parent's.
    args.command = " ".join(
        filter(None, [args.command] + [v for k, v in vars(args).items()
                                       if k.endswith("_command") and isinstance(v, str)])
    )
    try:
        return int(args.func(args) or 0)
    except _Usage as e:
        parser.print_usage(sys.stderr)
        print(f"fcir {args.command}: error: {e}", file=sys.stderr)
        return 2
    except FcirError as e:
        if args.debug:
            raise
        print(f"fcir {args.command}: error: {e}{_at(e)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        raise  # the reader left: main's handler
    except Exception as e:  # user code failed while being traced or run: no traceback
        if args.debug:
            raise
        print(f"fcir {args.command}: error: {type(e).__name__}: {e}{_at(e)}\n(run with "
              "--debug for the traceback)", file=sys.stderr)
        return 1


def _at(error: BaseException) -> str:
    """`` (at file.py:12)``, the user's line an error was raised at while their program
    was traced or their file ran, which the traceback this command hides would show;
    empty when the message names it already or no frame is the user's."""
    if getattr(error, "fcir_located", False):
        return ""
    at = user_location(error)
    return f" (at {at})" if at and f"(at {at})" not in str(error) else ""


if __name__ == "__main__":
    sys.exit(main())
