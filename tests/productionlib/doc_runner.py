"""Runs the code blocks of a Markdown page and checks the outputs it shows.

```python blocks run in order in one namespace; ```sh blocks run in a shell with
``fcir`` meaning this Python's ``python -m fcir.cli``. A ```text block right after a
code block shows that block's output and must equal it. Everything runs in a fresh
temporary directory.

    python tests/productionlib/doc_runner.py docs/production.md            # check
    python tests/productionlib/doc_runner.py docs/production.md --update   # rewrite outputs
"""

from __future__ import annotations

import contextlib
import io
import os
import pathlib
import re
import shlex
import subprocess
import sys
import tempfile

_BLOCK = re.compile(r"^```(\w+)\n(.*?)^```\n", re.DOTALL | re.MULTILINE)


def blocks(text: str) -> list[tuple[str, str, int, int]]:
    """(language, body, start, end) of every fenced block."""
    return [(m.group(1), m.group(2), m.start(2), m.end(2)) for m in _BLOCK.finditer(text)]


def _sh(body: str, cwd: str) -> str:
    out = []
    fcir = f"{shlex.quote(sys.executable)} -m fcir.cli"
    for line in body.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        cmd = re.sub(r"^fcir\b", fcir, line.strip())
        proc = subprocess.run(
            cmd, shell=True, cwd=cwd, capture_output=True, text=True, timeout=600, check=False
        )
        if proc.returncode != 0 and "# fails" not in line:
            raise AssertionError(f"`{line}` exited {proc.returncode}:\n{proc.stderr}")
        out.append(proc.stdout + proc.stderr)
    return "".join(out)


def run(path: pathlib.Path, update: bool = False) -> list[str]:
    """Runs the page; returns mismatch descriptions (empty: all outputs match)."""
    text = path.read_text()
    found = blocks(text)
    namespace: dict = {"__name__": "__doc__"}
    problems, replacements = [], []
    old_cwd = os.getcwd()
    with tempfile.TemporaryDirectory() as tmp:
        os.chdir(tmp)
        try:
            last_output = None
            for lang, body, start, end in found:
                if lang == "python":
                    buf = io.StringIO()
                    with contextlib.redirect_stdout(buf):
                        exec(  # noqa: S102  (running the page's examples is the point)
                            compile(body, f"{path}:{text[:start].count(chr(10)) + 1}", "exec"),
                            namespace,
                        )
                    last_output = buf.getvalue()
                elif lang == "sh":
                    last_output = _sh(body, tmp)
                elif lang == "text" and last_output is not None:
                    if body != last_output:
                        line = text[:start].count("\n") + 1
                        problems.append(
                            f"{path}:{line}: shown output differs from the real one:"
                            f"\n--- shown\n{body}--- real\n{last_output}"
                        )
                        replacements.append((start, end, last_output))
                    last_output = None
                else:
                    last_output = None
        finally:
            os.chdir(old_cwd)
    if update and replacements:
        for start, end, new in sorted(replacements, reverse=True):
            text = text[:start] + new + text[end:]
        path.write_text(text)
    return problems


if __name__ == "__main__":
    page = pathlib.Path(sys.argv[1])
    issues = run(page, update="--update" in sys.argv)
    for issue in issues:
        print(issue)
    sys.exit(1 if issues and "--update" not in sys.argv else 0)
