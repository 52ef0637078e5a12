"""fcir's derivative ops (docs/ops.md: derivative ops) on an Explicit-axes mesh.

Under Explicit axes (``jax.make_mesh``'s default on JAX 0.10.2 and 0.12) every value's type
carries its sharding and JAX's rules check it: a derivative op whose result dropped its
operands' sharding met a ``dot_general`` with its other operand split over ``clients``
and JAX refused (``ShardingTypeError``). Every corpus program and gradient whose IR holds
a derivative op is compiled on a mesh with Explicit, Auto and default axes and compared
with ``jax.jit`` of the same function on that mesh: the same bits and per-device flops
(but see EXTRA_JIT_RESIDUAL), also when captured under the mesh.
``fedavg_transformer`` holds them too but takes minutes to compile (test_xla.py's SLOW).

Casts in members (``cast_round``): a gradient's IR holds convert_element_type's
transposes, whose ``sharding`` param JAX copies from an aval: a NamedSharding over the
empty mesh when captured without one. Compiled on Explicit axes they must run, and be
bitwise ``jax.jit`` on that mesh with its flops, directly or inside a nested ``jax.jit``.

Order statistics (``fed.median``, ``fed.trimmed_mean``) sort over the member axis, which
Explicit axes type as sharded, and JAX refuses such a sort: they gather the members
first (``fcir.opkit.sharding.gather_members``). So do the robust selections (Krum,
Multi-Krum, Bulyan), whose distances scan over the members with ``lax.map``.

JAX fixes the number of CPU devices when it starts, so ``test_on_8_simulated_devices``
runs the other tests of this file in a fresh process with 8 simulated devices (as
tests/interpreters/xla/test_xla_mesh.py does, whose helpers these tests use).
"""

from __future__ import annotations

import functools
import importlib.util
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import test_xla_mesh as mesh_tests
from corpus import case
from eight_devices import Child
from fcir.interpreters import xla
from jax.sharding import AxisType, PartitionSpec

import fcir
from fcir.ir import walk

HERE = pathlib.Path(__file__).resolve()
EIGHT_DEVICES = Child(HERE, "FCIR_XLA_EXPLICIT_MESH_TESTS")
INSIDE, on_8_devices = EIGHT_DEVICES.inside, EIGHT_DEVICES.on_8_devices
test_on_8_simulated_devices = EIGHT_DEVICES.waiting_test()
AXIS_TYPES = {"explicit": (AxisType.Explicit,), "auto": (AxisType.Auto,), "default": None}


def _corpus(name):
    c = case(name)
    return c.fn, c.make_args(), "clients", 3


def _corpus_grad(name):
    c = case(name)

    def loss(*args):
        return c.loss(c.fn(*args))

    return jax.grad(loss, argnums=c.grad_argnums), c.make_args(), "clients", 3


