"""The generated protobuf code in fcir/_proto is what tools/gen_protos.py makes now."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.jax_independent  # generated protobuf code

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_generated_code_is_fresh():
    result = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "gen_protos.py"), "--check"],
        capture_output=True, text=True, cwd=ROOT,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_field_has_a_must_or_may_comment():
    for proto in (ROOT / "protos" / "fcir" / "v1").rglob("*.proto"):
        lines = proto.read_text().splitlines()
        for i, line in enumerate(lines):
            stripped = line.strip()
            is_field = (
                stripped.endswith(";")
                and "=" in stripped
                and not stripped.startswith(("option", "syntax", "package", "import", "//"))
                and not stripped.split()[0].isupper()  # enum values
                and "reserved" not in stripped
            )
            if not is_field:
                continue
            block = []
            j = i - 1
            while j >= 0 and lines[j].strip().startswith("//"):
                block.append(lines[j])
                j -= 1
            comment = " ".join(block)
            assert "MUST" in comment or "MAY" in comment, f"{proto.name}:{i + 1}: {stripped}"
