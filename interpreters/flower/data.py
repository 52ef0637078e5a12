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
import warnings

import jax
import numpy as np

from fcir.errors import FcirError
from fcir.ir.types import SERVER, PlacedType

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


# --- partitioners (flwr_datasets.partitioner's names and semantics) ------------------------


def _num_rows(dataset: dict) -> int:
    sizes = {len(np.asarray(v)) for v in dataset.values()}
    if len(sizes) != 1:
        raise ValueError(f"the data set's arrays differ in length: {sorted(sizes)}")
    return sizes.pop()


class Partitioner:
    """A data set (``dict`` of arrays with one leading example axis) split into
    ``num_partitions`` partitions; ``load_partition(i)`` is partition i as such a dict."""

    def __init__(self, num_partitions: int):
        if num_partitions < 1:
            raise ValueError("The number of partitions needs to be greater than zero.")
        self._num_partitions = num_partitions
        self._dataset: dict | None = None
        self._indices: list[np.ndarray] | None = None

    @property
    def num_partitions(self) -> int:
        return self._num_partitions

    @property
    def dataset(self) -> dict:
        if self._dataset is None:
            raise AttributeError("no data set assigned: set partitioner.dataset = {...} first")
        return self._dataset

    @dataset.setter
    def dataset(self, value: dict) -> None:
        if self._dataset is not None:
            raise ValueError("the data set can be assigned only once")
        value = {k: np.asarray(v) for k, v in dict(value).items()}
        if _num_rows(value) < self._num_partitions:
            raise ValueError(
                "The number of partitions needs to be smaller than the number of samples in "
                "the dataset."
            )
        self._dataset = value

    def is_dataset_assigned(self) -> bool:
        return self._dataset is not None

    def partition_indices(self) -> list[np.ndarray]:
        """The example indices of every partition (computed once)."""
        if self._indices is None:
            self._indices = self._split(_num_rows(self.dataset))
        return self._indices

    def load_partition(self, partition_id: int) -> dict:
        idx = self.partition_indices()[partition_id]
        return {k: v[idx] for k, v in self.dataset.items()}

    def _split(self, rows: int) -> list[np.ndarray]:
        raise NotImplementedError


class IidPartitioner(Partitioner):
    """Contiguous shards of (near) equal size, as flwr-datasets' IidPartitioner takes
    them (``Dataset.shard(num_partitions, i, contiguous=True)``): shuffle the data set
    first (flwr-datasets' FederatedDataset does, with seed 42) for IID partitions."""

    def _split(self, rows: int) -> list[np.ndarray]:
        return np.array_split(np.arange(rows), self._num_partitions)


class DirichletPartitioner(Partitioner):
    """Label-skewed partitions (Yurochkin et al., 2019), as flwr-datasets'
    DirichletPartitioner: for each label (in order of first appearance), the fractions of its examples
    that go to each partition are drawn from Dirichlet(``alpha``) and the examples split
    at those cumulative fractions; with ``self_balancing``, a partition already holding
    more than the mean number of examples gets none of the later labels (the others'
    fractions renormalized). The draw is repeated (up to 10 more times, with a warning)
    until every partition has at least ``min_partition_size`` examples; then, with
    ``shuffle``, each partition's examples are shuffled. One ``numpy`` Generator seeded
    by ``seed`` draws everything. Smaller alpha: more skew."""

    def __init__(
        self,
        num_partitions: int,
        partition_by: str,
        alpha,
        min_partition_size: int = 10,
        self_balancing: bool = True,
        shuffle: bool = True,
        seed: int | None = 42,
    ):
        super().__init__(num_partitions)
        a = np.asarray(alpha, dtype=float).reshape(-1)
        if a.size == 1:
            a = np.repeat(a, num_partitions)
        if a.size != num_partitions:
            raise ValueError("alpha needs one value, or one per partition")
        if not (a > 0).all():
            raise ValueError(f"Alpha values should be strictly greater than zero, got {a}")
        self._alpha = a
        self._partition_by = partition_by
        self._min_partition_size = min_partition_size
        self._self_balancing = self_balancing
        self._shuffle = shuffle
        self._rng = np.random.default_rng(seed)

    def _split(self, rows: int) -> list[np.ndarray]:
        if self._partition_by not in self.dataset:
            raise ValueError(f"the data set has no array {self._partition_by!r} to partition by")
        labels = self.dataset[self._partition_by]
        # Labels in order of first appearance, as Dataset.unique gives them.
        _, first = np.unique(labels, return_index=True)
        classes = labels[np.sort(first)]
        mean = rows / self._num_partitions
        for attempt in range(11):
            parts: list[list[int]] = [[] for _ in range(self._num_partitions)]
            for k in classes:
                members = np.nonzero(labels == k)[0]
                p = self._rng.dirichlet(self._alpha)
                if self._self_balancing:
                    full = np.array([len(q) > mean for q in parts])
                    p = np.where(full, 0.0, p)
                    p = p / p.sum()
                cuts = (np.cumsum(p) * len(members)).astype(int)[:-1]
                for q, chunk in zip(parts, np.split(members, cuts)):
                    q.extend(chunk.tolist())
            smallest = min(len(q) for q in parts)
            if smallest >= self._min_partition_size:
                break
            if attempt == 10:
                raise ValueError(
                    f"no partitioning with min_partition_size={self._min_partition_size} after "
                    "11 draws: raise alpha or lower min_partition_size"
                )
            warnings.warn(
                f"min_partition_size={self._min_partition_size} not met (smallest partition: "
                f"{smallest}); drawing again",
                stacklevel=2,
            )
        out = [np.asarray(q, dtype=np.int64) for q in parts]
        if self._shuffle:
            for q in out:
                self._rng.shuffle(q)
        return out


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
