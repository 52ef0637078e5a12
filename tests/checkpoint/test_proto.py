"""The checkpoint layout schema: self-contained, versioned, documented, regenerated."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys
import tempfile

from ckpt_testing import REPO

from fcir._proto import checkpoint_pb2 as pb

PROTO = REPO / "protos" / "fcir" / "v1" / "checkpoint.proto"


def test_generated_module_is_up_to_date():
    import grpc_tools
    from grpc_tools import protoc

    include = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    with tempfile.TemporaryDirectory() as out:
        rc = protoc.main(
            [
                "protoc",
                f"-I{REPO / 'protos'}",
                f"-I{include}",
                f"--python_out={out}",
                "fcir/v1/checkpoint.proto",
            ]
        )
        assert rc == 0
        fresh = (pathlib.Path(out) / "fcir" / "v1" / "checkpoint_pb2.py").read_bytes()
    checked_in = (REPO / "fcir" / "_proto" / "checkpoint_pb2.py").read_bytes()
    assert fresh == checked_in, (
        "stale fcir/_proto/checkpoint_pb2.py; run: python tools/gen_protos.py"
    )


def test_schema_is_self_contained_in_package_fcir_v1():
    text = PROTO.read_text()
    assert "package fcir.v1;" in text
    assert not re.search(r"^\s*import ", text, re.MULTILINE)
    assert pb.DESCRIPTOR.package == "fcir.v1"


def test_every_field_says_must_or_may():
    lines = PROTO.read_text().splitlines()
    for i, line in enumerate(lines):
        if (
            re.match(r"\s*(repeated\s+)?[\w.]+\s+\w+\s*=\s*\d+;", line)
            and "UNSPECIFIED" not in line
        ):
            comment = []
            j = i - 1
            while j >= 0 and lines[j].strip().startswith("//"):
                comment.append(lines[j])
                j -= 1
            text = " ".join(comment)
            assert "MUST" in text or "MAY" in text, line


def test_layout_carries_a_version_field():
    assert pb.CheckpointLayout.DESCRIPTOR.fields_by_name["layout_version"].number == 1


def test_gen_protos_tool_agrees():
    done = subprocess.run(
        [sys.executable, str(REPO / "tools" / "gen_protos.py"), "--check"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert "checkpoint_pb2.py" not in done.stdout, done.stdout
