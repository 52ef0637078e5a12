"""The example in docs/checkpoint.md runs as written."""

from __future__ import annotations

import re
import runpy

import pytest
from ckpt_testing import REPO


def python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, re.DOTALL)


def test_docs_object_store_example_runs_against_a_local_s3_server(tmp_path, devices, s3_server):
    from s3_testing import BUCKET, s3_env

    (block,) = re.findall(
        r"```python s3\n(.*?)```", (REPO / "docs" / "checkpoint.md").read_text(), re.DOTALL
    )
    with pytest.MonkeyPatch.context() as mp:
        for k, v in {**s3_env(s3_server), "FCIR_DOCS_S3_URL": f"s3://{BUCKET}/docs"}.items():
            mp.setenv(k, v)
        script = tmp_path / "example_s3.py"
        script.write_text(block)
        runpy.run_path(str(script), run_name="__main__")


def test_docs_page_example_runs(tmp_path, devices):
    blocks = python_blocks((REPO / "docs" / "checkpoint.md").read_text())
    assert blocks
    for i, block in enumerate(blocks):
        script = tmp_path / f"example{i}.py"
        script.write_text(block)
        runpy.run_path(str(script), run_name="__main__")
