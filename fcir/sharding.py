"""Sharding constraints for placed values (DrJAX's rules).

A placed value's member axis is sharded along the mesh axis named after its
placement. With no mesh, or a mesh lacking that axis, no constraint is added (with a
warning once per placement); the rest of the layout is left to XLA's propagation.
"""

from __future__ import annotations

import logging

import jax
from jax.sharding import NamedSharding, PartitionSpec

_log = logging.getLogger("fcir")
_warned: set[tuple[str, tuple[str, ...]]] = set()


def resolve_mesh(mesh):
    """The explicit mesh, else the abstract mesh set with ``jax.set_mesh``, else None."""
    if mesh is not None:
        return mesh
    abstract = jax.sharding.get_abstract_mesh()
    if abstract is not None and not abstract.empty:
        return abstract
    from jax.interpreters import pxla

    physical = pxla.thread_resources.env.physical_mesh
    return None if physical.empty else physical


def _axis_in_mesh(mesh, placement: str) -> bool:
    if mesh is None:
        return False
    if placement in mesh.axis_names:
        return True
    key = (placement, tuple(mesh.axis_names))
    if key not in _warned:
        _warned.add(key)
        _log.warning(
            "fcir: no mesh axis named %r in the mesh (axes %s); no sharding constraint "
            "is added for values placed there",
            placement,
            tuple(mesh.axis_names),
        )
    return False


def constrain_placed(x, placement: str, mesh):
    """Constrains the member (leading) axis of ``x`` to the placement's mesh axis."""
    mesh = resolve_mesh(mesh)
    if not _axis_in_mesh(mesh, placement):
        return x
    rest = [PartitionSpec.UNCONSTRAINED] * (x.ndim - 1)
    if getattr(mesh, "are_all_axes_explicit", False):
        spec = jax.typeof(x).sharding.spec
        rest = list(spec[1:]) if len(spec) == x.ndim else [None] * (x.ndim - 1)
        return jax.sharding.reshard(x, NamedSharding(mesh, PartitionSpec(placement, *rest)))
    return jax.lax.with_sharding_constraint(
        x, NamedSharding(mesh, PartitionSpec(placement, *rest))
    )


def constrain_broadcast(x, placement: str, mesh):
    """Constrains a freshly broadcast value like any placed value."""
    return constrain_placed(x, placement, mesh)
