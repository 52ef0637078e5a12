"""``xla.compile(module, members="loop")``: members one after another, convolutions in
XLA:CPU's canonical layout (fcir/interpreters/xla/members.py).

What it promises and these tests pin: on CPU its results are bitwise ``jax.jit`` of the
sequential form (the members as a Python loop, whose convolutions XLA canonicalizes
itself); every corpus program computes what the default (vmapped) lowering computes,
to float rounding (the streaming tests' tolerance), integer and order-statistic
results exactly; every convolution it hands to XLA is canonical, in the member loop,
in a streamed chunk loop and at top level; ``"auto"`` picks the loop for
convolutional clients on CPU only; a mesh, an unknown value and a compiled round
given to ``simulate`` with ``members`` are refused.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from corpus import case
from fcir.interpreters import xla
from fcir.interpreters.xla import members as M
from fcir.interpreters.xla.interpreter import XlaInterpreter
from test_xla_streaming import EXACT, FAST, assert_streamed_equal, tolerance

import fcir
from fcir.errors import FcirError

N, STEPS, BATCH, HW, C, F, CLASSES = 3, 2, 2, 6, 2, 4, 3


def conv(x, w):
    dn = ("NHWC", "HWIO", "NHWC")
    return jax.lax.conv_general_dilated(x, w, (1, 1), "VALID", dimension_numbers=dn)


def loss(p, x, y):
    h = jax.nn.relu(conv(x, p["k"]))
    logits = h.reshape(h.shape[0], -1) @ p["d"]
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], 1))


def client(p, x, y):
    """Local SGD over ``STEPS`` batches (a scan: a convolution's gradient in a loop)."""

    def step(p, b):
        v, g = jax.value_and_grad(loss)(p, *b)
        return jax.tree.map(lambda w, d: w - 0.1 * d, p, g), v

    trained, losses = jax.lax.scan(step, p, (x, y))
    return jax.tree.map(jnp.subtract, trained, p), jnp.mean(losses)


@fcir.program(placements={"clients": N})
def cnn_round(p, x, y):
    deltas, losses = fcir.map_fn(client, (fcir.broadcast(p), x, y))
    return jax.tree.map(jnp.add, p, fcir.reduce_mean(deltas)), fcir.reduce_sum(losses)


def cnn_args():
    rng = np.random.default_rng(0)
    flat = (HW - 2) ** 2 * F
    p = {
        "k": rng.normal(0, 0.3, (3, 3, C, F)).astype(np.float32),
        "d": rng.normal(0, 0.1, (flat, CLASSES)).astype(np.float32),
    }
    x = rng.normal(size=(N, STEPS, BATCH, HW, HW, C)).astype(np.float32)
    y = rng.integers(0, CLASSES, (N, STEPS, BATCH)).astype(np.int32)
    return p, x, y


@pytest.fixture(scope="module")
def cnn_module():
    return fcir.capture(cnn_round, *cnn_args())


@pytest.fixture(scope="module")
def cnn_runs(cnn_module):
    """Each lowering's executable and results on ``cnn_args()``, compiled once."""
    args = cnn_args()
    runs = {}
    for name, kw in [("vmap", {}), ("loop", {"members": "loop"}),
                     ("streamed", {"members": "loop", "clients_per_step": 2})]:  # fmt: skip
        exe = xla.compile(cnn_module, **kw)
        runs[name] = (exe, exe(*args))
    return runs


@fcir.program(placements={"clients": N})
def sequential_round(p, x, y):
    """``cnn_round`` with its ``fed.map`` written as a Python loop over the members."""
    outs = [client(p, x[i], y[i]) for i in range(N)]
    deltas, losses = jax.tree.map(lambda *m: jnp.stack(m), *outs)
    return jax.tree.map(jnp.add, p, fcir.reduce_mean(deltas)), fcir.reduce_sum(losses)


def dim_labels(exe) -> set[str]:
    """The layouts of every convolution in the HLO handed to XLA."""
    return set(re.findall(r"dim_labels=([^,\s]+)", exe.as_text("hlo")))


CANONICAL = {"b01f_01io->b01f"}


def test_loop_is_jit_of_the_members_one_after_another(cnn_runs):
    got = cnn_runs["loop"][1]
    want = jax.jit(sequential_round)(*cnn_args())
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    # vmapped (grouped convolutions) and streamed in chunks: the same to rounding
    for other in ("vmap", "streamed"):
        assert_streamed_equal(got, cnn_runs[other][1], exact=False, what=f"loop vs {other}")


def test_every_convolution_handed_to_xla_is_canonical(cnn_runs):
    assert dim_labels(cnn_runs["vmap"][0]) - CANONICAL  # the gradient's, as JAX writes it
    assert dim_labels(cnn_runs["loop"][0]) == CANONICAL
    assert dim_labels(cnn_runs["streamed"][0]) == CANONICAL


def test_members_run_one_at_a_time_in_a_loop(cnn_runs):
    """vmap groups the members' convolutions into one (a kernel per member); the loop
    keeps one member's convolution, in a while loop of its own."""
    grouped = re.compile(r"(?:feature|batch)_group_count=(\d+)")
    vmap, loop = (cnn_runs[k][0].as_text("hlo") for k in ("vmap", "loop"))
    assert {int(g) for g in grouped.findall(vmap)} == {N}
    assert not grouped.findall(loop)
    assert loop.count(" while(") == vmap.count(" while(") + 1  # the member loop


LAYOUTS = [  # (lhs shape, rhs shape, dimension numbers, other params)
    ((2, 5, 6, 3), (3, 2, 3, 4), ("NHWC", "HWIO", "NHWC"), {}),
    ((2, 3, 6, 5), (4, 3, 3, 2), ("NCHW", "OIHW", "NCHW"), {"window_strides": (2, 1)}),
    # a kernel gradient's layout: batch and features swapped
    ((2, 6, 6, 3), (2, 4, 4, 5), ("CHWN", "IHWO", "HWNC"), {}),
    ((2, 7, 7, 4), (3, 3, 2, 6), ("NHWC", "HWIO", "NCHW"),
     {"padding": ((1, 2), (0, 1)), "rhs_dilation": (2, 1), "feature_group_count": 2}),
]  # fmt: skip


@pytest.mark.parametrize("lhs_shape,rhs_shape,dn,extra", LAYOUTS)
def test_canonical_conv_is_the_convolution_it_rewrites(lhs_shape, rhs_shape, dn, extra):
    rng = np.random.default_rng(1)
    lhs = rng.normal(size=lhs_shape).astype(np.float32)
    rhs = rng.normal(size=rhs_shape).astype(np.float32)
    kw = {"window_strides": (1, 1), "padding": "VALID", **extra, "dimension_numbers": dn}
    closed = jax.make_jaxpr(lambda a, b: jax.lax.conv_general_dilated(a, b, **kw))(lhs, rhs)
    (eqn,) = closed.jaxpr.eqns
    got = jax.jit(lambda a, b: M.canonical_conv(a, b, eqn.params))(lhs, rhs)
    want = jax.jit(lambda a, b: jax.lax.conv_general_dilated(a, b, **kw))(lhs, rhs)
    assert got.shape == want.shape
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


# One program per feature a member loop must carry (compile time is what these cost):
# plain local training, nested placements, a map inside a scan of rounds, members'
# keys, order statistics, integer secure sums, bfloat16 members.
LOOPED = ("fedavg_mlp", "hierarchical_fedavg", "scan_rounds", "client_rng", "robust_agg",
          "secure_histogram", "bf16_client")  # fmt: skip


@pytest.mark.parametrize("name", LOOPED)
def test_corpus_program_loops_like_vmapped(name):
    c = case(name)
    args = c.make_args()
    module = fcir.capture(c.fn, *args)

    def both(*a):
        return XlaInterpreter().run(module, *a), M.LoopInterpreter().run(module, *a)

    want, got = jax.jit(both).lower(*args).compile(FAST)(*args)
    what = f"{name} loop"
    assert_streamed_equal(got, want, exact=name in EXACT, what=what, tol=tolerance(name))


def test_auto_loops_for_convolutional_clients_on_cpu_only(cnn_module):
    plain = fcir.capture(case("fedavg_mlp").fn, *case("fedavg_mlp").make_args())
    # The loop is for XLA:CPU's convolutions (the module docstring); an accelerator
    # runs the vmapped members' convolutions as one batched convolution.
    on_cpu = jax.default_backend() == "cpu"
    assert M.check_members("auto", None, cnn_module) == ("loop" if on_cpu else "vmap")
    assert M.check_members("auto", None, plain) == "vmap"
    mesh = jax.make_mesh((1,), ("clients",))
    assert M.check_members("auto", mesh, cnn_module) == "vmap"
    assert M.convolutional_members(cnn_module) and not M.convolutional_members(plain)


def test_bad_members_are_fcir_errors(cnn_module):
    with pytest.raises(FcirError, match="members must be one of"):
        xla.compile(cnn_module, members="serial")
    with pytest.raises(FcirError, match="one device"):
        xla.compile(cnn_module, jax.make_mesh((1,), ("clients",)), members="loop")


def test_simulate_runs_the_rounds_with_the_member_loop():
    rng = np.random.default_rng(2)
    p, _, _ = cnn_args()
    clients = [
        (rng.normal(size=(STEPS, BATCH, HW, HW, C)).astype(np.float32),
         rng.integers(0, CLASSES, (STEPS, BATCH)).astype(np.int32))
        for _ in range(2 * N)
    ]  # fmt: skip
    cohorts = fcir.Population.from_clients(clients).uniform(N, seed=0)

    @fcir.program(placements={"clients": N})
    def round_(p, data, counts):
        del counts  # every client has all its examples
        deltas, _ = fcir.map_fn(client, (fcir.broadcast(p), *data))
        return jax.tree.map(jnp.add, p, fcir.reduce_mean(deltas))

    module = fcir.capture(round_, p, *cohorts.specs())
    run = {m: xla.simulate(module, p, cohorts, 2, loop="host", members=m)[0]
           for m in ("auto", "loop", "vmap")}  # fmt: skip
    auto = "loop" if jax.default_backend() == "cpu" else "vmap"  # convolutions: see above
    for a, b in zip(jax.tree.leaves(run["auto"]), jax.tree.leaves(run[auto])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert_streamed_equal(run["loop"], run["vmap"], exact=False, what="simulate loop")
    exe = xla.compile(module)
    with pytest.raises(FcirError, match="already compiled"):
        xla.simulate(exe, p, cohorts, 1, members="loop")
