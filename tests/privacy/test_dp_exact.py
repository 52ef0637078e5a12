"""Central DP in exact mode (``fcir.dp_sum`` / ``fcir.dp_mean`` with ``exact=True``,
``fcir.mechanisms.lattice``): every released float is ``k * gamma`` for an integer
``k`` (read from its bits), every backend releases the same bits, and the accountant
charges the grid's rounding and the sampler's δ."""

from __future__ import annotations

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fcir.interpreters import reference, xla

import fcir
from fcir.mechanisms import lattice

N = 5


def _round(mean: bool, dtype=jnp.float32, gamma=None, z=1.1, clip=1.0, exact=True):
    op = fcir.dp_mean if mean else fcir.dp_sum

    @fcir.program(placements={"clients": N}, private=z > 0)  # z=0 claims nothing
    def round_(w, key, x):
        upd = fcir.map_fn(
            lambda w, x: {"a": (x - w).astype(dtype), "b": x[:2] * 2.0}, (fcir.broadcast(w), x)
        )
        return op(upd, clip, z, key, exact=exact, gamma=gamma)

    return round_


def _args(seed=0):
    return (
        jnp.zeros(3),
        jax.random.key(seed),
        jax.random.normal(jax.random.key(seed + 1), (N, 3)) * 3.0,
    )


def _grid_integers(x, gamma: float) -> np.ndarray:
    """``x / gamma`` read from the bits: each float's exact value (a dyadic rational,
    through float64, which holds bf16/f16/f32 exactly) divided by a power of two,
    asserted to be an integer."""
    exact = np.asarray(x).astype(np.float64) / gamma
    assert np.all(np.isfinite(exact)) and np.array_equal(exact, np.round(exact)), exact
    return exact.astype(np.int64)


def _mixed(mean: bool):
    """A round releasing float32, bfloat16 and float16 leaves at once (one compile)."""
    op = fcir.dp_mean if mean else fcir.dp_sum

    @fcir.program(placements={"clients": N}, private=True)
    def round_(w, key, x):
        def member(w, x):
            u = x - w
            return {"a": u, "b": u[:2].astype(jnp.bfloat16), "c": u.astype(jnp.float16)}

        return op(fcir.map_fn(member, (fcir.broadcast(w), x)), 1.0, 1.1, key, exact=True)

    return round_


# dp_mean is slow; dp_sum stays in the fast tier (docs/contributing.md)
@pytest.mark.parametrize(
    "mean", [pytest.param(False, id="dp_sum"), pytest.param(True, id="dp_mean", marks=pytest.mark.slow)]
)
def test_every_release_is_a_lattice_point_and_every_backend_releases_the_same_bits(mean):
    fn, args = _mixed(mean), _args()
    m = fcir.capture(fn, *args)
    (op,) = [o for o in m.main.body.ops if "gamma" in o.attrs]
    gamma = op.attrs["gamma"]
    assert gamma == lattice.default_gamma(1.0, 8)
    a = reference.run(m, *args)
    # the compiled programs only for the mean: the sum's integers take the same path
    got = {"xla": xla.compile(m)(*args)} if not mean else {
        "xla": xla.compile(m)(*args),
        "streamed": xla.compile(m, clients_per_step=2)(*args),
        "jit": jax.jit(fn)(*args),
    }
    for k, dtype in (("a", jnp.float32), ("b", jnp.bfloat16), ("c", jnp.float16)):
        assert a[k].dtype == dtype
        for name, out in got.items():
            assert np.array_equal(np.asarray(a[k]).view(np.uint8), np.asarray(out[k]).view(np.uint8)), (name, k)
        ks = _grid_integers(a[k], gamma)  # read from the bits: value / gamma is an integer
        assert np.all(np.abs(ks) <= lattice.K_MAX) and np.any(ks != 0)
    assert not np.array_equal(a["a"], reference.run(m, args[0], jax.random.key(7), args[2])["a"])


def test_the_integers_are_the_clipped_sum_on_the_grid_plus_integer_noise():
    """Without noise, the release is the members' grid points summed: within
    ``n * gamma / 2`` of the float clipped sum in each coordinate, and a lattice point."""
    args = _args()
    m = fcir.capture(_round(False, z=0.0, gamma=2.0**-6), *args)
    out = reference.run(m, *args)
    plain = reference.run(fcir.capture(_round(False, z=0.0, exact=False), *args), *args)
    for k in out:
        assert np.max(np.abs(np.asarray(out[k]) - np.asarray(plain[k]))) <= N * 2.0**-7
        _grid_integers(out[k], 2.0**-6)


