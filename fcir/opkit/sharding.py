"""Sharding constraints for placed values: DrJAX 0.2.1's layout rules.

Which mesh: the ``mesh=`` passed to the call (a ``jax.sharding.Mesh`` or
``AbstractMesh``), else the program's, else the ambient one: the abstract mesh set by
``jax.set_mesh`` (skipped when a ``fcir.drjax`` program says ``use_abstract_mesh=False``),
else the physical mesh of a (deprecated) ``with mesh:`` block, else none. The mesh is
resolved when the program is traced.

What is constrained, for a value placed at ``p`` (leading axis = members of ``p``):

- no mesh: nothing, silently (single-device programs);
- a mesh without an axis named ``p``: nothing, and a warning on the ``fcir`` logger, once
  per (placement, mesh axis names);
- axis ``p`` is ``Auto``: ``with_sharding_constraint(x, P(p, UNCONSTRAINED, ...))`` — the
  member axis is sharded over ``p``, the rest is left to XLA's propagation;
- axis ``p`` is ``Explicit``: ``reshard(x, P(p, *rest))`` where ``rest`` is the value's
  own (typed) layout of the other dimensions; the primitives' abstract-eval rules type
  a broadcast as ``P(p, *operand_spec)`` and a reduction as the operand's spec without
  its first entry, so layouts flow through the program's types;
- axis ``p`` is ``Manual`` (inside a ``shard_map`` over ``p``): nothing.

Unlike DrJAX, meshes mixing axis types are handled per placement axis instead of
rejected.
"""

from __future__ import annotations

import dataclasses
import logging

import jax
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from fcir.errors import PlacementError
from fcir.jaxcompat import physical_mesh

__all__ = [
    "AMBIENT",
    "AmbientMesh",
    "constrain_broadcast",
    "constrain_placed",
    "gather_members",
    "member_sharding",
    "on_context_mesh",
    "placement_axis_type",
    "resolve_mesh",
]

_log = logging.getLogger("fcir")
_warned: set[tuple[str, tuple[str, ...]]] = set()


@dataclasses.dataclass(frozen=True)
class AmbientMesh:
    """ "Use the mesh in effect when the program is traced" (``mesh=None``).

    ``use_abstract_mesh=False`` skips ``jax.set_mesh``'s abstract mesh and only looks at
    the physical mesh of a ``with mesh:`` block (DrJAX's ``use_abstract_mesh`` flag).
    """

    use_abstract_mesh: bool = True


AMBIENT = AmbientMesh()


def _physical_mesh():

    return physical_mesh()


def resolve_mesh(mesh=None):
    """The mesh to lay placed values out on, or None. See the module docstring."""
    if mesh is None:
        mesh = AMBIENT
    if isinstance(mesh, AmbientMesh):
        if mesh.use_abstract_mesh:
            abstract = jax.sharding.get_abstract_mesh()
            if abstract is not None and not abstract.empty:
                return abstract
        return _physical_mesh()
    if not isinstance(mesh, (jax.sharding.Mesh, jax.sharding.AbstractMesh)):
        raise PlacementError(
            f"mesh must be a jax.sharding.Mesh or jax.sharding.AbstractMesh (or None for "
            f"the mesh set with jax.set_mesh), got {type(mesh).__name__}"
        )
    return None if mesh.empty else mesh


def placement_axis_type(mesh, placement: str):
    """The ``AxisType`` of the mesh axis named ``placement``; None (and a one-time
    warning) if the mesh has no such axis, None silently if there is no mesh."""
    if mesh is None:
        return None
    names = tuple(mesh.axis_names)
    if placement in names:
        return mesh.axis_types[names.index(placement)]
    key = (placement, names)
    if key not in _warned:
        _warned.add(key)
        _log.warning(
            "fcir: no mesh axis named %r in the mesh (axes %s); no sharding constraint is "
            "added for values placed at %r",
            placement,
            names,
            placement,
        )
    return None


def _rest_spec(x, placement: str) -> list:
    """The typed layout of ``x``'s non-leading dims, without ``placement`` (it now
    shards the leading dim)."""
    spec = tuple(jax.typeof(x).sharding.spec)
    rest = list(spec[1:]) + [None] * (x.ndim - max(len(spec), 1))

    def drop(entry):
        if entry == placement:
            return None
        if isinstance(entry, tuple) and placement in entry:
            kept = tuple(a for a in entry if a != placement)
            return kept or None
        return entry

    return [drop(e) for e in rest]


