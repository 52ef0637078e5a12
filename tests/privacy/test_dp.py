"""fed.dp_sum / fed.dp_mean, private programs and the accountant (fcir.privacy).

Semantics are pinned against a plain-JAX oracle written from the definition: clip each
member's pytree to global L2 norm ``clip`` (less ``clip_margin``, the float error of
the clip, with the squared norm added in ``pairwise_sum``'s order), add the members in
member order, add ``z * clip * standard_normal(fold_in(key, i))`` (``fcir.mechanisms.gaussian``) to leaf ``i`` (and divide by
n for the mean).
"""

from __future__ import annotations

import json

import dp_accounting as dpa
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fcir.interpreters import reference, xla

import fcir
from fcir.mechanisms.clipping import clip_margin, pairwise_sum
from fcir.mechanisms.gaussian import standard_normal

N = 4
CLIP, Z = 1.5, 0.8


def oracle(xs: dict, key, clip: float, z: float, mean: bool, zero=(0,)) -> dict:
    """The definition, eagerly, member by member; ``zero``: the all-zero members (known
    in advance, so the oracle can be differentiated)."""
    names = sorted(xs)  # pytree order of a dict
    n = xs[names[0]].shape[0]
    totals = None
    for m in range(n):
        leaves = [xs[k][m] for k in names]
        sq = pairwise_sum(jnp.stack([pairwise_sum(jnp.square(v).reshape(-1)) for v in leaves]))
        paths = (max(v.size for v in leaves) - 1).bit_length() + (len(leaves) - 1).bit_length()
        c = clip * (1 - clip_margin(paths, jnp.float32))
        scale = 1.0 if m in zero else jnp.minimum(1.0, c / jnp.sqrt(sq))
        clipped = [leaf * scale for leaf in leaves]
        totals = clipped if totals is None else [t + c for t, c in zip(totals, clipped)]
    out = {}
    for i, (k, t) in enumerate(zip(names, totals)):
        normal = standard_normal(jax.random.fold_in(key, i), t.shape, t.dtype)
        noisy = t + z * clip * normal
        out[k] = noisy / n if mean else noisy
    return out


def client_values():
    """Member 0 all zero (stays zero), member 1 inside the clip ball, 2 and 3 outside."""
    rng = np.random.default_rng(0)
    a = rng.normal(size=(N, 3)).astype(np.float32)
    b = rng.normal(size=(N, 2, 2)).astype(np.float32)
    a[0], b[0] = 0, 0
    a[1], b[1] = a[1] * 0.05, b[1] * 0.05
    a[3] *= 10
    return {"a": jnp.asarray(a), "b": jnp.asarray(b)}


def make_round(dp, clip=CLIP, z=Z, private=True):
    @fcir.program(placements={"clients": N}, private=private)
    def dp_round(w, key, xs):
        at_clients = fcir.broadcast(w)
        scaled = fcir.map_fn(lambda w, x: jax.tree.map(lambda v: v * w, x), (at_clients, xs))
        return dp(scaled, clip, z, key)

    return dp_round


W = jnp.float32(1.25)
KEY = jax.random.key(7)


@pytest.mark.parametrize("name", ["dp_sum", "dp_mean"])
def test_reference_is_the_definition_bit_for_bit(name):
    dp = getattr(fcir, name)
    rnd = make_round(dp)
    xs = client_values()
    module = fcir.capture(rnd, W, KEY, xs)
    assert f"fed.{name}" in module.to_text()
    got = reference.run(module, W, KEY, xs)
    want = oracle(jax.tree.map(lambda v: v * W, xs), KEY, CLIP, Z, name == "dp_mean")
    for k in want:
        np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want[k]), err_msg=k)
    # The raw (uint32[2]) key form draws the same noise as its typed key.
    raw = jax.random.key_data(KEY)
    got_raw = reference.run(fcir.capture(rnd, W, raw, xs), W, raw, xs)
    for k in want:
        np.testing.assert_array_equal(np.asarray(got_raw[k]), np.asarray(want[k]))


