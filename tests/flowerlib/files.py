"""The npz files of an in-process Flower run: each node's data and the app's output."""

from __future__ import annotations

import pathlib

import numpy as np


def write_nodes(root, rows: list[list], first_id: int) -> dict[int, dict]:
    """Node ``first_id + i`` reads ``rows[i]`` (its client leaves) from ``root/n{i}.npz``:
    the node configs, by node id, that ``inprocess.run`` takes."""
    nodes = {}
    for i, leaves in enumerate(rows):
        path = pathlib.Path(root) / f"n{i}.npz"
        np.savez(path, *(np.asarray(x) for x in leaves))
        nodes[first_id + i] = {"partition-id": i, "data-path": str(path)}
    return nodes


def read_outputs(path) -> list:
    """The leaves an app wrote to its ``output`` file, in order."""
    with np.load(path) as f:
        return [f[f"arr_{i}"] for i in range(len(f.files))]
