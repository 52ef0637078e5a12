"""Regenerates the Python protobuf modules in fcir/_proto from protos/.

    python tools/gen_protos.py           # rewrite fcir/_proto/*_pb2.py
    python tools/gen_protos.py --check   # exit 1 if the checked-in code is stale

Each .proto under protos/ is self-contained (no imports between our own files), so the
generated modules live flat in fcir/_proto/ named after their .proto file.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTOS = ROOT / "protos"
OUT = ROOT / "fcir" / "_proto"


def generate(out_dir: pathlib.Path) -> dict[str, bytes]:
    """Runs protoc on every .proto and returns {module file name: contents}."""
    import grpc_tools
    from grpc_tools import protoc  # dev dependency (grpcio-tools), pinned in pyproject

    include = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    sources = sorted(str(p.relative_to(PROTOS)) for p in PROTOS.rglob("*.proto"))
    rc = protoc.main(
        ["protoc", f"-I{PROTOS}", f"-I{include}", f"--python_out={out_dir}", *sources]
    )
    if rc != 0:
        raise SystemExit(f"protoc failed with exit code {rc}")
    files = {}
    for path in sorted(out_dir.rglob("*_pb2.py")):
        files[path.name] = path.read_bytes()
    return files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report staleness")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        files = generate(pathlib.Path(tmp))
    existing = {p.name: p.read_bytes() for p in OUT.glob("*_pb2.py")}
    if args.check:
        stale = sorted(n for n in files.keys() | existing.keys() if files.get(n) != existing.get(n))
        if stale:
            print("stale generated protobuf code: " + ", ".join(stale))
            print("run: python tools/gen_protos.py")
            return 1
        return 0
    OUT.mkdir(parents=True, exist_ok=True)
    for name in existing.keys() - files.keys():
        (OUT / name).unlink()
    for name, data in files.items():
        (OUT / name).write_bytes(data)
    print(f"wrote {len(files)} module(s) to {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
