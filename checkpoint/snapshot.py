"""Phase 1 of a save: the host copy of the shards this process writes.

Only shards with replica id 0 are taken, so replicated data is written once, by the
process that holds its first replica; numpy arrays and Python scalars (the same on
every process) are written by process 0. On CPU devices device memory is host memory:
`np.asarray` of a shard is a zero-copy view that keeps the buffer alive, and jax will
not donate a buffer that has such a view, so no copy is needed. Elsewhere (TPU, GPU)
`take` starts every shard's device-to-host copy (`copy_to_host_async`) before any is
awaited, and returns without waiting: each shard's host bytes are awaited where they
are first needed (`ShardData.host()`), so a blocking save writes the first shards
while the later ones are still in transfer. An asynchronous save waits for them all
(`wait_host`) before it returns and starts writing.

`take` does only what must happen while the caller waits: it checks the tree (every
error about what is saved is raised by `save` itself) and pins the bytes. What only
the layout needs (sharding records, the shards' index boxes) is left to
`Snapshot.describe`, which the background phase calls: on the VMs this project runs
on, every page a call touches after a second of idle costs microseconds, so the
blocking part of an asynchronous save is as short as the code it runs.
"""

from __future__ import annotations

import dataclasses
import json
import math
import threading
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from fcir.checkpoint import keypaths, layout, shardings
from fcir.checkpoint.shardings import Box

from fcir._proto import checkpoint_pb2 as pb
from fcir.errors import CheckpointError

_PYTHON_SCALARS = (bool, int, float, complex)
#: Platforms whose device memory is host memory: their shards are pinned, not copied.
ZERO_COPY_PLATFORMS = ("cpu",)


@dataclasses.dataclass
class ShardData:
    box: Box | None  # None until Snapshot.describe() (then from `source`'s index)
    data: np.ndarray | None  # C-contiguous; None while its device-to-host copy runs
    source: Any = None  # the jax Shard the data came from; None for host values
    pending: Any = None  # the jax array whose host copy is in flight (data is None)
    nbytes: int = 0
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        if self.data is not None:
            self.data = np.ascontiguousarray(self.data)  # a no-op for device buffers
            self.nbytes = self.data.nbytes

    def host(self) -> np.ndarray:
        """The shard's bytes on the host (C-contiguous), once its copy has arrived.

        Writer threads call it for the shards they write, several at once."""
        data = self.data
        if data is None:
            with self._lock:  # one thread awaits the copy; the others take its result
                if self.data is None:
                    self.data = np.ascontiguousarray(np.asarray(self.pending))
                    self.pending = None
                data = self.data
        return data


@dataclasses.dataclass
class ArrayEntry:
    path: keypaths.Path
    name: str  # for people; "" until Snapshot.describe() for jax arrays
    shape: tuple[int, ...]
    dtype: np.dtype
    sharding: pb.Sharding | None  # None until Snapshot.describe()
    kind: int  # pb.LeafKind
    shards: list[ShardData]  # the ones this process writes
    prng_key_impl: str = ""  # set for typed PRNG keys, stored as their key data
    jax_sharding: Any = None  # the leaf's jax sharding (None: a host value)


@dataclasses.dataclass
class ItemEntry:
    name: str
    json: str | None  # set for metadata items
    arrays: list[ArrayEntry]


@dataclasses.dataclass
class Snapshot:
    items: list[ItemEntry]
    described: bool = False

    @property
    def nbytes(self) -> int:
        """Bytes this process will write."""
        return sum(s.nbytes for s in self.shards())

    def shards(self) -> list[ShardData]:
        """The shards this process writes, in the order the layout records them (their
        host copies may still be in flight: see ShardData.host)."""
        return [s for it in self.items for a in it.arrays for s in a.shards]

    def blocks(self) -> list[np.ndarray]:
        """The shards' bytes (C-contiguous) in the order the layout records them, once
        every host copy has arrived."""
        return [s.host() for s in self.shards()]

    def wait_host(self) -> None:
        """Returns once every shard's bytes are on the host."""
        self.blocks()

    def describe(self) -> Snapshot:
        """Fills in what only the layout needs: sharding records and shard boxes."""
        if self.described:
            return self
        for it in self.items:
            for a in it.arrays:
                a.name = a.name or keypaths.display(it.name, a.path)
                a.sharding = shardings.describe(a.jax_sharding, len(a.shape))
                for s in a.shards:
                    if s.source is not None:
                        s.box = shardings.box_of_index(s.source.index, a.shape)
                        s.source = None
                    elif s.box is None:
                        s.box = (tuple(0 for _ in a.shape), a.shape)
        self.described = True
        return self


def _json_text(value: Any) -> str | None:
    """The JSON text of `value` if it is made only of JSON types, else None."""

    def plain(v: Any) -> bool:
        if v is None or type(v) in (str, bool, int):
            return True
        if type(v) is float:
            return math.isfinite(v)
        if type(v) is list:
            return all(plain(x) for x in v)
        if type(v) is dict:
            return all(type(k) is str and plain(x) for k, x in v.items())
        return False

    return json.dumps(value, allow_nan=False) if plain(value) else None


#: dtypes already found savable, with their canonical numpy dtype (one dict lookup
#: instead of a round trip through the layout's dtype names on every save).
_SAVABLE: dict[Any, np.dtype] = {}


