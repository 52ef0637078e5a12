"""jax shardings as layout records, and the index-box arithmetic of shards."""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np

from fcir._proto import checkpoint_pb2 as pb
from fcir.errors import CheckpointError

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (starts, stops), half-open per dimension


def describe(sharding: jax.sharding.Sharding | None, ndim: int) -> pb.Sharding:
    """The layout record of `sharding`; None means the value lived on the host."""
    if sharding is None:
        return pb.Sharding(host=pb.HostValue())
    if isinstance(sharding, jax.sharding.NamedSharding):
        mesh = sharding.mesh
        spec = list(sharding.spec) + [None] * (ndim - len(sharding.spec))
        dims = []
        for entry in spec[:ndim]:
            if entry is None or entry is jax.sharding.PartitionSpec.UNCONSTRAINED:
                dims.append(pb.DimSharding())
            elif isinstance(entry, str):
                dims.append(pb.DimSharding(axes=[entry]))
            else:
                dims.append(pb.DimSharding(axes=list(entry)))
        device_ids = []
        devices = getattr(mesh, "devices", None)
        if isinstance(devices, np.ndarray):
            device_ids = [int(d.id) for d in devices.flat]
        return pb.Sharding(
            named=pb.NamedSharding(
                mesh_axes=[
                    pb.MeshAxis(name=str(name), size=int(size))
                    for name, size in zip(mesh.axis_names, mesh.axis_sizes)
                ],
                spec=dims,
                device_ids=device_ids,
            )
        )
    if isinstance(sharding, jax.sharding.SingleDeviceSharding):
        (device,) = sharding.device_set
        return pb.Sharding(
            single_device=pb.SingleDevice(device_id=int(device.id), platform=device.platform)
        )
    return pb.Sharding(
        other=pb.OtherSharding(
            type_name=type(sharding).__name__,
            description=repr(sharding),
            num_devices=len(sharding.device_set),
        )
    )


def to_text(sharding: pb.Sharding) -> str:
    """One line for people: `mesh(x=8) spec('x', None)`, `replicated on mesh(x=8)`, ..."""
    kind = sharding.WhichOneof("kind")
    if kind == "host":
        return "host"
    if kind == "single_device":
        sd = sharding.single_device
        return f"single device {sd.platform or 'device'}:{sd.device_id}"
    if kind == "named":
        named = sharding.named
        mesh = ", ".join(f"{a.name}={a.size}" for a in named.mesh_axes)
        if not any(d.axes for d in named.spec):
            return f"replicated on mesh({mesh})"
        dims = []
        for d in named.spec:
            if not d.axes:
                dims.append("None")
            elif len(d.axes) == 1:
                dims.append(repr(d.axes[0]))
            else:
                dims.append("(" + ", ".join(map(repr, d.axes)) + ")")
        return f"mesh({mesh}) spec({', '.join(dims)})"
    if kind == "other":
        return f"{sharding.other.type_name} over {sharding.other.num_devices} device(s)"
    return "unknown"


def box_of_index(index: tuple[Any, ...], shape: tuple[int, ...]) -> Box:
    """The (starts, stops) box a tuple of slices (as jax reports shard indices) covers."""
    starts, stops = [], []
    for dim, size in enumerate(shape):
        sl = index[dim] if dim < len(index) else slice(None)
        start, stop, step = sl.indices(size)
        if step != 1:
            raise ValueError(f"strided shard index {index!r} is not supported")
        starts.append(start)
        stops.append(max(start, stop))
    return tuple(starts), tuple(stops)


def device_boxes(
    name: str, shape: tuple[int, ...], sharding: jax.sharding.Sharding
) -> dict[Box, list[jax.Device]]:
    """Each distinct box of ``shape`` that this process's devices hold under ``sharding``,
    with the devices holding it (a restore reads each box once)."""
    try:
        index_map = sharding.addressable_devices_indices_map(shape)
    except (ValueError, TypeError) as e:
        raise CheckpointError(
            f"array {name!r}: target sharding does not fit shape {shape}: {e}"
        ) from e
    blocks: dict[Box, list[jax.Device]] = {}
    for device, index in index_map.items():
        blocks.setdefault(box_of_index(index, shape), []).append(device)
    return blocks


def box_shape(box: Box) -> tuple[int, ...]:
    return tuple(b - a for a, b in zip(*box))


def volume(box: Box) -> int:
    # math.prod, not np.prod: a restore calls this for every pair of stored shard and
    # destination block, and np.prod costs ~5 us a call to math.prod's ~0.2.
    return math.prod(b - a for a, b in zip(*box))


def intersect(a: Box, b: Box) -> Box | None:
    """The common part of two boxes, or None when they do not overlap (or it is empty)."""
    starts = tuple(max(x, y) for x, y in zip(a[0], b[0]))
    stops = tuple(min(x, y) for x, y in zip(a[1], b[1]))
    if any(lo >= hi for lo, hi in zip(starts, stops)):
        return None
    return starts, stops


def shift(box: Box, origin: tuple[int, ...]) -> Box:
    """`box` in the coordinates of a block whose first element is at `origin`."""
    return (
        tuple(s - o for s, o in zip(box[0], origin)),
        tuple(s - o for s, o in zip(box[1], origin)),
    )


def to_slices(box: Box) -> tuple[slice | type[Ellipsis], ...]:
    """Index expression selecting `box`; always a view, even of a 0-d array."""
    return (*(slice(a, b) for a, b in zip(*box)), Ellipsis)
