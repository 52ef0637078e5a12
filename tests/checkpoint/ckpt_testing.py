"""Shared helpers of the checkpoint tests (also imported by their child processes)."""

from __future__ import annotations

import os
import pathlib
import socket

import numpy as np

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parent.parent


def child_env(device_count: int) -> dict[str, str]:
    """Environment for a child Python that imports this repo with `device_count` devices."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={device_count}"
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(HERE), env.get("PYTHONPATH", "")])
    env["JAX_PLATFORMS"] = "cpu"
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def values(shape: tuple[int, ...], dtype: str = "float32", seed: int = 0) -> np.ndarray:
    """Deterministic, distinct values (so a misplaced block never compares equal)."""
    import jax.numpy as jnp  # resolves ml_dtypes names such as "bfloat16"

    dt = np.dtype(jnp.dtype(dtype))
    rng = np.random.default_rng(seed)
    if dt.kind in "iu":
        return rng.integers(-100, 100, size=shape).astype(dt)
    if dt.kind == "b":
        return rng.integers(0, 2, size=shape).astype(bool)
    return rng.standard_normal(shape).astype(dt)


def same_bits(a: object, b: object) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def mapped_from(path: object) -> list[tuple[int, int]]:
    """The address ranges of this process's mappings of file `path` (/proc/self/maps)."""
    import os

    want = os.path.realpath(str(path))
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].strip() == want:
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                out.append((lo, hi))
    return out
