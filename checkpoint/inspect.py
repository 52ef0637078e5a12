"""`fcir ckpt inspect DIR`: a checkpoint's items, arrays, shardings and sizes; checks integrity.

Mount it in a larger CLI as a subcommand:

    sub = ckpt_subparsers.add_parser("inspect", help=inspect.HELP, description=inspect.DESCRIPTION)
    inspect.add_arguments(sub)
    sub.set_defaults(func=inspect.run)   # run(args) -> exit code

or run it alone: `python -m fcir.checkpoint.inspect DIR`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import sys
import threading
import traceback
from collections.abc import Sequence
from typing import TextIO

from fcir.checkpoint import keypaths, layout, orbax, parallel, reader, shardings, storage
from fcir.checkpoint.progress_bar import Progress
from google.protobuf import json_format

from fcir._proto import checkpoint_pb2 as pb
from fcir.errors import CheckpointError

HELP = "print a checkpoint's layout: arrays, shapes, shardings, bytes, integrity"
DESCRIPTION = (
    "Print the items and arrays of a checkpoint (key path, dtype, shape, sharding, stored "
    "shards and bytes) and verify it: every data file must have the size the layout says "
    "and every stored byte must match its checksum."
)
EPILOG = (
    "exit status: 0 the checkpoint is intact; 1 it is damaged, partial or unreadable; "
    "2 usage error (bad option, DIR does not exist)."
)


def add_arguments(parser: argparse.ArgumentParser, *, debug_flag: bool = True) -> None:
    """Adds the subcommand's arguments. Pass debug_flag=False if the parent CLI owns --debug."""
    parser.add_argument(
        "directory",
        metavar="DIR",
        help="checkpoint directory or URL (s3://, gs://, file://) holding layout.pb",
    )
    parser.add_argument(
        "--no-verify", action="store_true", help="only print the layout; do not read the data"
    )
    parser.add_argument(
        "--shards",
        action="store_true",
        help="also list every data file, and every stored shard: index range, file, offset, bytes",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="print the layout (protobuf JSON mapping) and the integrity result as JSON",
    )
    if debug_flag:
        parser.add_argument(
            "--debug", action="store_true", help="show a Python traceback when something fails"
        )
    parser.epilog = parser.epilog or EPILOG