def test_the_accountant_charges_the_rounding_and_the_sampler():
    args = _args()
    exact = fcir.capture(_round(True, gamma=2.0**-4), *args)
    central = fcir.capture(_round(True, exact=False), *args)
    (r,) = fcir.privacy.releases(exact)
    d = 5  # elements of a member: a[3] and b[2]
    want = 1.1 / (1 + math.sqrt(d) * 2.0**-4 / 2)
    assert r.gamma == 2.0**-4 and math.isclose(r.accounted_noise_multiplier, want, rel_tol=1e-12)
    assert r.local_stddev == 1.1 * 16 and r.coordinates == d
    import dp_accounting as dpa

    acc = dpa.rdp.RdpAccountant()
    acc.compose(dpa.SelfComposedDpEvent(dpa.GaussianDpEvent(want), 10))
    assert fcir.privacy.epsilon(exact, 10, 1e-5) == acc.get_epsilon(1e-5)
    assert fcir.privacy.epsilon(exact, 10, 1e-5) > fcir.privacy.epsilon(central, 10, 1e-5)
    cost = fcir.privacy.round_cost(exact)
    lines = fcir.privacy.format_round_cost(cost)
    assert f"exact gamma=0.0625 (accounted as {want:.4g})" in lines[1]
    # the sampler's total variation (tiny: about 1e-26 here) is stated and goes into δ
    assert 0 < cost["sampler_tv_per_round"] < 1e-20 and "delta_with_sampler" in cost
    budget = fcir.privacy.Budget(exact, 1e-5, 100.0)
    budget.spend(10)
    assert budget.epsilon == fcir.privacy.epsilon(exact, 10, 1e-5)
    with pytest.raises(fcir.PrivacyError, match="no amplification by sampling"):
        fcir.privacy.epsilon(exact, 10, 1e-5, 0.5)
    with pytest.raises(fcir.PrivacyError, match="accountant='rdp'"):
        fcir.privacy.epsilon(exact, 10, 1e-5, accountant="pld")


def test_gamma_is_an_attribute_only_in_exact_mode_and_round_trips():
    args = _args()
    plain = fcir.capture(_round(False, exact=False), *args).to_text()
    assert "gamma" not in plain
    m = fcir.capture(_round(False, gamma=2.0**-5), *args)
    text = m.to_text()
    assert "gamma=0.03125" in text
    assert fcir.parse(text).to_text() == text
    assert fcir.Module.deserialize(m.serialize()).to_text() == text


def test_a_grid_that_cannot_hold_the_releases_is_refused():
    args = _args()
    with pytest.raises(fcir.PlacementError, match="power of two"):
        fcir.capture(_round(False, gamma=0.1), *args)
    with pytest.raises(fcir.PlacementError, match="pass exact=True"):
        fcir.capture(_round(False, gamma=0.5, exact=False), *args)
    with pytest.raises(fcir.IRTypeError, match=r"fed.dp_sum/C8: .*past 2\*\*24"):
        fcir.capture(_round(False, gamma=2.0**-20), *args)
    with pytest.raises(fcir.IRTypeError, match="float16 cannot hold"):
        fcir.capture(_round(False, jnp.float16, gamma=2.0**-15), *args)  # below f16 normals


def test_production_and_flower_clients_send_grid_integers(tmp_path):
    from fcir.interpreters import production

    fn = _round(True)
    w, key, x = _args()
    raw = jax.random.key_data(key)
    module = fcir.capture(fn, w, raw, x)
    plan = production.export(module)
    assert [a.intrinsic for a in plan.split.aggregations] == ["federated_sum"] * 2
    agg = plan.parts["client_to_server_aggregation"].to_text()
    assert "{i32[3]}@clients" in agg and "{i32[2]}@clients" in agg  # integers on the wire
    out = plan.write(tmp_path / "bundle")
    (release,) = json.loads((out / "manifest.json").read_text())["privacy"]["releases"]
    assert release["gamma"] == lattice.default_gamma(1.0, 5)
    want = reference.run(module, w, raw, x)
    got = production.run_bundle(out, w, raw, x)
    for k in want:
        assert np.array_equal(np.asarray(got[k]), np.asarray(want[k])), k


def test_the_digits_example_s_modes_release_at_the_same_epsilon():
    """``--mode exact`` raises the noise by the grid's share of the sensitivity, so the
    accountant gives the float mode's ε (capture only, no training)."""
    from examples_testing import load

    ex = load("dp_fedavg_digits")
    args = ex.make_example_args(8)
    eps = {}
    for mode in ex.MODES:
        module = fcir.capture(ex.make_rounds(8, 0.5, 4.0, mode)[1], *args)
        assert ("gamma" in module.to_text()) == (mode == "exact")
        eps[mode] = fcir.privacy.epsilon(module, 40, 1e-5)
    assert math.isclose(eps["exact"], eps["float"], rel_tol=1e-9), eps


def test_the_traffic_report_counts_the_int32_grid_points_an_exact_member_sends():
    from fcir.report import traffic

    args = _args()
    for exact in (False, True):
        m = fcir.capture(_round(False, jnp.bfloat16, exact=exact), *args)
        (t,) = [t for t in traffic.transfers(m) if t.kind == "aggregate"]
        # a: 3 elements (bf16: 2 bytes, int32 grid points: 4), b: 2 float32 elements
        assert t.operand_bytes == ((12, 8) if exact else (6, 8))
