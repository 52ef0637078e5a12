"""Orbax checkpoints both ways: reading Orbax's PyTree/Standard format, writing one.

Reading (`restore`): an Orbax checkpoint directory holds `_METADATA` (the tree: each
leaf's key path and kind) and one array per leaf, stored as zarr v2 or v3, either in
an OCDBT key-value database (`manifest.ocdbt`, Orbax's default) or as a directory per
leaf. tensorstore opens each array and reads exactly the boxes the target's devices
need. A CheckpointManager step (`<step>/<item>/_METADATA`) has one such directory per
item.

Writing (`format="orbax"`): every leaf is a zarr v2 array without compression, one
chunk per stored shard, so a chunk file holds exactly the shard's bytes in C order and
fcir writes it as it writes its own data files. fcir's `layout.pb` sits beside
Orbax's metadata and names those chunk files as its data files, with their
checksums, so `fcir.checkpoint.restore` verifies every byte while Orbax's
StandardCheckpointer reads the same files as its own.
"""

from __future__ import annotations

import ast
import base64
import json
import pathlib
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax
import numpy as np
from fcir.checkpoint import keypaths, shardings, targets
from fcir.checkpoint.layout import LAYOUT_FILE, dtype_from_name
from fcir.checkpoint.storage import ObjectStore

from fcir._proto import checkpoint_pb2 as pb
from fcir.errors import CheckpointError

METADATA = "_METADATA"
CHECKPOINT_METADATA = "_CHECKPOINT_METADATA"
#: Orbax's commit marker where nothing can be renamed (object stores), written last.
COMMIT_SUCCESS = "commit_success.txt"
_STANDARD = "orbax.checkpoint._src.handlers.standard_checkpoint_handler.StandardCheckpointHandler"
_JSON = "orbax.checkpoint._src.handlers.json_checkpoint_handler.JsonCheckpointHandler"
_JSON_FILE = "metadata"  # JsonCheckpointHandler's default file name
_SEQUENCE, _DICT = 1, 2  # orbax's key_type values


# -- which format ----------------------------------------------------------------------


Where = pathlib.Path | ObjectStore  # a local directory or an object-store prefix


def _has(where: Where, name: str) -> bool:
    if isinstance(where, ObjectStore):
        return where.exists(name)
    return (where / name).is_file()


def _text(where: Where, name: str) -> str:
    if isinstance(where, ObjectStore):
        data = where.read(name)
        if data is None:
            raise OSError(f"{where}/{name} does not exist")
        return data.decode()
    return (where / name).read_text()


def _kvstore(where: Where) -> dict[str, Any]:
    if isinstance(where, ObjectStore):
        return where.kvstore_spec()
    return {"driver": "file", "path": f"{where}/"}


def is_orbax(directory: Where) -> bool:
    """Whether `directory` is an Orbax checkpoint (and not an fcir one)."""
    if _has(directory, LAYOUT_FILE):
        return False
    return bool(items(directory))


def items(directory: Where) -> dict[str, Where]:
    """The Orbax items of `directory`: itself as "default", or its item subfolders."""
    if isinstance(directory, ObjectStore):
        keys = set(directory.list())
        if METADATA in keys:
            return {"default": directory}
        subs = sorted(
            {
                k.split("/")[0]
                for k in keys
                if k.count("/") == 1 and k.split("/")[1] in (METADATA, _JSON_FILE)
            }
        )
        return {name: directory / name for name in subs}
    if (directory / METADATA).is_file():
        return {"default": directory}
    out: dict[str, Where] = {}
    try:
        entries = sorted(directory.iterdir())
    except OSError:
        return {}
    for sub in entries:
        if (sub / METADATA).is_file() or (sub / _JSON_FILE).is_file():
            out[sub.name] = sub
    return out