def test_xla_backend_is_jit_bitwise_and_the_gradient_is_the_oracles():
    rnd = make_round(fcir.dp_mean)
    xs = client_values()
    module = fcir.capture(rnd, W, KEY, xs)
    got = xla.compile(module)(W, KEY, xs)
    want = jax.jit(rnd)(W, KEY, xs)
    for k in want:
        np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want[k]))

    # Gradients: the noise is a constant, the clipping is differentiated. Member 0 is
    # zero (its gradient must stay finite), member 1 unclipped, 2 and 3 clipped.
    def objective(w, xs):
        out = rnd(w, KEY, xs)
        return jnp.sum(out["a"] * jnp.arange(3.0)) + jnp.sum(jnp.cos(out["b"]))

    def oracle_objective(w, xs):
        out = oracle(jax.tree.map(lambda v: v * w, xs), KEY, CLIP, Z, True)
        return jnp.sum(out["a"] * jnp.arange(3.0)) + jnp.sum(jnp.cos(out["b"]))

    g = jax.jit(jax.grad(objective, argnums=(0, 1)))(W, xs)
    g_want = jax.jit(jax.grad(oracle_objective, argnums=(0, 1)))(W, xs)
    for got_leaf, want_leaf in zip(jax.tree.leaves(g), jax.tree.leaves(g_want)):
        assert np.all(np.isfinite(np.asarray(got_leaf)))
        np.testing.assert_allclose(
            np.asarray(got_leaf), np.asarray(want_leaf), rtol=2e-5, atol=1e-6
        )
    # The derivative stays federated: captured, it checks, and its IR computes it. (Of
    # the round declared private it is private too, and a leak: tests/privacy/test_dp_transforms.py)
    public = make_round(fcir.dp_mean, private=False)

    def public_objective(w, xs):
        out = public(w, KEY, xs)
        return jnp.sum(out["a"] * jnp.arange(3.0)) + jnp.sum(jnp.cos(out["b"]))

    grad_round = fcir.program(placements={"clients": N})(jax.grad(public_objective, argnums=(0, 1)))
    gm = fcir.capture(grad_round, W, xs)
    g_ref = xla.compile(gm)(W, xs)
    for got_leaf, want_leaf in zip(jax.tree.leaves(g_ref), jax.tree.leaves(g_want)):
        np.testing.assert_allclose(
            np.asarray(got_leaf), np.asarray(want_leaf), rtol=2e-5, atol=1e-6
        )


def test_noise_std_is_noise_multiplier_times_clip_norm():
    clip, z, keys, size = 0.7, 1.3, 40, 500
    zeros = {"x": jnp.zeros((N, size), jnp.float32)}  # the sum is pure noise

    @jax.jit
    @fcir.program(placements={"clients": N})
    def noise_only(key, xs):
        return fcir.dp_sum(xs, clip, z, key)

    base = jax.random.key(1234)  # fixed seed: the test is deterministic
    samples = np.concatenate(
        [np.asarray(noise_only(jax.random.fold_in(base, k), zeros)["x"]) for k in range(keys)]
    )
    count = samples.size  # 20000 draws
    std = samples.std(ddof=1)
    # The sample std of a normal has standard error sigma / sqrt(2 (count - 1)): allow 5.
    sigma = z * clip
    assert abs(std - sigma) < 5 * sigma / np.sqrt(2 * (count - 1)), (std, sigma)
    assert abs(samples.mean()) < 5 * sigma / np.sqrt(count)
    # Batched over keys (jax.vmap), each key draws what it draws alone.
    keys = jnp.stack([jax.random.fold_in(base, k) for k in range(2)])
    batched = jax.vmap(noise_only, in_axes=(0, None))(keys, zeros)["x"]
    np.testing.assert_array_equal(np.asarray(batched).ravel(), samples[: 2 * size])


def two_op_round():
    @fcir.program(placements={"clients": N}, private=True)
    def two_ops(key, xs):
        first = fcir.dp_sum(xs, 1.0, 1.1, jax.random.fold_in(key, 0))

        def body(carry, i):  # three more releases per round, of the members' copies
            copies = fcir.map_fn(lambda c: {"x": c * 2.0}, fcir.broadcast(carry))
            noisy = fcir.dp_mean(copies, 2.0, 2.5, jax.random.fold_in(key, i))
            return carry + noisy["x"], None

        total, _ = jax.lax.scan(body, first["x"], jnp.arange(1, 4))
        return total

    return fcir.capture(two_ops, KEY, {"x": jnp.zeros((N, 3))})