def _meta_learning_grad():
    path = HERE.parents[3] / "examples" / "meta_learning.py"
    spec = importlib.util.spec_from_file_location("meta_learning_example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    args = example.EXAMPLE_ARGS["post_round_loss"]()
    return jax.grad(example.post_round_loss), args, "clients", example.NUM_CLIENTS


PROGRAMS = {
    "scan_rounds": lambda: _corpus("scan_rounds"),
    "scan_rounds_grad": lambda: _corpus_grad("scan_rounds"),
    "meta_learning_grad": _meta_learning_grad,
}


# JAX 0.10.2's jax.jit of a gradient through the scan, on Explicit axes (its make_mesh
# default too), does a few more flops per device than the captured program, with the
# same bits (measured: scan_rounds_grad 316 vs 312, meta_learning_grad 13947 vs 13819;
# Auto axes: equal). Its compiled HLO has one more subtract and one more
# dynamic-update-slice (one more stacked scan residual); JAX 0.12 matches exactly. A
# scan-residual difference of 0.10.2 under Explicit axes, not the derivative ops' types.
EXTRA_JIT_RESIDUAL = (
    {"scan_rounds_grad", "meta_learning_grad"} if jax.__version_info__ < (0, 11) else set()
)
# "captured": traced by fcir.capture under jax.set_mesh of the Explicit mesh.
MESHES = [*AXIS_TYPES, "captured"]


@functools.cache
def compiled_both_ways(name, axes):
    """``(exe, jit, args)``: the captured program and ``jax.jit`` of it on the mesh."""
    fn, args, axis, clients = PROGRAMS[name]()
    types = (AxisType.Explicit,) if axes == "captured" else AXIS_TYPES[axes]
    mesh = jax.make_mesh((clients,), (axis,), axis_types=types)
    if axes == "captured":
        with jax.set_mesh(mesh):
            module = fcir.capture(fn, *args)
    else:
        module = fcir.capture(fn, *args)
    assert any(op.name.startswith("jax.tanh_") for _, op in walk(module.main.body))
    exe = xla.compile(module, mesh=mesh)
    assert PartitionSpec(axis) in {s.sharding.spec for s in exe.in_specs}
    args = mesh_tests.placed_args(exe, args)
    _, compiled = mesh_tests.jit_on_mesh(fn, mesh, args)
    return exe, compiled, args


@on_8_devices
@pytest.mark.parametrize("axes", MESHES)
@pytest.mark.parametrize("name", list(PROGRAMS))
def test_derivative_ops_on_a_mesh_are_bitwise_jit_on_that_mesh(name, axes):
    exe, compiled, args = compiled_both_ways(name, axes)
    mesh_tests.assert_bitwise(exe(*args), compiled(*args))


def _flops_params():
    for name in PROGRAMS:
        for axes in MESHES:
            marks = []
            if name in EXTRA_JIT_RESIDUAL and axes != "auto":
                marks.append(pytest.mark.xfail(strict=True, reason="see EXTRA_JIT_RESIDUAL"))
            yield pytest.param(name, axes, marks=marks, id=f"{name}-{axes}")


@on_8_devices
@pytest.mark.parametrize(("name", "axes"), list(_flops_params()))
def test_derivative_ops_on_a_mesh_do_jits_per_device_flops(name, axes):
    exe, compiled, args = compiled_both_ways(name, axes)
    assert mesh_tests.flops(exe.compiled(*args)) == mesh_tests.flops(compiled)


@on_8_devices
def test_derivative_op_results_keep_their_operands_sharding():
    # Traced on Explicit axes, an op's result is typed with its operands' sharding, as
    # JAX's own elementwise primitives type theirs.
    from fcir.jaxcompat import derivatives

    mesh = jax.make_mesh((8,), ("clients",), axis_types=(AxisType.Explicit,))
    x = jax.device_put(
        jax.numpy.ones((8, 2)), jax.sharding.NamedSharding(mesh, PartitionSpec("clients"))
    )
    with jax.set_mesh(mesh):
        jaxpr = jax.make_jaxpr(derivatives.tanh_residual_p.bind)(x)
    (out,) = jaxpr.jaxpr.outvars
    assert out.aval.sharding.spec == PartitionSpec("clients", None)


# --- casts in members, under Explicit axes -----------------------------------------------

CAST_CLIENTS = 8


def _cast_client(w, x):
    """bf16, f16 and int32 casts: each is a convert_element_type whose transpose records
    its operand's aval sharding."""
    h = jnp.tanh(x.astype(jnp.bfloat16) @ w.astype(jnp.bfloat16)).astype(jnp.float32)
    g = (x.astype(jnp.float16) @ w.astype(jnp.float16)).astype(jnp.float32)
    q = (x * 16).astype(jnp.int32).astype(jnp.float32) / 16
    return jnp.sum(h * g, axis=0) + q.mean(0) @ w


def _cast_round(nested: bool):
    @fcir.program(placements={"clients": CAST_CLIENTS})
    def cast_round(w, x):
        def members(w, x):
            return fcir.map_fn(_cast_client, (fcir.broadcast(w), x))

        return fcir.reduce_mean(jax.jit(members)(w, x) if nested else members(w, x))

    return cast_round


def _cast_fn(nested: bool, grad: bool):
    fn = _cast_round(nested)
    if grad:
        return jax.grad(lambda w, x: jnp.sum(jnp.square(fn(w, x))), argnums=(0, 1))
    return fn


def _cast_args():
    rng = np.random.default_rng(5)
    w = jnp.asarray(rng.normal(size=(6, 6)), jnp.float32)
    x = jnp.asarray(rng.normal(size=(CAST_CLIENTS, 4, 6)), jnp.float32)
    return w, x


def _explicit_mesh(k: int):
    return jax.make_mesh(
        (k, jax.device_count() // k), ("clients", "rest"), axis_types=(AxisType.Explicit,) * 2
    )


@pytest.mark.skipif(INSIDE, reason="one device: the main process")
@pytest.mark.parametrize("nested", [False, True], ids=["direct", "nested_jit"])
def test_gradient_through_member_casts_runs_on_a_one_device_explicit_mesh(nested):
    # Was: "Resource axis: clients of P('clients', None, None) is not found in mesh: ()".
    fn, args, mesh = _cast_fn(nested, grad=True), _cast_args(), _explicit_mesh(1)
    module = fcir.capture(fn, *args)
    empty = [
        op
        for _, op in walk(module.main.body)
        if op.name == "jax.convert_element_type" and op.attrs["sharding"] is not None
    ]
    assert empty, "the gradient no longer holds a cast's transpose with a sharding param"
    exe = xla.compile(module, mesh=mesh)
    args = mesh_tests.placed_args(exe, args)
    _, compiled = mesh_tests.jit_on_mesh(fn, mesh, args)
    mesh_tests.assert_bitwise(exe(*args), compiled(*args))


@on_8_devices
@pytest.mark.parametrize(
    ("nested", "grad", "k"),
    [(False, False, 2), (False, True, 8), (False, True, 2), (True, True, 4)],
    ids=["forward-2", "gradient-8", "gradient-2", "nested_jit_gradient-4"],
)
def test_member_casts_on_explicit_meshes_are_bitwise_jit_with_its_flops(nested, grad, k):
    fn, args, mesh = _cast_fn(nested, grad), _cast_args(), _explicit_mesh(k)
    exe = xla.compile(fcir.capture(fn, *args), mesh=mesh)
    args = mesh_tests.placed_args(exe, args)
    _, compiled = mesh_tests.jit_on_mesh(fn, mesh, args)
    mesh_tests.assert_bitwise(exe(*args), compiled(*args))
    assert mesh_tests.flops(exe.compiled(*args)) == mesh_tests.flops(compiled)


# --- order statistics over members, under Explicit axes ----------------------------------


@fcir.program(placements={"clients": CAST_CLIENTS})
def order_statistics(x):
    return fcir.reduce_median(x), fcir.reduce_trimmed_mean(x, trim=2)


@on_8_devices
@pytest.mark.parametrize("k", [8, 2])
def test_median_and_trimmed_mean_of_placed_arguments_run_on_explicit_meshes(k):
    # Was: "Arguments to sort must be unsharded over the sorting dimension", from
    # xla.compile (placed arguments arrive split over 'clients') and from jax.jit alike.
    x = jnp.asarray(np.random.default_rng(7).normal(size=(CAST_CLIENTS, 3, 4)), jnp.float32)
    mesh = _explicit_mesh(k)
    exe = xla.compile(fcir.capture(order_statistics, x), mesh=mesh)
    (x,) = mesh_tests.placed_args(exe, (x,))
    assert x.sharding.spec == PartitionSpec("clients")
    _, compiled = mesh_tests.jit_on_mesh(order_statistics, mesh, (x,))
    mesh_tests.assert_bitwise(exe(x), compiled(x))
    assert mesh_tests.flops(exe.compiled(x)) == mesh_tests.flops(compiled)
    expected = (np.median(np.asarray(x), axis=0), np.sort(np.asarray(x), axis=0)[2:-2].mean(0))
    for got, want in zip(exe(x), expected):
        np.testing.assert_allclose(got, want, rtol=1e-6)


@on_8_devices
@pytest.mark.parametrize("grad", [False, True], ids=["forward", "gradient"])
def test_robust_agg_on_its_explicit_mesh_is_bitwise_jit_with_its_flops(grad):
    c = case("robust_agg")  # 7 clients: the (1, 8) mesh of explicit_mesh_for
    fn = mesh_tests.gradient(c) if grad else c.fn
    args, mesh = c.make_args(), mesh_tests.explicit_mesh_for(c)
    exe = xla.compile(fcir.capture(fn, *args), mesh=mesh)
    args = mesh_tests.placed_args(exe, args)
    _, compiled = mesh_tests.jit_on_mesh(fn, mesh, args)
    mesh_tests.assert_bitwise(exe(*args), compiled(*args))
    assert mesh_tests.flops(exe.compiled(*args)) == mesh_tests.flops(compiled)


# --- the robust selections over members, under Explicit axes -----------------------------


@fcir.program(placements={"clients": 8})
def robust_selections(x):
    return {
        "krum": fcir.reduce_krum(x, 1),
        "multi_krum": fcir.reduce_multi_krum(x, 1, 3),
        "bulyan": fcir.reduce_bulyan(x, 1),
    }


@on_8_devices
def test_krum_multi_krum_and_bulyan_run_on_an_explicit_mesh_as_without_one():
    # Was: "0th dimension of all xs should be replicated. Got P('clients', None)", from
    # the distances' lax.map over members split over 'clients' by the placed argument.
    x = jnp.asarray(np.random.default_rng(3).normal(size=(8, 5)), jnp.float32)
    module = fcir.capture(robust_selections, x)
    want = xla.compile(module)(x)
    for types in [(AxisType.Explicit,), (AxisType.Auto,)]:
        mesh = jax.make_mesh((8,), ("clients",), axis_types=types)
        exe = xla.compile(module, mesh=mesh)
        (placed,) = mesh_tests.placed_args(exe, (x,))
        mesh_tests.assert_bitwise(exe(placed), want)
        _, compiled = mesh_tests.jit_on_mesh(robust_selections, mesh, (placed,))
        mesh_tests.assert_bitwise(compiled(placed), want)


@on_8_devices
@pytest.mark.parametrize("axes", ["explicit", "auto"])
def test_simulate_runs_both_loops_on_a_mesh_as_the_rounds_by_hand(axes):
    """``xla.simulate(..., mesh=)``: the device loop keeps the population replicated on
    the mesh and gathers each cohort there, the host loop puts each cohort laid out as
    the round's arguments; both give the rounds run one by one, and results that
    differentiate outside ``jax.set_mesh`` as the executable's own do."""
    rng = np.random.default_rng(0)
    sizes = rng.integers(2, 9, 40)
    clients = [(rng.normal(size=(n, 3)).astype(np.float32),) for n in sizes]
    cohorts = fcir.Population.from_clients(clients).uniform(8, seed=0)

    @fcir.program(placements={"clients": 8})
    def fedavg(w, data, counts):
        def client(w, x, n):
            mask = (jnp.arange(x.shape[0]) < n)[:, None]
            return jnp.sum(x * mask, 0) / jnp.maximum(n, 1.0) - w

        deltas = fcir.map_fn(client, (fcir.broadcast(w), *data, counts))
        return w + 0.5 * fcir.reduce_weighted_mean(deltas, counts), fcir.reduce_sum(counts)

    mesh = jax.make_mesh((8,), ("clients",), axis_types=AXIS_TYPES[axes])
    exe = xla.compile(fcir.capture(fedavg, jnp.zeros(3), *cohorts.specs()), mesh=mesh)
    w = jnp.zeros(3)
    for r in range(3):
        w, _ = exe(w, *cohorts.gather(r))
    for loop in ("host", "device"):
        got, totals = xla.simulate(exe, jnp.zeros(3), cohorts, 3, loop=loop)
        np.testing.assert_allclose(np.asarray(got), np.asarray(w), rtol=1e-6, atol=1e-7)
        want = [sum(sizes[i] for i in cohorts.indices(r)[0]) for r in range(3)]
        np.testing.assert_array_equal(np.asarray(totals), want)
        jax.grad(lambda v, got=got: jnp.sum(v * got))(jnp.ones(3))  # outside jax.set_mesh