def check_committed(directory: Where) -> None:
    """Refuses an Orbax checkpoint in an object store that Orbax has not finished.

    Where nothing can be renamed Orbax writes straight into the final prefix and
    `commit_success.txt` last (in the step, for a manager's item folders); before it,
    the objects are a save in progress or a dead one's, and reading them would give a
    mix of old and new or missing arrays.
    """
    if not isinstance(directory, ObjectStore) or directory.exists(COMMIT_SUCCESS):
        return
    step, _, _ = directory.prefix.rpartition("/")
    if step and ObjectStore(directory.scheme, directory.bucket, step).exists(COMMIT_SUCCESS):
        return
    raise CheckpointError(
        f"{directory} is not a committed Orbax checkpoint: it has no {COMMIT_SUCCESS}, "
        "which Orbax writes last in an object store (the save is still running, or it "
        "was interrupted)"
    )


# -- reading ---------------------------------------------------------------------------


#: Orbax's value types of leaves without data (None, empty containers), as it restores them.
_EMPTY_VALUES: dict[str, Callable[[], Any]] = {
    "None": lambda: None,
    "Dict": dict,
    "List": list,
    "Tuple": tuple,
    "NamedTuple": dict,  # objects come back as dicts of their fields
}
#: Where Orbax records, per process, what it stored about each array (PRNG key impls).
_ARRAY_METADATAS = "array_metadatas"
#: Orbax's record of each array's sharding (base64 param name -> JSON text).
_SHARDING_FILE = "_sharding"


class _Leaf:
    def __init__(
        self, keys: tuple[str, ...], kinds: tuple[int, ...], value: Mapping[str, Any]
    ) -> None:
        self.keys, self.kinds = keys, kinds
        self.value_type = str(value["value_type"])
        # None leaves and empty subtrees are in the tree metadata but have no array.
        self.has_data = not value.get("skip_deserialize") and self.value_type not in _EMPTY_VALUES
        self.key_impl = ""  # set for typed PRNG keys, stored as their key data

    @property
    def param(self) -> str:
        return ".".join(self.keys)


def _key_impls(item_dir: Where) -> dict[str, str]:
    """Param name -> PRNG implementation, for the typed keys Orbax saved as key data."""
    if isinstance(item_dir, ObjectStore):
        names = [k for k in item_dir.list(f"{_ARRAY_METADATAS}/") if k.count("/") == 1]
    else:
        folder = item_dir / _ARRAY_METADATAS
        names = [f"{_ARRAY_METADATAS}/{f.name}" for f in sorted(folder.glob("process_*"))]
    impls: dict[str, str] = {}
    for name in names:
        for entry in json.loads(_text(item_dir, name)).get("array_metadatas", []):
            meta = entry.get("array_metadata") or {}
            impl = (meta.get("ext_metadata") or {}).get("random_key_impl")
            if impl:
                impls[str(meta["param_name"])] = str(impl)
    return impls


def _tree_metadata(item_dir: Where) -> tuple[list[_Leaf], dict[str, Any]]:
    try:
        doc = json.loads(_text(item_dir, METADATA))
        leaves = []
        for text, entry in doc["tree_metadata"].items():
            meta = entry.get("key_metadata")
            if meta:
                keys = tuple(str(k["key"]) for k in meta)
                kinds = tuple(int(k.get("key_type", _DICT)) for k in meta)
            else:
                keys = tuple(str(k) for k in ast.literal_eval(text))
                kinds = (_DICT,) * len(keys)
            leaves.append(_Leaf(keys, kinds, entry["value_metadata"]))
        impls = _key_impls(item_dir)
    except (OSError, ValueError, KeyError, TypeError, SyntaxError, AttributeError) as e:
        raise CheckpointError(f"{item_dir}: Orbax {METADATA} is unreadable ({e})") from e
    for leaf in leaves:
        leaf.key_impl = impls.get(leaf.param, "")
    return leaves, doc


