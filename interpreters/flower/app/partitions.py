"""Partitions of a data set as flwr-datasets' partitioners make them, without it.

flwr-datasets (``flwr_datasets.partitioner``) partitions Hugging Face ``datasets``
objects, which pulls in ``datasets`` and pyarrow; these have its partitioners' names,
parameters and semantics on a dict of numpy arrays (one leading example axis), offline.
This file is copied into every exported app (fcir_app/partitions.py), where a node
loads its partition of run config ``dataset`` (client_app.client_data); it imports
only numpy. fcir's ``interpreters.flower.data`` module exports the same classes.
"""

from __future__ import annotations

import warnings

import numpy as np


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

    def _labels(self) -> np.ndarray:
        """The array a by-label partitioner splits by (its ``partition_by``)."""
        if self._partition_by not in self.dataset:
            raise ValueError(f"the data set has no array {self._partition_by!r} to partition by")
        return self.dataset[self._partition_by]


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
        labels = self._labels()
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


class PathologicalPartitioner(Partitioner):
    """Each partition holds examples of ``num_classes_per_partition`` labels only, as
    flwr-datasets' PathologicalPartitioner: the labels (sorted) are assigned to
    partitions by ``class_assignment_mode`` (``"random"``: distinct labels drawn
    uniformly per partition; ``"deterministic"``: partition i gets labels i, i+1, ...
    modulo the number of labels; ``"first-deterministic"``: label i first, the rest
    drawn), then each label's examples are split into near-equal contiguous shares among
    the partitions that hold it (in partition order); with ``shuffle``, each partition's
    examples are shuffled. One ``numpy`` Generator seeded by ``seed`` draws everything.
    A label no partition drew is left out, as there."""

    MODES = ("random", "deterministic", "first-deterministic")

    def __init__(
        self,
        num_partitions: int,
        partition_by: str,
        num_classes_per_partition: int,
        class_assignment_mode: str = "random",
        shuffle: bool = True,
        seed: int | None = 42,
    ):
        super().__init__(num_partitions)
        if class_assignment_mode not in self.MODES:
            raise ValueError(f"class_assignment_mode must be one of {self.MODES}")
        if num_classes_per_partition < 1:
            raise ValueError("num_classes_per_partition must be at least 1")
        self._partition_by = partition_by
        self._k = num_classes_per_partition
        self._mode = class_assignment_mode
        self._shuffle = shuffle
        self._rng = np.random.default_rng(seed)

    def _split(self, rows: int) -> list[np.ndarray]:
        labels = self._labels()
        classes = np.unique(labels)
        c = len(classes)
        if self._k > c:
            raise ValueError(
                f"num_classes_per_partition={self._k} exceeds the {c} labels of the data set"
            )
        held = []
        for i in range(self._num_partitions):
            if self._mode == "deterministic":
                held.append([(i + j) % c for j in range(self._k)])
            elif self._mode == "first-deterministic":
                rest = [j for j in range(c) if j != i % c]
                held.append([i % c, *self._rng.choice(rest, self._k - 1, replace=False).tolist()])
            else:
                held.append(self._rng.choice(c, self._k, replace=False).tolist())
        parts: list[list[int]] = [[] for _ in range(self._num_partitions)]
        for j, k in enumerate(classes):
            owners = [i for i in range(self._num_partitions) if j in held[i]]
            if not owners:
                continue
            members = np.nonzero(labels == k)[0]
            for i, share in zip(owners, np.array_split(members, len(owners))):
                parts[i].extend(share.tolist())
        out = [np.sort(np.asarray(q, dtype=np.int64)) for q in parts]
        if self._shuffle:
            for q in out:
                self._rng.shuffle(q)
        return out


def pad(partition: dict, fields: list[str], specs: list[dict], what: str) -> list[np.ndarray]:
    """One node's client inputs from its partition: ``fields[j]`` (an array of the
    partition, or ``mask``: 1 for an example, 0 for padding) zero-padded along the
    example axis to client input j's rows, in its dtype."""
    n = _num_rows(partition)
    leaves = []
    for name, spec in zip(fields, specs):
        shape = tuple(spec["shape"])
        if not shape or shape[0] < n:
            raise ValueError(
                f"{what}: the partition holds {n} example(s), and client input "
                f"{name!r} takes {shape[0] if shape else 0} ({spec['type']}): export the "
                "round for at least the largest partition's size"
            )
        if name == "mask":
            x = np.ones((n,) + shape[1:])
        elif name in partition:
            x = np.asarray(partition[name])
        else:
            raise ValueError(f"{what}: dataset-fields names {name!r}, which the data set lacks "
                             f"(it has {sorted(partition)}; or 'mask')")
        if x.shape[1:] != shape[1:]:
            raise ValueError(f"{what}: {name!r} examples are {list(x.shape[1:])}, client "
                             f"input takes {list(shape[1:])} ({spec['type']})")
        out = np.zeros(shape, spec["dtype"])
        out[:n] = x
        leaves.append(out)
    return leaves


def make(name: str, num_partitions: int, *, partition_by: str, alpha: float,
         num_classes_per_partition: int, seed: int) -> Partitioner:
    """A partitioner by run config ``partitioner`` name."""
    if name == "iid":
        return IidPartitioner(num_partitions)
    if name == "dirichlet":
        return DirichletPartitioner(num_partitions, partition_by, alpha, seed=seed)
    if name == "pathological":
        return PathologicalPartitioner(num_partitions, partition_by, num_classes_per_partition,
                                       seed=seed)
    raise ValueError(f"partitioner={name!r}: iid, dirichlet or pathological")
