"""A virtual environment with the real ``federated_language`` package, for wire tests.

federated_language 0.5.4 is pure Python but needs protobuf < 7, which fcir's own
environment does not have, so it lives in its own virtual environment (gitignored,
created once and reused; ``FCIR_FL_VENV`` puts it elsewhere, e.g. in a cache that
outlives clones)::

    python tests/production/fl_venv.py            # create or reuse; prints its python
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import venv

ROOT = pathlib.Path(__file__).resolve().parents[2]
DEFAULT_DIR = pathlib.Path(os.environ.get("FCIR_FL_VENV") or ROOT / ".venv-fl")
REQUIREMENTS = ("federated_language==0.5.4", "protobuf<7", "numpy")
MARKER = "fcir-ready.json"

# pip's words for "the package index cannot be reached".
_OFFLINE = (
    "Could not find a version that satisfies",
    "No matching distribution found",
    "NewConnectionError",
    "Max retries exceeded",
    "Temporary failure in name resolution",
    "Network is unreachable",
    "Connection refused",
    "ConnectTimeout",
    "ReadTimeout",
    "Failed to establish a new connection",
)


class Unreachable(RuntimeError):
    """PyPI (or the configured index) cannot be reached from here."""


def python_of(directory: pathlib.Path) -> pathlib.Path:
    return directory / ("Scripts/python.exe" if sys.platform == "win32" else "bin/python")


def ensure(directory: pathlib.Path = DEFAULT_DIR, timeout: float = 600) -> pathlib.Path:
    """The python of a virtual environment with ``REQUIREMENTS``, creating it if needed.

    Raises Unreachable when the packages cannot be downloaded, RuntimeError when the
    install fails for another reason.
    """
    python = python_of(directory)
    marker = directory / MARKER
    if python.is_file() and marker.is_file():
        try:
            if json.loads(marker.read_text()).get("requirements") == list(REQUIREMENTS):
                return python
        except (OSError, json.JSONDecodeError):
            pass
    if not python.is_file():
        venv.EnvBuilder(with_pip=True, clear=True).create(directory)
    cmd = [str(python), "-m", "pip", "install", "--disable-pip-version-check", "-q", *REQUIREMENTS]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        raise Unreachable(f"pip install {' '.join(REQUIREMENTS)} timed out") from None
    if proc.returncode != 0:
        output = proc.stdout + proc.stderr
        tail = " | ".join(output.strip().splitlines()[-3:])
        if any(word in output for word in _OFFLINE):
            raise Unreachable(f"cannot download {' '.join(REQUIREMENTS)}: {tail}")
        raise RuntimeError(f"pip install into {directory} failed: {tail}")
    marker.write_text(json.dumps({"requirements": list(REQUIREMENTS)}) + "\n")
    return python


if __name__ == "__main__":
    print(ensure(pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_DIR))