def _open_array(item_dir: Where, doc: dict[str, Any], leaf: _Leaf, name: str) -> Any:
    import tensorstore as ts

    driver = "zarr3" if doc.get("use_zarr3") else "zarr"
    if _has(item_dir, "manifest.ocdbt"):
        spec = {
            "driver": driver,
            "kvstore": {"driver": "ocdbt", "base": _kvstore(item_dir)},
            "path": leaf.param,
        }
    else:
        spec = {"driver": driver, "kvstore": _kvstore(item_dir / leaf.param)}
    try:
        return ts.open(spec, open=True, read=True).result()
    except Exception as e:  # tensorstore's status as ValueError
        raise CheckpointError(f"array {name!r}: cannot open it in {item_dir}: {e}") from e


def _read(store: Any, box: shardings.Box, name: str) -> np.ndarray:
    try:
        return store[shardings.to_slices(box)[:-1] or ()].read(order="C").result()
    except Exception as e:
        raise CheckpointError(f"array {name!r}: reading it failed: {e}") from e


def restore(
    directory: Where, target: Mapping[str, Any] | None, names: Iterable[str] | None, cast: bool
) -> dict[str, Any]:
    """Restores the items of an Orbax checkpoint; see `fcir.checkpoint.restore`."""
    check_committed(directory)
    found = items(directory)
    if names is None:
        names = list(target) if target is not None else list(found)
    names = list(names)
    missing = [n for n in names if n not in found]
    if missing:
        raise CheckpointError(
            f"Orbax checkpoint {directory} has no item(s) {missing}; it has {list(found)}"
        )
    out = {}
    for name in names:
        item_dir = found[name]
        if not _has(item_dir, METADATA):
            try:
                out[name] = json.loads(_text(item_dir, _JSON_FILE))
            except (OSError, ValueError) as e:
                raise CheckpointError(f"{item_dir}: Orbax JSON item is unreadable ({e})") from e
            continue
        sub = target.get(name) if target is not None else None
        out[name] = _restore_item(item_dir, name, sub, cast)
    return out


def _host_value(item_dir: Where, doc: dict[str, Any], leaf: _Leaf, name: str) -> Any:
    """A leaf as Orbax gives it without a target: numpy, a scalar, keys, or empty."""
    if not leaf.has_data:
        return _EMPTY_VALUES.get(leaf.value_type, lambda: None)()
    store = _open_array(item_dir, doc, leaf, name)
    value = _read(store, ((0,) * store.ndim, tuple(store.shape)), name)
    if leaf.key_impl:  # numpy cannot hold typed keys
        targets.key_layout(name, leaf.key_impl, value.shape)
        return jax.random.wrap_key_data(value, impl=leaf.key_impl)
    return value.item() if leaf.value_type == "scalar" else value


def _restore_item(item_dir: Where, item: str, sub: Any, cast: bool) -> Any:
    leaves, doc = _tree_metadata(item_dir)
    if sub is None:
        pairs = []
        for leaf in leaves:
            path = tuple(
                (
                    int(k) if kind == _SEQUENCE else k,
                    pb.CONTAINER_KIND_LIST if kind == _SEQUENCE else pb.CONTAINER_KIND_DICT,
                )
                for k, kind in zip(leaf.keys, leaf.kinds)
            )
            name = keypaths.display(item, leaf.keys)
            pairs.append((path, _host_value(item_dir, doc, leaf, name)))
        return keypaths.unflatten(pairs)
    by_keys = {leaf.keys: leaf for leaf in leaves if leaf.has_data}
    flat, treedef = jax.tree_util.tree_flatten_with_path(sub)
    values = []
    for jax_path, target_leaf in flat:
        keys = tuple(str(k) for k in keypaths.jax_match_key(jax_path))
        name = keypaths.display(item, keys)
        leaf = by_keys.get(keys)
        if leaf is None:
            known = ", ".join(sorted(keypaths.display(item, k) for k in by_keys)) or "none"
            raise CheckpointError(
                f"array {name!r} of the target is not in the checkpoint (it has: {known})"
            )
        store = _open_array(item_dir, doc, leaf, name)
        values.append(_target_value(store, leaf, name, target_leaf, cast))
    return jax.tree_util.tree_unflatten(treedef, values)


