"""Placed values through server control flow: client data used only in a loop, and
placed values through cond, switch, scan and while.

Every program here is one that ``jax.jit`` runs and that communicates only through fcir
ops: it must capture, check, print/parse, and give jit's numbers on the reference
interpreter (1e-5) and on XLA (bitwise). Rejections name the op and say what to do.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fcir.interpreters import production, reference, xla

import fcir
from fcir.checker.check import verify
from fcir.errors import ExportError, PlacementError
from fcir.ir.types import PlacedType, TensorType

N = 3
clients = fcir.program(placements={"clients": N})
_rng = np.random.default_rng(0)


def _f(*shape):
    return jnp.asarray(_rng.normal(size=shape), jnp.float32)


W, X, Y = _f(2), _f(N, 4, 2), _f(N, 4)


def client_step(w, x, y):
    return w - 0.1 * jax.grad(lambda w: jnp.mean((jnp.tanh(x @ w) - y) ** 2))(w)


def fed_round(w, x, y):
    return fcir.reduce_mean(fcir.map_fn(client_step, (fcir.broadcast(w), x, y)))


def _loss(fn):
    return lambda *a: jnp.sum(fn(*a) ** 2)


def assert_runs_everywhere(fn, *args):
    """Captures ``fn``, round-trips its text and protobuf, and compares every backend
    with jax.jit. The backends run the deserialized module: it has no captured jaxpr to
    fall back on (``fcir.frontend.jaxpr_cache``), so XLA rebuilds the program from the IR."""
    module = fcir.capture(fn, *args)
    text = module.to_text()
    assert fcir.parse(text).to_text() == text
    loaded = fcir.Module.deserialize(module.serialize())
    assert loaded.to_text() == text
    want = jax.jit(fn)(*args)
    ref = reference.run(loaded, *args)
    got = xla.compile(loaded)(*args)
    for w, r, g in zip(jax.tree.leaves(want), jax.tree.leaves(ref), jax.tree.leaves(got)):
        np.testing.assert_allclose(np.asarray(r), np.asarray(w), rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    return module


# --- client data used only inside a server loop is client data --------------------------


@clients
def rounds(w, x):
    def body(w, _):
        return w + fcir.reduce_mean(fcir.map_fn(lambda w, x: x @ w, (fcir.broadcast(w), x))), None

    return jax.lax.scan(body, w, None, length=2)[0]


def test_data_used_only_in_a_scan_is_client_data():
    m = assert_runs_everywhere(rounds, jnp.ones(2), _f(N, 2, 2))
    assert m.main.body.params[1].type == PlacedType(TensorType("f32", (2, 2)), "clients")
    (scan,) = [op for op in m.main.body.ops if op.name == "jax.scan"]
    assert scan.regions[0].params[0].type == m.main.body.params[1].type


@fcir.program(placements={"silos": 2, "clients": 4})
def silo_rounds(w, x):
    def silo(w, x):
        def body(w, _):
            upd = fcir.map_fn(lambda w, x: x.T @ jnp.tanh(x @ w), (fcir.broadcast(w), x))
            return w - 0.01 * fcir.reduce_mean(upd), None

        return jax.lax.scan(body, w, None, length=2)[0]

    return fcir.reduce_mean(fcir.map_fn(silo, (fcir.broadcast(w), x)))


def test_a_silo_body_keeps_client_data_at_the_clients():
    args = _f(3), _f(2, 4, 6, 3)
    m = assert_runs_everywhere(silo_rounds, *args)
    assert str(m.main.body.params[1].type) == "{{f32[6,3]}@clients}@silos"
    # Its gradient: per-round client residuals stacked inside the silo body leave the
    # forward fed.map and enter the backward one (member axes first at every level).
    m = assert_runs_everywhere(jax.grad(_loss(silo_rounds), (0, 1)), *args)
    stacked = {str(r.type) for _, op in fcir.ir.walk(m.main.body) for r in op.results}
    assert "{{f32[2,6]}@clients}@silos" in stacked


def test_a_scan_parameter_typed_client_data_fed_by_a_server_value_fails_check():
    # A scan region parameter typed as client data fed by a server value, with no
    # fed.broadcast: hand-edited, it must not check.
    text = fcir.capture(rounds, jnp.ones(2), _f(N, 2, 2)).to_text()
    bad = text.replace("%1: {f32[2,2]}@clients", "%1: f32[3,2,2]@server", 1)
    assert bad != text
    assert "flow/C2" in [d.code for d in verify(fcir.parse(bad))]
    with pytest.raises(PlacementError, match="jax.scan .*flow/C2"):
        fcir.check(fcir.parse(bad))


# --- placed values through cond / switch / scan / while ----------------------------------


@clients
def robust_or_mean(x, robust):
    u = fcir.map_fn(lambda v: 2.0 * v, x)
    return jax.lax.cond(robust, fcir.reduce_max, fcir.reduce_mean, u)


@clients
def two_rounds(w, x, y):
    def rnd(w, _):
        new = fcir.map_fn(
            lambda w, x, y: w - 0.1 * jax.grad(lambda w: jnp.mean((x @ w - y) ** 2))(w),
            (fcir.broadcast(w), x, y),
        )
        return fcir.reduce_mean(new), None

    return jax.lax.scan(rnd, w, None, length=2)[0]


@clients
def tanh_rounds(w, x, y):
    # Nonlinear: the backward scan reads per-round client residuals, stacked by the
    # forward scan ({f32[2,4]}@clients, member axis first).
    return jax.lax.scan(lambda w, _: (fed_round(w, x, y), None), w, None, length=2)[0]


@clients
def warm_up_then_scan(w, x, y):
    w = fed_round(w, x, y)
    return jax.lax.scan(lambda w, _: (fed_round(w, x, y), None), w, None, length=2)[0]


@clients
def second_exchange_if(w, x, y):
    w = fed_round(w, x, y)
    return jax.lax.cond(jnp.sum(w) > 0, lambda w: fed_round(w, x, y), lambda w: w, w)


@clients
def fori_rounds(w, x, y):
    return jax.lax.fori_loop(0, 2, lambda i, w: fed_round(w, x, y), w)


@clients
def while_rounds(w, x, y, n):
    return jax.lax.fori_loop(0, n, lambda i, w: fed_round(w, x, y), w)


@clients
def switch_aggregate(w, x, y, k):
    u = fcir.map_fn(client_step, (fcir.broadcast(w), x, y))
    return jax.lax.switch(
        k, [fcir.reduce_mean, fcir.reduce_max, lambda u: fcir.reduce_sum(u) / N], u
    )


@clients
def per_member_carry(x):
    u = fcir.map_fn(lambda v: 2.0 * v, x)
    u = jax.lax.fori_loop(0, 2, lambda i, u: u * 0.5, u)
    return fcir.reduce_mean(u)


def test_cond_chooses_the_aggregation():
    x = jnp.arange(6.0).reshape(N, 2)
    assert_runs_everywhere(robust_or_mean, x, True)
    m = assert_runs_everywhere(robust_or_mean, x, False)
    (cond,) = [op for op in m.main.body.ops if op.name == "jax.cond"]
    assert [str(r.params[0].type) for r in cond.regions] == ["{f32[2]}@clients"] * 2


def test_gradient_of_a_multi_round_scan():
    assert_runs_everywhere(jax.grad(_loss(two_rounds)), W, X, Y)
    # Stacked per-round residuals, and cotangents of client data carried as client data.
    m = assert_runs_everywhere(jax.grad(_loss(tanh_rounds), (0, 1, 2)), W, X, Y)
    stacked = [str(r.type) for op in m.main.body.ops if op.name == "jax.scan" for r in op.results]
    assert "{f32[2,4]}@clients" in stacked


@pytest.mark.parametrize(
    "fn, args",
    [
        (warm_up_then_scan, (W, X, Y)),
        (jax.grad(_loss(warm_up_then_scan)), (W, X, Y)),
        (second_exchange_if, (W, X, Y)),
        (second_exchange_if, (-W, X, Y)),
        (jax.grad(_loss(second_exchange_if)), (W, X, Y)),
        (fori_rounds, (W, X, Y)),
        (while_rounds, (W, X, Y, 2)),
        (switch_aggregate, (W, X, Y, 1)),
        (switch_aggregate, (W, X, Y, 2)),
        (per_member_carry, (X[:, 0],)),
    ],
    ids=["warm_up", "warm_up_grad", "second_exchange", "no_second_exchange",
         "second_exchange_grad", "fori", "while", "switch_max", "switch_sum", "carry"],
)
def test_rounds_under_control_flow(fn, args):
    assert_runs_everywhere(fn, *args)


# --- variants: jit-wrapped and rematerialized rounds, local control flow in a map -----------


@clients
def jit_rounds(w, x, y):
    step = jax.jit(fed_round)
    return jax.lax.scan(lambda w, _: (step(w, x, y), None), w, None, length=2)[0]


@clients
def remat_rounds(w, x, y):
    step = jax.checkpoint(fed_round)
    return jax.lax.scan(lambda w, _: (step(w, x, y), None), w, None, length=2)[0]


@clients
def local_loops_in_map(w, x, y):
    def client(w, x, y):
        w = jax.lax.cond(jnp.sum(w) > 0, lambda w: w * 2.0, lambda w: w, w)
        return jax.lax.scan(lambda w, b: (client_step(w, b[0], b[1]), None), w, (x, y))[0]

    return fcir.reduce_mean(fcir.map_fn(client, (fcir.broadcast(w), x, y)))


@pytest.mark.parametrize("fn", [jit_rounds, remat_rounds, local_loops_in_map],
                         ids=lambda f: f.__name__)
def test_variants_and_their_gradients(fn):
    assert_runs_everywhere(fn, W, X, Y)
    assert_runs_everywhere(jax.grad(_loss(fn), (0, 1)), W, X, Y)


def test_stacked_residuals_cross_a_jit_boundary():
    # Forward and backward scans in separate jits: the per-round client residuals enter
    # the backward jit as arguments of an inlined call, still stacked member-first.
    def split(w, x, y):
        out, vjp = jax.vjp(jax.jit(lambda w: tanh_rounds(w, x, y)), w)
        return jax.jit(vjp)(out)

    assert_runs_everywhere(split, W, X, Y)


# --- what is rejected, and why -----------------------------------------------------------


def test_scanning_over_per_round_client_data_is_rejected():
    @clients
    def per_round_data(w, xs):
        return jax.lax.scan(lambda w, x: (fed_round(w, x, Y), None), w, xs)[0]

    jax.jit(per_round_data)(W, jnp.stack([X, X]))  # JAX runs it: rounds axis first
    with pytest.raises(PlacementError, match=r"jax.scan: scans over f32\[2,3,4,2\].*member "
                       r"axis second.*\{f32\[2,4,2\]\}@clients"):
        fcir.capture(per_round_data, W, jnp.stack([X, X]))


def test_returning_stacked_per_round_client_values_is_rejected():
    @clients
    def per_round_values(w):
        def body(w, _):
            return w, fcir.map_fn(lambda v: 2.0 * v, fcir.broadcast(w))

        return jax.lax.scan(body, w, None, length=2)[1]

    with pytest.raises(PlacementError, match="jax.scan stacked from per-iteration placed"):
        fcir.capture(per_round_values, W)


def test_export_rejects_server_control_flow_naming_the_op():
    with pytest.raises(ExportError, match=r"federated op under control flow.*jax.scan"):
        production.export(fcir.capture(fori_rounds, W, X, Y))
    with pytest.raises(ExportError, match=r"jax.cond \(op .*carries values placed"):
        production.export(fcir.capture(_passthru, X[:, 0], True))


@clients
def _passthru(x, flag):
    u = jax.lax.cond(flag, lambda u: u, lambda u: u * 3.0, fcir.map_fn(lambda v: 2.0 * v, x))
    return fcir.reduce_mean(u)


# --- gradients w.r.t. client data through server loops over silos -------------------------


def silo_scan(length):
    @fcir.program(placements={"silos": 2, "clients": 3})
    def program(w, x):
        def one_round(w, _):
            def silo(w, x):
                return fcir.reduce_mean(fcir.map_fn(lambda w, x: jnp.tanh(x @ w),
                                                    (fcir.broadcast(w), x)))

            return w + 0.1 * jnp.sum(fcir.reduce_mean(fcir.map_fn(silo, (fcir.broadcast(w), x)))), None

        return jax.lax.scan(one_round, w, None, length=length)[0]

    return program


@pytest.mark.parametrize("length", [1, 2])
def test_gradient_wrt_client_data_through_a_server_scan_over_silos(length):
    # The backward scan carries the cotangent of x as {{f32[5,3]}@clients}@silos and
    # adds each round's to it: an elementwise op per member of the nested placement.
    program = silo_scan(length)
    args = _f(3), _f(2, 3, 5, 3)
    m = assert_runs_everywhere(fcir.program(placements={"silos": 2, "clients": 3})(
        jax.grad(_loss(program), (0, 1))), *args)
    (back,) = [op for op in m.main.body.ops if op.name == "jax.scan"][1:]
    assert "{{f32[5,3]}@clients}@silos" in [str(r.type) for r in back.results]
    # A hand-edited nested add whose result is typed at the server does not check.
    text = m.to_text()
    line = next(ln for ln in text.splitlines() if "= jax.add_any" in ln and "}@silos =" in ln)
    bad = text.replace(line, line.replace("{{f32[5,3]}@clients}@silos =", "f32[2,3,5,3]@server ="))
    assert bad != text
    with pytest.raises(PlacementError, match="local/C1"):
        fcir.check(fcir.parse(bad))


# --- second-order and batched gradients of multi-round scans -------------------------------


def _server_lr_objective():
    from tests.corpus import scan_rounds

    program = scan_rounds.build()
    w, m, lr, x, y = scan_rounds.make_args()

    def objective(lr, w, m, x, y):
        w, m, losses = program(w, m, lr, x, y)
        return jnp.sum(w**2) + jnp.sum(losses)

    return objective, (lr, w, m, x, y)


@pytest.mark.slow  # 5 s (docs/contributing.md)
def test_hessian_and_batched_gradients_wrt_the_server_learning_rate():
    # JAX's scan batching stacks the batched per-round client residuals with the batch
    # axis first (transposes of placed values at the server); the IR keeps them placed,
    # member axis first, and drops the transposes.
    objective, (lr, *rest) = _server_lr_objective()
    hessian = clients(jax.hessian(objective))
    m = assert_runs_everywhere(hessian, lr, *rest)
    assert "jax.transpose" not in "\n".join(
        ln for ln in m.to_text().splitlines() if "@clients =" in ln
    )
    lrs = jnp.asarray([0.3, 0.7, 1.1, 1.5], jnp.float32)
    batched = clients(jax.vmap(jax.grad(objective), in_axes=(0, None, None, None, None)))
    assert_runs_everywhere(batched, lrs, *rest)


# --- a second exchange only when the aggregate says so ------------------------------------


def _mean_loss(w, x, y):
    per_client = fcir.map_fn(lambda w, x, y: jnp.mean((x @ w - y) ** 2), (fcir.broadcast(w), x, y))
    return fcir.reduce_mean(per_client)


def adaptive(threshold, python_if):
    @clients
    def program(w, x, y):
        w = fed_round(w, x, y)
        again = _mean_loss(w, x, y) > threshold
        if python_if:
            return fed_round(w, x, y) if again else w
        return jax.lax.cond(again, lambda w: fed_round(w, x, y), lambda w: w, w)

    return program


@pytest.mark.parametrize("threshold", [-1.0, 1e6], ids=["second_exchange", "none"])
def test_gradient_of_an_aggregate_deciding_a_second_exchange(threshold):
    # Written with a Python `if`, jax.grad runs it eagerly, but capture (like jax.jit)
    # has no value to branch on: an FcirError that says to use jax.lax.cond...
    eager = jax.grad(_loss(adaptive(threshold, True)), (0, 1, 2))
    want = eager(W, X, Y)
    with pytest.raises(fcir.UnsupportedError, match=r"jax\.lax\.cond\(pred, second_exchange"):
        fcir.capture(clients(eager), W, X, Y)
    # ...whose gradient captures, checks and computes what the eager gradient does.
    grad = clients(jax.grad(_loss(adaptive(threshold, False)), (0, 1, 2)))
    m = assert_runs_everywhere(grad, W, X, Y)
    assert any(op.name == "jax.cond" for op in m.main.body.ops)
    for got, exp in zip(reference.run(m, W, X, Y), want):
        np.testing.assert_allclose(np.asarray(got), np.asarray(exp), rtol=1e-5, atol=1e-6)
