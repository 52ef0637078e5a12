"""What every benchmark saves beside its printed table (see bench.md): the raw samples,
the versions that produced them and the machine, as one JSON file per run."""

from __future__ import annotations

import json
import os
import pathlib
import platform
import time
from importlib import metadata


def versions(*dists: str) -> dict[str, str | None]:
    """Installed versions of jax, jaxlib, numpy and each of ``dists``, plus Python's."""
    out: dict[str, str | None] = {}
    for name in ("jax", "jaxlib", "numpy", *dists):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    out["python"] = platform.python_version()
    return out


def machine() -> dict:
    """Core count and architecture: timings mean little without them."""
    return {"cores": os.cpu_count(), "machine": platform.machine()}


def write(out_dir, stem: str, result: dict, tag: str | None = None) -> pathlib.Path:
    """Writes ``result`` to ``out_dir/stem[-tag]-YYYYmmdd-HHMMSS.json`` and says where."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = pathlib.Path(out_dir) / f"{stem}{f'-{tag}' if tag else ''}-{stamp}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    print(f"\nraw samples: {path}")
    return path
