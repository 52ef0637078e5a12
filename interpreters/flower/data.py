"""Data for an exported app: the server's inputs file, one file per node, and label
partitions of an in-memory data set.

::

    from fcir.interpreters.flower import data

    data.split_arguments(module, args, "parts/")   # parts/server_inputs.npz, parts/node<i>.npz
    p = data.DirichletPartitioner(num_partitions=3, partition_by="label", alpha=0.5)
    p.dataset = {"x": x, "label": y}                # arrays with one leading example axis
    part0 = p.load_partition(0)                     # {"x": ..., "label": ...}

``split_arguments`` writes what ``fcir export --target flower --inputs`` (or run config
``inputs``) and ``fcir flower up/simulate --data`` read: the server argument leaves in
leaf order, and for client i its slice ``leaf[i]`` of every client argument leaf.

The partitioners have the names, parameters and semantics of flwr-datasets'
(``flwr_datasets.partitioner``), which work on Hugging Face ``datasets`` objects; these
work on a dict of numpy arrays, offline, without that dependency. A round's client
arguments have one shape for every client, so partitions of different sizes go through
``pad_partitions``: each padded to the largest with a 0/1 ``mask`` (a weight).
"""

from __future__ import annotations

import pathlib

import jax
import numpy as np

from fcir.errors import FcirError
from fcir.ir.types import SERVER, PlacedType

# The partitioners live in the app package, which nodes run without fcir.
from .app.partitions import (
    DirichletPartitioner,
    IidPartitioner,
    Partitioner,
    PathologicalPartitioner,
    _num_rows,
)

SERVER_FILE = "server_inputs.npz"


def _is_client(t) -> bool:
    return isinstance(t, PlacedType) and t.placement != SERVER


def split_arguments(module, args, directory) -> tuple[pathlib.Path, list[pathlib.Path]]:
    """Writes ``directory/server_inputs.npz`` (the server argument leaves) and
    ``directory/node<i>.npz`` (client i's slice of each client argument leaf), for
    ``args`` the round's arguments (a pytree as the program takes them). Returns the
    paths. The clients are the round's (its placement's cardinality)."""
    params = module.main.body.params
    leaves = [np.asarray(x) for x in jax.tree.leaves(args)]
    if len(leaves) != len(params):
        raise FcirError(
            f"@{module.name} takes {len(params)} argument leaves; the arguments hold {len(leaves)}"
        )
    server, client, n = [], [], 0
    for i, (x, v) in enumerate(zip(leaves, params)):
        if _is_client(v.type):
            n = module.cardinality(v.type.placement)
            if x.ndim == 0 or x.shape[0] != n:
                raise FcirError(
                    f"argument leaf {i} is client data ({v.type}) but has shape {list(x.shape)}: "
                    f"its first axis must be the {n} clients"
                )
            client.append(x)
        else:
            server.append(x)
    out = pathlib.Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    server_path = out / SERVER_FILE
    np.savez(server_path, *server)
    nodes = []
    for i in range(n):
        p = out / f"node{i}.npz"
        np.savez(p, *(x[i] for x in client))
        nodes.append(p)
    return server_path, nodes



__all__ = [
    "DirichletPartitioner",
    "IidPartitioner",
    "Partitioner",
    "PathologicalPartitioner",
    "pad_partitions",
    "split_arguments",
]


def pad_partitions(partitions: list[dict], size: int | None = None) -> dict:
    """Partitions (dicts of arrays) stacked into client arguments of one shape: each key
    becomes ``[num_partitions, size, ...]``, zero-padded, beside ``mask``
    ``float32[num_partitions, size]`` (1 for an example, 0 for padding). ``size``:
    default the largest partition's."""
    sizes = [_num_rows(p) for p in partitions]
    size = max(sizes) if size is None else size
    if size < max(sizes):
        raise ValueError(f"size={size} is smaller than the largest partition ({max(sizes)})")
    out = {}
    for key in partitions[0]:
        first = np.asarray(partitions[0][key])
        arr = np.zeros((len(partitions), size) + first.shape[1:], first.dtype)
        for i, p in enumerate(partitions):
            arr[i, : sizes[i]] = p[key]
        out[key] = arr
    mask = np.zeros((len(partitions), size), np.float32)
    for i, s in enumerate(sizes):
        mask[i, :s] = 1.0
    out["mask"] = mask
    return out
