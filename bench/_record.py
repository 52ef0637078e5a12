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


def write(
    out_dir, stem: str, result: dict, tag: str | None = None, path: pathlib.Path | None = None
) -> pathlib.Path:
    """Writes ``result`` to ``out_dir/stem[-tag]-YYYYmmdd-HHMMSS.json`` and says where;
    with ``path`` (what an earlier call returned), over that file, saying nothing (a
    benchmark that saves its record after each part)."""
    if path is None:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        path = pathlib.Path(out_dir) / f"{stem}{f'-{tag}' if tag else ''}-{stamp}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        print(f"\nraw samples: {path}")
    path.write_text(json.dumps(result, indent=1))
    return path


def out_of_memory(error: BaseException) -> dict | None:
    """What a benchmark records for a system whose compile or run ran out of the
    device's memory: the first error in ``error``'s chain with a RESOURCE_EXHAUSTED
    status, as ``xla.compile``'s budget search reads it (an accelerator's compiler
    refuses a program over its memory; a run can fail to allocate), as ``{"status":
    "out of memory", "asked_bytes": what it says it asked for (or None), "message"}``.
    None for any other error, which the benchmark lets propagate."""
    from fcir.interpreters.xla.memory_budget import out_of_memory as read

    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        probe = read(error)
        if probe is not None:
            return {"status": "out of memory", "asked_bytes": probe.peak, "message": probe.message}
        error = error.__cause__ or error.__context__
    return None


def describe(record: dict) -> str:
    """An ``out_of_memory`` record as a table cell: ``out of memory (20.27 GiB asked)``."""
    asked = record.get("asked_bytes")
    return "out of memory" + ("" if asked is None else f" ({asked / 2**30:.2f} GiB asked)")