def constrain_placed(x, placement: str, mesh):
    """Lays out ``x``'s member (leading) axis along the mesh axis named ``placement``."""
    mesh = resolve_mesh(mesh)
    axis_type = placement_axis_type(mesh, placement)
    if axis_type is None or axis_type == AxisType.Manual or x.ndim == 0:
        return x
    if axis_type == AxisType.Explicit:
        spec = PartitionSpec(placement, *_rest_spec(x, placement))
        return jax.sharding.reshard(x, NamedSharding(mesh, spec))
    spec = PartitionSpec(placement, *([PartitionSpec.UNCONSTRAINED] * (x.ndim - 1)))
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def constrain_broadcast(x, placement: str, mesh):
    """Lays out a freshly broadcast value: members along ``placement``, each member laid
    out like the broadcast operand (Explicit axes: the operand's typed layout, which the
    broadcast's abstract eval carried over; Auto axes: left to propagation)."""
    return constrain_placed(x, placement, mesh)


def member_sharding(x):
    """The sharding of one member of placed value ``x`` for tracing a ``map_fn`` body:
    ``x``'s typed sharding without the leading entry when its mesh has ``Explicit``
    axes (so the body sees the members' real layout), else None (nothing to type)."""
    sharding = jax.typeof(x).sharding
    mesh = sharding.mesh
    if mesh.empty or AxisType.Explicit not in tuple(mesh.axis_types):
        return None
    return NamedSharding(mesh, PartitionSpec(*tuple(sharding.spec)[1:]))


#: Ops whose sharding param is the op itself (a layout asked for), not a copied aval's.
_LAYOUT_OPS = frozenset({"jax.reshard", "jax.sharding_constraint"})


def on_context_mesh(op_name: str, params: dict) -> dict:
    """The JAX params of op ``op_name`` as tracing on the mesh in context records them.

    A module captured without a mesh records the layouts JAX derived from its avals
    (e.g. convert_element_type's transpose: ``sharding=operand.aval.sharding``) as
    NamedShardings over the empty mesh. Under a context mesh with ``Explicit`` axes
    (``jax.set_mesh``, or ``xla.compile``'s mesh) such a param types the result, and
    vmap, lowering ``fed.map``, inserts the member axis into its spec, which the empty
    mesh lacks ("Resource axis: clients ... is not found in mesh: ()"): it stands for the
    same spec over the context mesh, what ``jax.jit`` of the program there records.
    Layout ops (reshard, sharding_constraint) are kept as captured: their sharding is
    the op itself, and a capture under the mesh records them as ``jax.jit`` has them.
    Without such a mesh, ``params`` is returned as it is."""
    mesh = jax.sharding.get_abstract_mesh()
    if (
        mesh is None
        or mesh.empty
        or AxisType.Explicit not in tuple(mesh.axis_types)
        or op_name in _LAYOUT_OPS
    ):
        return params
    return {k: _put_on(v, mesh) for k, v in params.items()}


def _put_on(value, mesh):
    """``value`` (a param) with NamedShardings over the empty mesh put on ``mesh``."""
    if isinstance(value, NamedSharding) and value.mesh.empty:
        return NamedSharding(mesh, value.spec)
    if isinstance(value, tuple) and any(isinstance(v, NamedSharding) for v in value):
        return tuple(_put_on(v, mesh) for v in value)
    return value


def gather_members(x):
    """``x`` with its member (leading) axis no longer split over Explicit mesh axes: an
    order statistic over members sorts along that axis, and JAX refuses a sort over a
    dimension whose type says it is sharded. Anything else is returned as it is."""
    sharding = jax.typeof(x).sharding
    spec = tuple(getattr(sharding, "spec", ()))
    if not spec or spec[0] is None:
        return x
    mesh = sharding.mesh
    axes = spec[0] if isinstance(spec[0], tuple) else (spec[0],)
    types = dict(zip(mesh.axis_names, mesh.axis_types))
    if not any(types.get(a) == AxisType.Explicit for a in axes):
        return x
    return jax.sharding.reshard(x, NamedSharding(mesh, PartitionSpec(None, *spec[1:])))