def test_epsilon_is_dp_accountings_figure_for_the_same_events():
    module = two_op_round()
    rels = fcir.privacy.releases(module)
    assert [(r.op, r.noise_multiplier, r.count) for r in rels] == [
        ("fed.dp_sum", 1.1, 1),
        ("fed.dp_mean", 2.5, 3),  # inside a scan of length 3
    ]
    rounds, delta = 5, 1e-5
    one_round = dpa.ComposedDpEvent([dpa.GaussianDpEvent(1.1)] + [dpa.GaussianDpEvent(2.5)] * 3)
    by_hand = dpa.SelfComposedDpEvent(one_round, rounds)
    want = dpa.rdp.RdpAccountant().compose(by_hand).get_epsilon(delta)
    assert fcir.privacy.epsilon(module, rounds, delta) == pytest.approx(want, rel=1e-9)
    # PLD (tighter; slower, so one round here). Its discretized distributions compose
    # a repeated release by self-convolution, the hand-written list one by one: equal
    # up to the discretization, not to the last bit.
    want = dpa.pld.PLDAccountant().compose(one_round).get_epsilon(delta)
    got = fcir.privacy.epsilon(module, 1, delta, accountant="pld")
    assert got == pytest.approx(want, rel=1e-6)
    assert got < fcir.privacy.epsilon(module, 1, delta)
    # Poisson sampling of clients: the accountant's amplified figure.
    rnd = fcir.capture(make_round(fcir.dp_mean), W, KEY, client_values())
    sampled = dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(0.1, dpa.GaussianDpEvent(Z)), 20)
    want = dpa.rdp.RdpAccountant().compose(sampled).get_epsilon(delta)
    assert fcir.privacy.epsilon(rnd, 20, delta, sampling_rate=0.1) == pytest.approx(want)
    # More rounds cost more; the cost report and `fcir show` state one round's cost.
    assert fcir.privacy.epsilon(rnd, 2, delta) > fcir.privacy.epsilon(rnd, 1, delta)
    cost = fcir.privacy.round_cost(module)
    assert cost["epsilon_per_round"] == pytest.approx(fcir.privacy.epsilon(module, 1, 1e-5))
    with pytest.raises(fcir.PrivacyError, match="delta"):
        fcir.privacy.epsilon(module, 3, 0.0)


XS = {"x": jnp.ones((N, 3))}


def _leaky_programs():
    def aggregate(reduce):
        def round_(key, xs):
            return reduce(xs["x"])

        return round_

    def weighted(key, xs):
        weights = fcir.map_fn(lambda x: jnp.sum(x) + 1.0, xs["x"])
        return fcir.reduce_weighted_mean(xs["x"], weights)

    def secure(key, xs):
        return fcir.secure_sum(xs["x"].astype(jnp.int32), bitwidth=8)

    def returned(key, xs):
        noisy = fcir.dp_sum(xs, 1.0, 1.0, key)
        return noisy, fcir.map_fn(lambda x: x * 2.0, xs["x"])

    def after_dp(key, xs):  # the DP op is fine; the extra plain mean of the data is not
        noisy = fcir.dp_mean(xs, 1.0, 1.0, key)
        return noisy["x"] + fcir.reduce_mean(xs["x"])

    return [
        (aggregate(fcir.reduce_sum), "fed.sum", "privacy/C1"),
        (aggregate(fcir.reduce_mean), "fed.mean", "privacy/C1"),
        (aggregate(fcir.reduce_min), "fed.min", "privacy/C1"),
        (aggregate(fcir.reduce_max), "fed.max", "privacy/C1"),
        (weighted, "fed.weighted_mean", "privacy/C1"),
        (secure, "fed.secure_sum", "privacy/C1"),
        (returned, "fed.map", "privacy/C2"),
        (after_dp, "fed.mean", "privacy/C1"),
    ]


@pytest.mark.parametrize(
    "fn,op,code", _leaky_programs(), ids=lambda v: getattr(v, "__name__", str(v))
)
def test_each_leak_is_rejected_naming_the_op(fn, op, code):
    prog = fcir.program(placements={"clients": N}, private=True)(fn)
    with pytest.raises(fcir.PrivacyError) as info:
        fcir.capture(prog, KEY, XS)
    msg = str(info.value)
    assert msg.startswith(f"{op} (op "), msg
    assert f"{code}: " in msg and "fcir.dp_sum / fcir.dp_mean" in msg
    # The same program, not declared private, is an ordinary program.
    fcir.capture(fcir.program(placements={"clients": N})(fn), KEY, XS)


def test_a_leak_free_private_program_passes_and_round_trips():
    @fcir.program(placements={"clients": N}, private=True)
    def clean(w, key, xs):
        at = fcir.broadcast(w)
        # Server-only data may be aggregated freely: every client's copy of the model.
        check = fcir.reduce_sum(fcir.map_fn(lambda m: m * 2.0, at))
        upd = fcir.map_fn(lambda m, x: {"x": x["x"] * m}, (at, xs))
        noisy = fcir.dp_mean(upd, 1.0, 1.0, key)

        def body(c, i):  # fed ops inside server control flow are followed too
            copies = fcir.map_fn(lambda m: {"x": m + 1.0}, fcir.broadcast(c))
            return c + fcir.dp_sum(copies, 1.0, 2.0, jax.random.fold_in(key, i))["x"], None

        looped, _ = jax.lax.scan(body, noisy["x"], jnp.arange(2))
        return looped * check

    module = fcir.capture(clean, W, KEY, XS)
    assert module.private
    text = module.to_text()
    assert text.splitlines()[0].endswith(" private")
    for again in (fcir.parse(text), fcir.Module.deserialize(module.serialize())):
        assert again.private and again.to_text() == text
        fcir.check(again)
    # Editing the IR is caught when the module is checked again: turn the DP op into a
    # plain mean and the privacy check names it.
    bad = fcir.parse(text)
    op = next(o for o in bad.main.body.ops if o.name == "fed.dp_mean")
    op.name, op.operands, op.attrs = "fed.mean", op.operands[:1], {}
    with pytest.raises(fcir.PrivacyError, match=r"^fed.mean \(op"):
        fcir.check(bad)


