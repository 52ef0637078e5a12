"""``fcir.opkit.sharding``: which mesh is used and what constraint a placed value gets.

One-device meshes are enough to see the rules in the jaxpr; the 8-device comparison
with DrJAX's compiled shardings is in ``test_drjax.py``.
"""

from __future__ import annotations

import logging
import warnings

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import fcir
from fcir.opkit import sharding


def mesh1(name="clients", axis_type=AxisType.Auto, other=None):
    names = (name,) if other is None else (name, other)
    return jax.make_mesh((1,) * len(names), names, axis_types=(axis_type,) * len(names))


def eqns(fn, *args):
    return [(e.primitive.name, e.params) for e in jax.make_jaxpr(fn)(*args).eqns]


# --- resolve_mesh ---------------------------------------------------------------------------


def test_resolve_mesh_prefers_the_given_mesh():
    given, ambient = mesh1("a"), mesh1("b")
    with jax.set_mesh(ambient):
        assert sharding.resolve_mesh(given) is given
        assert sharding.resolve_mesh(None).axis_names == ("b",)
        assert sharding.resolve_mesh(sharding.AMBIENT).axis_names == ("b",)


def test_resolve_mesh_without_any_mesh_is_none():
    assert sharding.resolve_mesh(None) is None
    assert sharding.resolve_mesh(sharding.AmbientMesh(use_abstract_mesh=False)) is None


def test_use_abstract_mesh_false_ignores_set_mesh_but_sees_with_mesh():
    mesh = mesh1()
    no_abstract = sharding.AmbientMesh(use_abstract_mesh=False)
    with jax.set_mesh(mesh):
        assert sharding.resolve_mesh(no_abstract) is None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with mesh:
            assert sharding.resolve_mesh(no_abstract).axis_names == ("clients",)


def test_resolve_mesh_rejects_non_meshes():
    with pytest.raises(fcir.PlacementError, match="jax.sharding.Mesh"):
        sharding.resolve_mesh("clients")


# --- constraints ----------------------------------------------------------------------------


def test_auto_axis_constrains_member_axis_and_leaves_the_rest_unconstrained():
    mesh = mesh1()
    [(name, params)] = eqns(
        lambda x: sharding.constrain_placed(x, "clients", mesh), jnp.ones((1, 3))
    )
    assert name == "sharding_constraint"
    assert params["sharding"].spec == P("clients", P.UNCONSTRAINED)


def test_explicit_axis_reshards_keeping_the_typed_layout():
    mesh = jax.make_mesh((1, 1), ("clients", "model"), axis_types=(AxisType.Explicit,) * 2)
    x = jax.device_put(jnp.ones((1, 4)), NamedSharding(mesh, P(None, "model")))
    with jax.set_mesh(mesh):
        out = jax.jit(lambda x: sharding.constrain_placed(x, "clients", None))(x)
        assert jax.typeof(out).sharding.spec == P("clients", "model")
        # The placement axis used by another dimension moves to the member axis.
        y = jax.device_put(jnp.ones((1, 4)), NamedSharding(mesh, P(None, ("clients", "model"))))
        out = jax.jit(lambda y: sharding.constrain_placed(y, "clients", None))(y)
        assert jax.typeof(out).sharding.spec == P("clients", "model")


def test_no_mesh_no_constraint_and_no_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="fcir"):
        assert eqns(lambda x: sharding.constrain_placed(x, "clients", None), jnp.ones(2)) == []
    assert not caplog.records


def test_mesh_without_axis_warns_once(caplog):
    mesh = mesh1("only_axis_for_warn_test")
    with caplog.at_level(logging.WARNING, logger="fcir"):
        for _ in range(3):
            got = eqns(lambda x: sharding.constrain_placed(x, "warn_test_p", mesh), jnp.ones(2))
            assert got == []
    assert len([r for r in caplog.records if "warn_test_p" in r.getMessage()]) == 1


def test_scalars_and_manual_axes_are_left_alone():
    mesh = mesh1()
    assert eqns(lambda x: sharding.constrain_placed(x, "clients", mesh), jnp.float32(1)) == []
    manual = jax.make_mesh((1,), ("clients",), axis_types=(AxisType.Manual,))
    assert sharding.placement_axis_type(manual, "clients") == AxisType.Manual
    assert eqns(lambda x: sharding.constrain_placed(x, "clients", manual), jnp.ones(1)) == []


def test_member_sharding():
    assert sharding.member_sharding(jnp.ones((2, 3))) is None  # no mesh: nothing to type
    mesh = jax.make_mesh((1, 1), ("clients", "model"), axis_types=(AxisType.Explicit,) * 2)
    x = jax.device_put(jnp.ones((1, 4)), NamedSharding(mesh, P("clients", "model")))
    with jax.set_mesh(mesh):
        member = sharding.member_sharding(x)
    assert member.spec == P("model")
    auto = jax.device_put(jnp.ones((1, 4)), NamedSharding(mesh1(), P("clients")))
    assert sharding.member_sharding(auto) is None


# --- types through the primitives (Explicit axes) ------------------------------------------


def test_explicit_layouts_flow_through_broadcast_map_and_reductions():
    mesh = jax.make_mesh((1, 1), ("clients", "model"), axis_types=(AxisType.Explicit,) * 2)

    @fcir.program(placements={"clients": 3})
    def f(w, x):
        wc = fcir.broadcast(w)
        seen.append(jax.typeof(wc).sharding.spec)
        out = fcir.map_fn(
            lambda a, b: (seen.append(jax.typeof(a).sharding.spec), a * b)[1], (wc, x)
        )
        seen.append(jax.typeof(out).sharding.spec)
        mean = fcir.reduce_mean(out)
        seen.append(jax.typeof(mean).sharding.spec)
        return mean

    seen = []
    w = jax.device_put(jnp.ones((4,)), NamedSharding(mesh, P("model")))
    x = jax.device_put(jnp.ones((3, 4)), NamedSharding(mesh, P("clients", "model")))
    with jax.set_mesh(mesh):
        out = jax.jit(f)(w, x)
    assert seen == [P("clients", "model"), P("model"), P("clients", "model"), P("model")]
    assert out.sharding.spec == P("model")
