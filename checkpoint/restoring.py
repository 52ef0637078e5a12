"""`restore`: each array read straight into the target sharding, only the local parts.

For every target leaf, each addressable device's block (one host buffer per distinct
block, shared by its replicas) is filled from the stored shards that overlap it, then
handed to its devices (on CPU without a copy: the buffers are 64-byte aligned, which
jax adopts) and assembled with `jax.make_array_from_single_device_arrays`. On CPU a
large block that is one contiguous run of a stored shard is not read at all but
mapped copy-on-write from the data file and verified there (reader.plan_mapped). No
array is ever gathered whole unless the caller asked for host numpy arrays.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax
import numpy as np
from fcir.checkpoint import keypaths, orbax, parallel, reader, shardings, storage, targets
from fcir.checkpoint.layout import dtype_from_name, read_layout
from fcir.checkpoint.progress_bar import Progress

from fcir._proto import checkpoint_pb2 as pb
from fcir.errors import CheckpointError

_SCALARS = (bool, int, float, complex)


class _Plan:
    """The read tasks of one restore, and their byte count for the progress bar."""

    def __init__(
        self, files: reader.DataFiles | reader.ObjectDataFiles, progress: Progress
    ) -> None:
        self.files = files
        self.progress = progress
        self.tasks: list[reader.Task] = []

    def read(self, record: pb.ArrayRecord, name: str, dests: list[tuple[Any, np.ndarray]]) -> None:
        self.tasks += reader.plan_array(self.files, record, name, dests, self.progress)
        self.progress.total += sum(buf.nbytes for _, buf in dests)


def restore(
    path: str | os.PathLike[str],
    target: Mapping[str, Any] | None = None,
    *,
    items: Iterable[str] | None = None,
    progress: bool | None = None,
    cast: bool = False,
) -> dict[str, Any]:
    """Restores a checkpoint's items; returns a dict of item name to value.

    `target` maps item names to pytrees whose leaves say what to build:
    `jax.ShapeDtypeStruct` with `.sharding` (or a `jax.Array`, or a bare
    `jax.sharding.Sharding`) gives a jax.Array in that sharding, which may differ from
    the saved one; a numpy array gives a numpy array; a Python scalar gives a scalar.
    Items without a target come back as host numpy arrays in nested dicts and lists.
    `items` restores only those items (default: the target's items, else all).
    `progress` shows a progress bar (None: on a terminal).

    A target leaf's dtype must be the saved one, as its shape must: a different dtype is
    a CheckpointError naming the array, unless `cast=True` asks to convert every leaf
    to its target's dtype (numpy's `astype`: restoring float32 into bfloat16 rounds,
    float into int truncates). Python scalar targets need a saved value of their kind
    (bool, integer, floating, complex).
    """
    # The arguments are checked before the format is known, so both formats refuse the
    # same mistakes (a string iterated as item names would ask for items "d", "e", ...).
    if target is not None and not isinstance(target, Mapping):
        raise CheckpointError(
            f"target must be a dict of item name to pytree, got {type(target).__name__}"
        )
    if isinstance(items, str):
        raise CheckpointError(f"items must be a list of item names, got the string {items!r}")
    directory = storage.locate(path)
    if orbax.is_orbax(directory):
        return orbax.restore(directory, target, items, cast)
    layout = read_layout(directory)
    by_name = {item.name: item for item in layout.items}
    if items is not None:
        names = list(items)
    elif target is not None:
        names = list(target)
    else:
        names = list(by_name)
    missing = [n for n in names if n not in by_name]
    if missing:
        raise CheckpointError(
            f"checkpoint {directory} has no item(s) {missing}; it has {list(by_name)}"
        )

    with reader.open_files(directory, layout) as files:
        plan = _Plan(files, Progress(f"restoring {directory.name}", 0, progress))
        builders: dict[str, Callable[[], Any]] = {}
        for name in names:
            item = by_name[name]
            if item.WhichOneof("value") == "json":
                builders[name] = _json_builder(name, item.json)
                continue
            records = {
                keypaths.match_key(keypaths.from_proto(r.path)): r for r in item.arrays.arrays
            }
            sub = target.get(name) if target is not None else None
            if sub is None:
                builders[name] = _plan_host_item(plan, name, item.arrays.arrays)
            else:
                builders[name] = _plan_target_item(plan, name, records, sub, cast)
        try:
            parallel.run_tasks(plan.tasks)
        finally:
            plan.progress.close()
    return {name: builders[name]() for name in names}


def _json_builder(name: str, text: str) -> Callable[[], Any]:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise CheckpointError(f"item {name!r}: stored JSON is corrupt ({e})") from e
    return lambda: value


def _plan_host_item(plan: _Plan, item: str, records: Iterable[pb.ArrayRecord]) -> Callable[[], Any]:
    pairs: list[tuple[keypaths.Path, np.ndarray, int, str]] = []
    for record in records:
        path = keypaths.from_proto(record.path)
        shape = tuple(record.shape)
        out = np.empty(shape, dtype_from_name(record.dtype))
        plan.read(record, keypaths.display(item, path), [((tuple(0 for _ in shape), shape), out)])
        pairs.append((path, out, record.kind, record.prng_key_impl))

    def build() -> Any:
        values = []
        for path, out, kind, impl in pairs:
            if impl:  # typed PRNG keys: numpy cannot hold them
                values.append((path, jax.random.wrap_key_data(out, impl=impl)))
            elif kind == pb.LEAF_KIND_PYTHON_SCALAR:
                values.append((path, out.item()))
            elif kind == pb.LEAF_KIND_NUMPY_SCALAR:
                values.append((path, out[()]))
            else:
                values.append((path, out))
        return keypaths.unflatten(values)

    return build


def _plan_target_item(
    plan: _Plan, item: str, records: dict[tuple[Any, ...], pb.ArrayRecord], sub: Any, cast: bool
) -> Callable[[], Any]:
    leaves, treedef = jax.tree_util.tree_flatten_with_path(sub)
    finishers = []
    for jax_path, leaf in leaves:
        key = keypaths.jax_match_key(jax_path)
        name = keypaths.display(item, key)
        record = records.get(key)
        if record is None:
            known = ", ".join(sorted(keypaths.display(item, k) for k in records)) or "none"
            raise CheckpointError(
                f"array {name!r} of the target is not in the checkpoint (it has: {known})"
            )
        finishers.append(_plan_leaf(plan, record, name, leaf, cast))
    return lambda: jax.tree_util.tree_unflatten(treedef, [f() for f in finishers])


def _plan_leaf(
    plan: _Plan, record: pb.ArrayRecord, name: str, leaf: Any, cast: bool
) -> Callable[[], Any]:
    if record.prng_key_impl:
        return _plan_key_leaf(plan, record, name, leaf)
    saved_shape = tuple(record.shape)
    saved_dtype = dtype_from_name(record.dtype)
    full = (tuple(0 for _ in saved_shape), saved_shape)
    if isinstance(leaf, jax.sharding.Sharding):
        return _plan_device_leaf(plan, record, name, saved_shape, saved_dtype, leaf)
    if isinstance(leaf, (jax.ShapeDtypeStruct, jax.Array)):
        shape = tuple(leaf.shape)
        targets.check_shape(name, shape, saved_shape)
        dtype = targets.check_dtype(name, leaf.dtype, saved_dtype, cast)
        sharding = getattr(leaf, "sharding", None)
        if sharding is None:
            sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        if not isinstance(sharding, jax.sharding.Sharding):
            raise CheckpointError(
                f"array {name!r}: target sharding {sharding!r} is not a jax.sharding.Sharding"
            )
        return _plan_device_leaf(plan, record, name, shape, dtype, sharding)
    if isinstance(leaf, (np.ndarray, np.generic)):
        targets.check_shape(name, tuple(np.shape(leaf)), saved_shape)
        targets.check_dtype(name, leaf.dtype, saved_dtype, cast)
        out = np.empty(saved_shape, saved_dtype)
        plan.read(record, name, [(full, out)])
        if isinstance(leaf, np.generic):
            return lambda: out.astype(leaf.dtype)[()]
        return lambda: out.astype(leaf.dtype, copy=False)
    if isinstance(leaf, _SCALARS):
        targets.check_shape(name, (), saved_shape)
        targets.check_scalar_kind(name, leaf, saved_dtype, cast)
        out = np.empty(saved_shape, saved_dtype)
        plan.read(record, name, [(full, out)])
        return lambda: type(leaf)(out.item())
    raise CheckpointError(
        f"array {name!r}: cannot restore into a target leaf of type {type(leaf).__name__}; use "
        "jax.ShapeDtypeStruct(shape, dtype, sharding=...), a jax.Array, a Sharding, a numpy "
        "array or a scalar"
    )


def _plan_key_leaf(plan: _Plan, record: pb.ArrayRecord, name: str, leaf: Any) -> Callable[[], Any]:
    """Typed PRNG keys: their key data restored as uint32, then wrapped back into keys."""
    impl, data_shape = record.prng_key_impl, tuple(record.shape)
    dtype = dtype_from_name(record.dtype)
    data_sharding = targets.key_data_sharding(name, leaf, impl, data_shape, dtype)
    build = _plan_device_leaf(plan, record, name, data_shape, dtype, data_sharding)
    return lambda: jax.random.wrap_key_data(build(), impl=impl)


def _plan_device_leaf(
    plan: _Plan,
    record: pb.ArrayRecord,
    name: str,
    shape: tuple[int, ...],
    dtype: np.dtype,
    sharding: jax.sharding.Sharding,
) -> Callable[[], jax.Array]:
    saved_dtype = dtype_from_name(record.dtype)
    blocks = shardings.device_boxes(name, shape, sharding)
    # On CPU jax adopts a host buffer as the array's memory, so a block that is one run
    # of a stored shard can be the data file's own (cached) pages: reader.plan_mapped.
    # On other devices a host buffer is only a staging copy; it is read as before.
    on_cpu = dtype == saved_dtype and all(
        d.platform == "cpu" for devs in blocks.values() for d in devs
    )
    bufs: list[np.ndarray] = []
    dests: list[tuple[shardings.Box, np.ndarray]] = []
    for box in blocks:
        mapped = (
            reader.plan_mapped(plan.files, record, name, box, plan.progress) if on_cpu else None
        )
        if mapped is not None:
            bufs.append(mapped[0])
            plan.tasks += mapped[1]
            plan.progress.total += mapped[0].nbytes
        else:
            dests.append((box, reader.aligned_empty(shardings.box_shape(box), saved_dtype)))
            bufs.append(dests[-1][1])
    if dests:
        plan.read(record, name, dests)

    def build() -> jax.Array:
        hosts, devices = [], []
        for buf, devs in zip(bufs, blocks.values()):
            host = buf if dtype == saved_dtype else buf.astype(dtype)
            for d in devs:
                hosts.append(host)
                devices.append(d)
        singles = jax.device_put(hosts, devices)
        return jax.make_array_from_single_device_arrays(shape, sharding, singles)

    return build