def _check_dtype(dtype: np.dtype, name: str) -> np.dtype:
    known = _SAVABLE.get(dtype)
    if known is not None:
        return known
    if dtype.kind in "OUSMm" or dtype.fields is not None:
        raise CheckpointError(f"array {name!r} has dtype {dtype}, which cannot be saved")
    try:
        canonical = layout.dtype_from_name(layout.dtype_name(dtype))
    except CheckpointError:
        raise CheckpointError(f"array {name!r} has dtype {dtype}, which cannot be saved") from None
    _SAVABLE[dtype] = canonical
    return canonical


#: jax dtypes that are plain (neither PRNG keys nor other extended dtypes), with the
#: numpy dtype they are saved as.
_PLAIN_JAX: dict[Any, np.dtype] = {}


def take(tree: Mapping[str, Any], process_index: int, copy_host_values: bool) -> Snapshot:
    """Checks `tree` and starts copying (or pins) to host every shard this process writes.

    `copy_host_values` copies numpy leaves, which the caller may mutate while an
    asynchronous save is still writing them. Device-to-host copies are started, not
    awaited: `wait_host()` (or each shard's `host()`) waits for them. The result is not
    described yet: call `describe()` before reading `sharding` or the shards' `box`.
    """
    if not isinstance(tree, Mapping):
        raise CheckpointError(
            f"a checkpoint is a dict of named items, got {type(tree).__name__}; "
            "wrap it, e.g. {'state': tree}"
        )
    items: list[ItemEntry] = []
    pending: list[jax.Array] = []
    for item_name, value in tree.items():
        if not isinstance(item_name, str) or not item_name:
            raise CheckpointError(f"item names must be non-empty strings, got {item_name!r}")
        text = _json_text(value)
        if text is not None:
            items.append(ItemEntry(item_name, text, []))
            continue
        arrays = []
        for path, leaf in keypaths.flatten(value, item_name):
            arrays.append(_entry(path, item_name, leaf, process_index, copy_host_values, pending))
        items.append(ItemEntry(item_name, None, arrays))
    # Every device-to-host copy is started before any is awaited (ShardData.host), so
    # they run back to back on the device's transfer engines while earlier ones are
    # being written.
    for shard_array in pending:
        shard_array.copy_to_host_async()
    return Snapshot(items)


def _entry(
    path: keypaths.Path,
    item_name: str,
    leaf: Any,
    process_index: int,
    copy_host_values: bool,
    pending: list[jax.Array],
) -> ArrayEntry:
    if isinstance(leaf, jax.Array):
        key_impl = ""
        dtype = _PLAIN_JAX.get(leaf.dtype)
        if dtype is None:
            name = keypaths.display(item_name, path)
            if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
                if leaf.is_deleted():
                    raise CheckpointError(f"array {name!r} has been deleted (was it donated?)")
                key_impl = str(jax.random.key_impl(leaf))
                leaf = jax.random.key_data(leaf)  # same sharding, plus the key's own dims
                dtype = _check_dtype(np.dtype(leaf.dtype), name)
            elif jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.extended):
                raise CheckpointError(f"array {name!r} has extended dtype {leaf.dtype}")
            else:
                dtype = _PLAIN_JAX[leaf.dtype] = _check_dtype(np.dtype(leaf.dtype), name)
        if leaf.is_deleted():
            name = keypaths.display(item_name, path)
            raise CheckpointError(f"array {name!r} has been deleted (was it donated?)")
        entry = ArrayEntry(
            path, "", leaf.shape, dtype, None, pb.LEAF_KIND_JAX_ARRAY, [], key_impl, leaf.sharding
        )
        shards = leaf.addressable_shards
        # One platform per array.
        pinned = bool(shards) and shards[0].device.platform in ZERO_COPY_PLATFORMS
        for shard in shards:
            if shard.replica_id != 0:
                continue
            if pinned:
                entry.shards.append(ShardData(None, np.asarray(shard.data), shard))
            else:
                array = shard.data
                entry.shards.append(ShardData(None, None, shard, array, array.nbytes))
                pending.append(array)
        return entry
    name = keypaths.display(item_name, path)
    if isinstance(leaf, np.ndarray):
        kind = pb.LEAF_KIND_NUMPY_ARRAY
        host = np.array(leaf, copy=True) if copy_host_values else np.ascontiguousarray(leaf)
    elif isinstance(leaf, np.generic):
        kind = pb.LEAF_KIND_NUMPY_SCALAR
        host = np.asarray(leaf)
    elif isinstance(leaf, _PYTHON_SCALARS):
        kind = pb.LEAF_KIND_PYTHON_SCALAR
        if type(leaf) is int and not -(2**63) <= leaf < 2**63:
            raise CheckpointError(f"integer {name!r} does not fit in int64")
        host = np.asarray(leaf)
    else:
        raise CheckpointError(
            f"leaf {name!r} is a {type(leaf).__name__}; a checkpoint holds jax arrays, numpy "
            "arrays and scalars (metadata items may be JSON: dicts, lists, str, numbers)"
        )
    if host.dtype.byteorder == ">":  # stored little-endian
        host = host.astype(host.dtype.newbyteorder("<"))
    dtype = _check_dtype(host.dtype, name)
    shape = tuple(host.shape)
    shards = [ShardData(None, host)] if process_index == 0 else []
    return ArrayEntry(path, name, shape, dtype, None, kind, shards)