# Control flow that carries client-placed values (what fcir's capture is being taught
# to produce): the leak check follows values through regions by position, loops to a
# fixpoint, and treats a client-derived branch index as flowing into every result.
LOOP = """\
fcir.module @loop ir_version=1 placements=[clients:2] private
func @main(%0: f32[3]@server, %1: {f32[3]}@clients) -> (f32[3]@server) {
  %2: {f32[3]}@clients = fed.map %0 {
    ^member(%3: f32[3]):
      yield %3
  }
  %4: f32[3]@server, %5: {f32[3]}@clients = jax.scan %1, %0, %2 {jaxpr=^0, length=2, \
num_carry=2, num_consts=1, reverse=false, unroll=1} {
    ^r0(%6: {f32[3]}@clients, %7: f32[3]@server, %8: {f32[3]}@clients):
      %9: f32[3]@server = SUM %8
      %10: f32[3]@server = jax.add %7, %9
      yield %10, %6
  }
  return %4
}
"""
IMPLICIT = """\
fcir.module @implicit ir_version=1 placements=[clients:2] private
func @main(%0: f32[3]@server, %1: {i32[]}@clients) -> (f32[3]@server) {
  %2: f32[3]@server = jax.cond %1, %0 {branches=[^0, ^1]} {
    ^r0(%3: f32[3]@server):
      %4: f32[3]@server = jax.neg %3
      yield %4
  }, {
    ^r1(%5: f32[3]@server):
      yield %5
  }
  return %2
}
"""


def test_leaks_are_followed_through_server_control_flow():
    # The carried value is a copy of server data in the first iteration and client
    # data from the second on: only the fixpoint sees the sum leak.
    (leak,) = fcir.privacy.leaks(fcir.parse(LOOP.replace("SUM", "fed.sum")))
    assert (leak.code, leak.op.name, leak.path) == ("privacy/C1", "fed.sum", (1, 0, 0))
    (leak,) = fcir.privacy.leaks(fcir.parse(IMPLICIT))
    assert (leak.code, leak.op.name, leak.path) == ("privacy/C3", "jax.cond", (0,))
    # The fed.sum of the first iteration alone (server data) would be fine.
    clean = LOOP.replace("SUM", "fed.sum").replace("yield %10, %6", "yield %10, %8")
    assert fcir.privacy.leaks(fcir.parse(clean)) == []


def test_production_clips_at_clients_sums_and_adds_noise_at_the_server(tmp_path):
    from fcir.interpreters import production

    rnd = make_round(fcir.dp_mean)
    xs = client_values()
    raw = jax.random.key_data(KEY)  # production wire types have no key dtype: raw bits
    module = fcir.capture(rnd, W, raw, xs)
    plan = production.export(module)
    client = plan.parts["client_work"].to_text()
    assert "jax.sqrt" in client and "fed.map" in client  # the per-client clip
    agg = plan.parts["client_to_server_aggregation"]
    assert [op.name for op in agg.main.body.ops] == ["fed.sum", "fed.sum"]
    assert [a.intrinsic for a in plan.split.aggregations] == ["federated_sum"] * 2
    server = plan.parts["server_result"].to_text()
    assert "jax.random_fold_in" in server and "random_bits" in server  # the noise
    out = plan.write(tmp_path / "bundle")
    manifest = json.loads((out / "manifest.json").read_text())
    (release,) = manifest["privacy"]["releases"]
    assert release == {"op": "fed.dp_mean", "clip_norm": CLIP, "noise_multiplier": Z, "count": 1}
    assert manifest["privacy"]["private_program_checked"] is True
    want = reference.run(module, W, raw, xs)
    got = production.run_bundle(out, W, raw, xs)
    for k in want:
        np.testing.assert_allclose(np.asarray(got[k]), np.asarray(want[k]), rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # runs the digits example end to end (docs/contributing.md: examples are slow)
def test_example_trains_on_digits_and_draws_its_picture(tmp_path, capsys):
    from examples_testing import load

    png = tmp_path / "dp.png"
    curves = load("dp_fedavg_digits").main(["--rounds", "3", "--output", str(png)])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # Without DP, three rounds of FedAvg over 50 non-IID clients reach 80% held out.
    assert curves["fedavg"][-1] >= 0.80, curves
    assert len(curves["dp_fedavg"]) == 3
    eps = curves["epsilon"]
    assert 0 < eps[0] < eps[1] < eps[2]
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("round 1/3 | FedAvg acc ") and " | ε " in lines[0]