def build_parser(prog: str = "fcir ckpt inspect") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=DESCRIPTION, epilog=EPILOG)
    add_arguments(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs `fcir ckpt inspect` with `argv` (default: sys.argv[1:]); returns the exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse exits 2 on usage errors and 0 after --help
        return e.code if isinstance(e.code, int) else 2
    return run(args)


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Runs the subcommand on parsed arguments; returns the exit status."""
    out = out if out is not None else sys.stdout
    try:
        directory = storage.locate(args.directory)
    except CheckpointError as e:
        print(f"fcir ckpt inspect: error: {e}", file=sys.stderr)
        return 2
    if isinstance(directory, pathlib.Path) and not directory.is_dir():
        what = "does not exist" if not directory.exists() else "is not a directory"
        print(f"fcir ckpt inspect: error: {directory} {what}", file=sys.stderr)
        return 2
    if orbax.is_orbax(directory):
        return _run_orbax(directory, args, out)
    try:
        lay = layout.read_layout(directory)
        problems, verified = ([], 0) if args.no_verify else verify(directory, lay)
    except (CheckpointError, OSError) as e:
        return _failed(args, e)
    if args.json:
        doc = {
            "directory": str(directory),
            "layout": json_format.MessageToDict(lay),
            "integrity": None
            if args.no_verify
            else {"ok": not problems, "bytes_verified": verified, "problems": problems},
        }
        out.write(json.dumps(doc, indent=2) + "\n")
    else:
        _print_layout(directory, lay, args.shards, out)
        if args.no_verify:
            out.write("\nintegrity: not checked (--no-verify)\n")
        elif problems:
            out.write(f"\nintegrity: FAILED ({len(problems)} problem(s))\n")
            for p in problems:
                out.write(f"  {p}\n")
        else:
            shard_count = sum(len(a.shards) for item in lay.items for a in item.arrays.arrays)
            out.write(
                f"\nintegrity: OK ({len(lay.files)} file(s), {shard_count} shard(s), "
                f"{_size(verified)} verified)\n"
            )
    return 1 if problems else 0


def _failed(args: argparse.Namespace, error: Exception) -> int:
    """Reports what failed while reading a checkpoint (the traceback with ``--debug``);
    returns the exit status 1."""
    if getattr(args, "debug", False):
        traceback.print_exc()
    else:
        print(f"fcir ckpt inspect: error: {error}", file=sys.stderr)
    return 1


def _run_orbax(directory: storage.Location, args: argparse.Namespace, out: TextIO) -> int:
    """An Orbax checkpoint: its items and arrays; reads every array unless --no-verify."""
    try:
        described = orbax.describe(directory)
        nbytes = 0
        if not args.no_verify:
            nbytes = orbax.read_all(directory)
    except CheckpointError as e:
        return _failed(args, e)
    if args.json:
        doc = {
            "directory": str(directory),
            "format": "orbax",
            "items": {
                name: [
                    {"path": p, "dtype": dt, "shape": list(shape), "storage": st}
                    for p, dt, shape, st in rows
                ]
                for name, rows in described
            },
            "integrity": None if args.no_verify else {"ok": True, "bytes_read": nbytes},
        }
        out.write(json.dumps(doc, indent=2) + "\n")
        return 0
    out.write(f"checkpoint {directory}\n  format: Orbax (no fcir layout)\n")
    for name, rows in described:
        out.write(f"\nitem {name}: {len(rows)} array(s)\n")
        table = [("path", "dtype", "shape", "storage")] + [
            (p, dt, "[" + ", ".join(map(str, shape)) + "]", st) for p, dt, shape, st in rows
        ]
        widths = [max(len(r[i]) for r in table) for i in range(4)]
        out.writelines(
            "  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() + "\n" for r in table
        )
    if args.no_verify:
        out.write("\nintegrity: not checked (--no-verify)\n")
    else:
        out.write(
            f"\nintegrity: every array read ({_size(nbytes)}); Orbax stores no checksums, "
            "so damage inside a chunk is not detected\n"
        )
    return 0


def verify(directory: storage.Location, lay: pb.CheckpointLayout) -> tuple[list[str], int]:
    """Reads every stored byte and checks it; returns the problems found and bytes read."""
    problems: list[str] = []
    lock = threading.Lock()
    present = set(directory.list()) if isinstance(directory, storage.ObjectStore) else None
    for f in lay.files:
        if present is not None:
            if f.name not in present:
                problems.append(f"data file {f.name} is missing")
            continue
        path = directory / f.name
        if not path.is_file():
            problems.append(f"data file {f.name} is missing")
        elif path.stat().st_size != f.size_bytes:
            problems.append(
                f"data file {f.name} has {path.stat().st_size} bytes, the layout says {f.size_bytes}"
            )
    tasks = []
    total = 0
    bar = Progress(f"verifying {directory.name}", 0)
    files = reader.open_files(directory, lay)
    chunk = lay.checksum_chunk_bytes
    piece = max(chunk, reader.PIECE_BYTES // chunk * chunk)
    for item in lay.items:
        for record in item.arrays.arrays:
            name = keypaths.display(item.name, keypaths.match_key(keypaths.from_proto(record.path)))
            for shard in record.shards:
                for start in range(0, shard.length, piece):
                    stop = min(start + piece, shard.length)
                    tasks.append(
                        _check(files, shard, chunk, start, stop, name, problems, lock, bar)
                    )
                    total += stop - start
    bar.total = total
    try:
        parallel.run_tasks(tasks)
    finally:
        files.close()
        bar.close()
    return problems, total


def _check(
    files: reader.DataFiles | reader.ObjectDataFiles,
    shard: pb.ShardRecord,
    chunk: int,
    start: int,
    stop: int,
    name: str,
    problems: list[str],
    lock: threading.Lock,
    bar: Progress,
) -> reader.Task:
    def run() -> None:
        buf = bytearray(stop - start)
        try:
            reader.read_range(files, shard, chunk, start, stop, memoryview(buf), name)
        except CheckpointError as e:
            with lock:
                if str(e) not in problems:
                    problems.append(str(e))
        bar.advance(stop - start)

    return run


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


#: Up to this many data files are listed one per line; more (an Orbax-format checkpoint
#: has a chunk file per shard) are counted, and `--shards` lists them.
_LISTED_FILES = 8


def _print_files(lay: pb.CheckpointLayout, shards: bool, out: TextIO) -> None:
    total = _size(sum(f.size_bytes for f in lay.files))
    if len(lay.files) > _LISTED_FILES and not shards:
        out.write(f"  files: {len(lay.files)}, {total} in all (--shards lists each)\n")
        return
    out.write(f"  files: {len(lay.files)}, {total} in all\n")
    width = max((len(f.name) for f in lay.files), default=0)
    out.writelines(f"    {f.name.ljust(width)}  {_size(f.size_bytes)}\n" for f in lay.files)


def _print_layout(
    directory: storage.Location, lay: pb.CheckpointLayout, shards: bool, out: TextIO
) -> None:
    when = ""
    if lay.commit_time_unix:
        stamp = datetime.datetime.fromtimestamp(lay.commit_time_unix, datetime.UTC)
        when = f", committed {stamp:%Y-%m-%d %H:%M:%S} UTC"
    out.write(f"checkpoint {directory}\n")
    if isinstance(directory, pathlib.Path) and (directory / orbax.CHECKPOINT_METADATA).is_file():
        out.write("  format: Orbax (zarr v2 chunks), with fcir's layout and checksums\n")
    out.write(
        f"  layout v{lay.layout_version}, {lay.num_processes} process(es){when}\n"
        f"  writer: {lay.writer or 'unknown'}\n"
    )
    _print_files(lay, shards, out)
    for item in lay.items:
        if item.WhichOneof("value") == "json":
            text = item.json if len(item.json) <= 70 else item.json[:67] + "..."
            out.write(f"\nitem {item.name}: JSON {text}\n")
            continue
        arrays = item.arrays.arrays
        nbytes = sum(layout.array_bytes(a) for a in arrays)
        out.write(f"\nitem {item.name}: {len(arrays)} array(s), {_size(nbytes)}\n")
        rows = [("path", "dtype", "shape", "sharding", "shards", "bytes")]
        for a in arrays:
            rows.append(
                (
                    keypaths.display(item.name, keypaths.match_key(keypaths.from_proto(a.path))),
                    a.dtype,
                    "[" + ", ".join(map(str, a.shape)) + "]",
                    shardings.to_text(a.sharding),
                    str(len(a.shards)),
                    _size(layout.array_bytes(a)),
                )
            )
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        out.writelines(
            "  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() + "\n" for r in rows
        )
        if shards:
            for a in arrays:
                name = keypaths.display(item.name, keypaths.match_key(keypaths.from_proto(a.path)))
                out.write(f"  shards of {name}:\n")
                for s in a.shards:
                    box = "[" + ", ".join(f"{r.start}:{r.stop}" for r in s.index) + "]"
                    out.write(
                        f"    {box} {lay.files[s.file].name} @{s.offset} {_size(s.length)} "
                        f"(process {s.process_index})\n"
                    )


if __name__ == "__main__":
    sys.exit(main())
