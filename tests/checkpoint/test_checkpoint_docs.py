"""The example in docs/checkpoint.md runs as written."""

from __future__ import annotations

import re
import runpy

from ckpt_testing import REPO


def python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, re.DOTALL)


def test_docs_page_example_runs(tmp_path, devices):
    blocks = python_blocks((REPO / "docs" / "checkpoint.md").read_text())
    assert blocks
    for i, block in enumerate(blocks):
        script = tmp_path / f"example{i}.py"
        script.write_text(block)
        runpy.run_path(str(script), run_name="__main__")