def _target_value(store: Any, leaf: _Leaf, name: str, target_leaf: Any, cast: bool) -> Any:
    saved_shape, saved_dtype = tuple(store.shape), np.dtype(store.dtype.numpy_dtype)
    full = ((0,) * len(saved_shape), saved_shape)
    if leaf.key_impl:
        sharding = targets.key_data_sharding(
            name, target_leaf, leaf.key_impl, saved_shape, saved_dtype
        )
        data = _device_array(store, name, saved_shape, saved_dtype, sharding)
        return jax.random.wrap_key_data(data, impl=leaf.key_impl)
    if isinstance(target_leaf, jax.sharding.Sharding):
        return _device_array(store, name, saved_shape, saved_dtype, target_leaf)
    if isinstance(target_leaf, (jax.ShapeDtypeStruct, jax.Array)):
        shape = tuple(target_leaf.shape)
        targets.check_shape(name, shape, saved_shape)
        dtype = targets.check_dtype(name, target_leaf.dtype, saved_dtype, cast)
        sharding = getattr(target_leaf, "sharding", None) or jax.sharding.SingleDeviceSharding(
            jax.local_devices()[0]
        )
        return _device_array(store, name, shape, dtype, sharding)
    if isinstance(target_leaf, (np.ndarray, np.generic)):
        targets.check_shape(name, tuple(np.shape(target_leaf)), saved_shape)
        targets.check_dtype(name, target_leaf.dtype, saved_dtype, cast)
        got = _read(store, full, name).astype(target_leaf.dtype, copy=False)
        return got[()] if isinstance(target_leaf, np.generic) else got
    if isinstance(target_leaf, (bool, int, float, complex)):
        targets.check_shape(name, (), saved_shape)
        targets.check_scalar_kind(name, target_leaf, saved_dtype, cast)
        return type(target_leaf)(_read(store, full, name).item())
    raise CheckpointError(
        f"array {name!r}: cannot restore into a target leaf of type {type(target_leaf).__name__}"
    )


def _device_array(
    store: Any, name: str, shape: tuple[int, ...], dtype: np.dtype, sharding: jax.sharding.Sharding
) -> jax.Array:
    """Reads only the boxes of this process's devices (each distinct box once)."""
    blocks = shardings.device_boxes(name, shape, sharding)
    futures = {}
    for box in blocks:
        try:
            futures[box] = store[shardings.to_slices(box)[:-1] or ()].read(order="C")
        except Exception as e:
            raise CheckpointError(f"array {name!r}: reading it failed: {e}") from e
    hosts, devices = [], []
    for box, devs in blocks.items():
        try:
            host = np.asarray(futures[box].result()).astype(dtype, copy=False)
        except Exception as e:
            raise CheckpointError(f"array {name!r}: reading it failed: {e}") from e
        for d in devs:
            hosts.append(host)
            devices.append(d)
    return jax.make_array_from_single_device_arrays(shape, sharding, jax.device_put(hosts, devices))


def describe(
    directory: Where,
) -> list[tuple[str, list[tuple[str, str, tuple[int, ...], str]]]]:
    """For `fcir ckpt inspect`: each item's arrays as (path, dtype, shape, storage)."""
    check_committed(directory)
    out = []
    for name, item_dir in items(directory).items():
        if not _has(item_dir, METADATA):
            out.append((name, [("(JSON)", "json", (), "metadata file")]))
            continue
        leaves, doc = _tree_metadata(item_dir)
        storage = ("OCDBT, " if _has(item_dir, "manifest.ocdbt") else "") + (
            "zarr v3" if doc.get("use_zarr3") else "zarr v2"
        )
        rows = []
        for leaf in leaves:
            if not leaf.has_data:
                continue
            label = keypaths.display(name, leaf.keys)
            store = _open_array(item_dir, doc, leaf, label)
            dtype, shape = np.dtype(store.dtype.numpy_dtype).name, tuple(store.shape)
            if leaf.key_impl:  # the keys, as they restore, rather than their key data
                shape, key_dtype = targets.key_layout(label, leaf.key_impl, shape)
                dtype = str(key_dtype)
            rows.append((label, dtype, shape, storage))
        out.append((name, rows))
    return out


def read_all(directory: Where) -> int:
    """Reads every array of an Orbax checkpoint (what decoding can check); returns bytes."""
    total = 0
    for name, item_dir in items(directory).items():
        if not _has(item_dir, METADATA):
            continue
        leaves, doc = _tree_metadata(item_dir)
        for leaf in (leaf for leaf in leaves if leaf.has_data):
            label = keypaths.display(name, leaf.keys)
            store = _open_array(item_dir, doc, leaf, label)
            total += _read(store, ((0,) * store.ndim, tuple(store.shape)), label).nbytes
    return total


# -- writing ---------------------------------------------------------------------------


def param_name(path: keypaths.Path) -> str:
    return ".".join(str(k) for k, _ in path)


def chunk_file(item_dir: str, path: keypaths.Path, box: shardings.Box) -> str:
    """Where the zarr v2 chunk of the shard at `box` lives (its chunk shape is the box's)."""
    extents = shardings.box_shape(box)
    index = [a // e if e else 0 for a, e in zip(box[0], extents)]
    return f"{item_dir}{param_name(path)}/{'.'.join(map(str, index)) or '0'}"


def item_prefix(name: str, several: bool) -> str:
    return f"{name}/" if several else ""


def check_items(tree: Mapping[str, Any]) -> None:
    if not isinstance(tree, Mapping) or not tree:
        raise CheckpointError("format='orbax' needs a dict of items, e.g. {'default': tree}")


def _value_type(kind: int) -> str:
    if kind == pb.LEAF_KIND_PYTHON_SCALAR:
        return "scalar"
    if kind == pb.LEAF_KIND_JAX_ARRAY:
        return "jax.Array"
    return "np.ndarray"


def _zarr_dtype(dtype: np.dtype) -> str:
    if dtype.name in ("bfloat16",) or dtype.name.startswith("float8"):
        return dtype.name
    return np.dtype(dtype).newbyteorder("<").str if dtype.itemsize > 1 else np.dtype(dtype).str


#: An Orbax tree-metadata key: (key, Orbax key_type) per step.
OrbaxKeys = tuple[tuple[str, int], ...]


def _empty_type(node: Any) -> str | None:
    """Orbax's value type for a node without leaves, or None for any other node."""
    if node is None:
        return "None"
    if isinstance(node, tuple) and not node:
        # Orbax records an empty namedtuple (optax's EmptyState) as None.
        return "None" if hasattr(node, "_fields") else "Tuple"
    if isinstance(node, list) and not node:
        return "List"
    if isinstance(node, dict) and not node:
        return "Dict"
    return None


def empty_nodes(tree: Mapping[str, Any]) -> dict[str, list[tuple[OrbaxKeys, str]]]:
    """Each item's None leaves and empty containers, which hold no array.

    fcir's layout has no record for them, but Orbax's tree metadata lists them, and
    Orbax's restore into an abstract state (an optax state always holds EmptyState())
    checks that the two trees have the same structure.
    """
    out: dict[str, list[tuple[OrbaxKeys, str]]] = {}
    for name, sub in tree.items():
        flat, _ = jax.tree_util.tree_flatten_with_path(
            sub, is_leaf=lambda x: _empty_type(x) is not None
        )
        found = []
        for jax_path, node in flat:
            kind = _empty_type(node)
            if kind is None or not jax_path:
                continue
            keys = tuple(
                (str(k), _SEQUENCE if isinstance(e, jax.tree_util.SequenceKey) else _DICT)
                for k, e in zip(keypaths.jax_match_key(jax_path), jax_path)
            )
            found.append((keys, kind))
        out[name] = found
    return out


def _sharding_text(sharding: pb.Sharding) -> str | None:
    """Orbax's record of an array's sharding, which its restore without a target uses.

    A single device becomes a one-device mesh: Orbax finds single devices by their
    names (`str(device)`, which differs between platforms), but meshes by device id.
    """
    which = sharding.WhichOneof("kind")
    if which == "single_device":
        shape, names, ids = [1], ["_"], [sharding.single_device.device_id]
        spec: list[Any] = []
    elif which == "named" and sharding.named.device_ids:
        named = sharding.named
        shape = [a.size for a in named.mesh_axes]
        names = [a.name for a in named.mesh_axes]
        ids = list(named.device_ids)
        spec = [
            None if not d.axes else d.axes[0] if len(d.axes) == 1 else list(d.axes)
            for d in named.spec
        ]
    else:
        return None  # host values need none; other shardings have no Orbax record
    mesh = np.array([{"id": int(i)} for i in ids], dtype=object).reshape(shape).tolist()
    return json.dumps(
        {
            "sharding_type": "NamedSharding",
            "shape": shape,
            "axis_names": names,
            "partition_spec": spec,
            "device_mesh": {"mesh": mesh},
        }
    )


def in_item_folders(layout: pb.CheckpointLayout) -> bool:
    """Whether a saved layout has its items in subfolders, read from its chunk files' names.

    Several items always are. A single item is when fcir's CheckpointManager saved it
    (as Orbax's manager does), and is not after a plain `save` or in a step an older
    fcir manager wrote.
    """
    if len(layout.items) > 1:
        return True
    for item in layout.items:
        for record in item.arrays.arrays:
            for s in record.shards:
                box = (tuple(r.start for r in s.index), tuple(r.stop for r in s.index))
                path = keypaths.from_proto(record.path)
                return layout.files[s.file].name == chunk_file(f"{item.name}/", path, box)
    return True  # a lone JSON item is written only into its subfolder


def metadata_files(
    layout: pb.CheckpointLayout,
    empties: Mapping[str, list[tuple[OrbaxKeys, str]]] | None = None,
    item_folders: bool | None = None,
) -> dict[str, bytes]:
    """Orbax's metadata for the merged layout: relative path -> content.

    `empties` (from `empty_nodes`) adds the tree's None leaves and empty containers.
    `item_folders` puts even a single item in its subfolder, as Orbax's CheckpointManager
    lays out a step (None: as the layout's chunk files are, see `in_item_folders`).
    """
    if item_folders is None:
        item_folders = in_item_folders(layout)
    several = item_folders or len(layout.items) > 1
    files: dict[str, bytes] = {}
    handlers: dict[str, str] = {}
    now = time.time_ns()
    for item in layout.items:
        prefix = item_prefix(item.name, several)
        if item.WhichOneof("value") == "json":
            if not several:
                raise CheckpointError(
                    f"format='orbax': item {item.name!r} holds only JSON values; Orbax stores "
                    "such an item in a folder beside array items (save several items, or "
                    "use a CheckpointManager) or as arrays"
                )
            files[f"{prefix}{_JSON_FILE}"] = item.json.encode()
            handlers[item.name] = _JSON
            continue
        handlers[item.name] = _STANDARD
        files.update(_array_item_files(item, prefix, (empties or {}).get(item.name, [])))
    checkpoint_meta = {
        "item_handlers": handlers if several else handlers[layout.items[0].name],
        "metrics": {},
        "performance_metrics": {},
        "init_timestamp_nsecs": now,
        "commit_timestamp_nsecs": now,
        "custom_metadata": {},
    }
    files[CHECKPOINT_METADATA] = json.dumps(checkpoint_meta).encode()
    return files


def _array_item_files(item, prefix: str, empties) -> dict[str, bytes]:
    """Orbax's files of one item of arrays: each array's .zarray, then the item's array
    metadatas, shardings and tree metadata (``empties``: its None leaves and empty
    containers)."""
    files: dict[str, bytes] = {}
    tree: dict[str, Any] = {}
    array_metadatas = []
    shardings_doc: dict[str, str] = {}
    for record in item.arrays.arrays:
        path = keypaths.from_proto(record.path)
        chunk = _even_chunk(record, keypaths.display(item.name, path))
        files[f"{prefix}{param_name(path)}/.zarray"] = _zarray(record, chunk)
        tree[str(tuple(str(k) for k, _ in path))] = _tree_entry(record, path, chunk)
        if record.kind == pb.LEAF_KIND_JAX_ARRAY:
            # Orbax wraps key data back into typed keys only where this says so.
            impl = {"random_key_impl": record.prng_key_impl} if record.prng_key_impl else None
            array_metadatas.append(
                {
                    "array_metadata": {
                        "param_name": param_name(path),
                        "write_shape": list(chunk),
                        "chunk_shape": list(chunk),
                        "ext_metadata": impl,
                    }
                }
            )
            sharding = _sharding_text(record.sharding)
            if sharding is not None:
                param = param_name(path).encode()
                shardings_doc[base64.urlsafe_b64encode(param).decode()] = sharding
    for orbax_keys, kind in empties:
        tree[str(tuple(k for k, _ in orbax_keys))] = {
            "key_metadata": [{"key": k, "key_type": t} for k, t in orbax_keys],
            "value_metadata": {"value_type": kind, "skip_deserialize": True},
        }
    if array_metadatas:
        files[f"{prefix}{_ARRAY_METADATAS}/process_0"] = json.dumps(
            {"array_metadatas": array_metadatas}
        ).encode()
    if shardings_doc:
        files[f"{prefix}{_SHARDING_FILE}"] = json.dumps(shardings_doc).encode()
    files[f"{prefix}{METADATA}"] = json.dumps(
        {
            "tree_metadata": tree,
            "use_ocdbt": False,
            "use_zarr3": False,
            "store_array_data_equal_to_fill_value": True,
            "custom_metadata": None,
        }
    ).encode()
    return files


def _even_chunk(record, name: str) -> tuple[int, ...]:
    """The one shard shape of ``record``'s shards: Orbax's zarr chunks must be equal."""
    boxes = [
        (tuple(r.start for r in s.index), tuple(r.stop for r in s.index)) for s in record.shards
    ]
    chunk = shardings.box_shape(boxes[0])
    for box in boxes:
        if shardings.box_shape(box) != chunk or any(e and a % e for a, e in zip(box[0], chunk)):
            raise CheckpointError(
                f"format='orbax': array {name!r} is split into shards of different "
                "shapes; Orbax's zarr chunks must be equal (shard it evenly)"
            )
    return chunk


def _zarray(record, chunk: tuple[int, ...]) -> bytes:
    """The array's zarr v2 header."""
    return json.dumps(
        {
            "chunks": [max(1, c) for c in chunk],
            "compressor": None,
            "dimension_separator": ".",
            "dtype": _zarr_dtype(dtype_from_name(record.dtype)),
            "fill_value": None,
            "filters": None,
            "order": "C",
            "shape": list(record.shape),
            "zarr_format": 2,
        }
    ).encode()


def _tree_entry(record, path, chunk: tuple[int, ...]) -> dict[str, Any]:
    """The array's entry in the item's tree metadata: its keys and value kind."""
    keys = [
        {
            "key": str(k),
            "key_type": _SEQUENCE
            if c in (pb.CONTAINER_KIND_LIST, pb.CONTAINER_KIND_TUPLE)
            else _DICT,
        }
        for k, c in path
    ]
    value: dict[str, Any] = {"value_type": _value_type(record.kind), "skip_deserialize": False}
    if record.kind == pb.LEAF_KIND_JAX_ARRAY:
        value["write_shape"] = list(chunk)
    return {"key_metadata": keys, "value_metadata": value}


def commit_success_text(final: str) -> bytes:
    """The content Orbax writes into its commit marker."""
    return f"Checkpoint commit was successful to {final}".encode()
