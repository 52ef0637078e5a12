"""Distributed DP (fcir.mechanisms.ddgauss, fcir.ddp_sum / fcir.ddp_mean): the sampler's law, the
encoding and its bounds, the op on every backend, gradients."""

from __future__ import annotations

import contextlib
import dataclasses
import math

import cheap_compile
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fcir.interpreters import reference, xla

import fcir
from fcir.mechanisms import ddgauss as ddp
from fcir.mechanisms.clipping import clip_member

# --- the discrete Gaussian sampler ----------------------------------------------------------


def _exact_pmf(s: float, radius: int):
    ys = np.arange(-radius, radius + 1)
    w = np.exp(-(ys.astype(np.float64) ** 2) / (2 * s * s))
    return ys, w / w.sum()


def _chi_square_pvalue(samples, s: float) -> float:
    """Chi-square of ``samples`` against P(y) ∝ exp(-y²/2s²), computed directly (cells
    with expected count >= 20; the rest pooled)."""
    from scipy import stats

    radius = int(12 * s) + 2
    ys, pmf = _exact_pmf(s, radius)
    counts = np.array([(samples == y).sum() for y in ys])
    assert counts.sum() == samples.size  # nothing outside 12 s
    expected = pmf * samples.size
    big = expected >= 20
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return float(stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue)


@pytest.mark.parametrize("s", [0.4, 1.0, 2.5, 7.3])
def test_discrete_gaussian_matches_the_exact_pmf(s):
    """200k samples pass a chi-square test against the exact pmf."""
    samples = np.asarray(ddp.discrete_gaussian(jax.random.key(7), (200_000,), s))
    assert _chi_square_pvalue(samples, s) > 1e-4


@pytest.mark.parametrize("s", [1.0, 2.5])
def test_the_chi_square_test_fails_a_broken_sampler(monkeypatch, s):
    """The same test on broken samplers: the sign taken from the 96-bit uniform's top
    bit (which also picks the magnitude: not independent), and a table 3% too wide."""
    key = jax.random.key(7)

    def top_bit_sign(keys, shape, stddev):
        raw = jax.vmap(lambda k: jax.random.bits(k, (4, *shape), jnp.uint32))(keys)
        mag = jnp.abs(discrete_gaussian_batch(keys, shape, stddev))
        return jnp.where((raw[:, 0] >> 31) == 1, -mag, mag)

    discrete_gaussian_batch = ddp.discrete_gaussian_batch
    monkeypatch.setattr(ddp, "discrete_gaussian_batch", top_bit_sign)
    broken = np.asarray(ddp.discrete_gaussian(key, (200_000,), s))
    assert _chi_square_pvalue(broken, s) < 1e-4
    monkeypatch.undo()
    wide = np.asarray(ddp.discrete_gaussian(key, (200_000,), s * 1.03))
    assert _chi_square_pvalue(wide, s) < 1e-4


def test_sampler_table_is_the_exact_cdf_in_96_bit_fixed_point():
    """The host's thresholds equal floor(2**96 CDF) computed independently with
    Python's fractions and decimal at 80 digits, and the stated TV bound is tiny."""
    import decimal

    for s in (0.4, 2.5, 30.0):
        words, R, tv = ddp._dg_table(s)
        T = [(int(a) << 64) | (int(b) << 32) | int(c) for a, b, c in words[: R - 1]]
        with decimal.localcontext() as ctx:
            ctx.prec = 80
            s2 = decimal.Decimal(s) ** 2
            p = [(-decimal.Decimal(k * k) / (2 * s2)).exp() for k in range(40 * int(s + 1))]
            z = p[0] + 2 * sum(p[1:])
            cdf, acc = [], decimal.Decimal(0)
            for k in range(R - 1):
                acc += p[k] if k == 0 else 2 * p[k]
                cdf.append(int(acc / z * (decimal.Decimal(2) ** 96)))
        assert all(abs(t - c) <= 1 for t, c in zip(T, cdf)), s
        assert R * 2.0**-95 <= tv < 1e-25
    assert ddp.sampler_tv(5000.0) < 2e-24 and ddp.sampler_tv(0.0) == 0.0


@pytest.mark.parametrize("s", [100.0, 3300.0])
def test_discrete_gaussian_variance_at_large_scale(s):
    samples = np.asarray(ddp.discrete_gaussian(jax.random.key(3), (400_000,), s), np.float64)
    # the sample variance of 400k draws is within 1% of s² with overwhelming probability
    assert abs(samples.var() / (s * s) - 1) < 0.01
    assert abs(samples.mean()) < 5 * s / math.sqrt(samples.size)


def test_discrete_gaussian_is_a_pure_function_of_the_key():
    a = ddp.discrete_gaussian(jax.random.key(1), (1000,), 5.0)
    b = jax.jit(lambda k: ddp.discrete_gaussian(k, (1000,), 5.0))(jax.random.key(1))
    c = ddp.discrete_gaussian(jax.random.key(2), (1000,), 5.0)
    assert np.array_equal(a, b) and not np.array_equal(a, c)


# --- encoding, parameters, bounds ------------------------------------------------------------


def test_fwht_is_hadamard():
    D = 16
    H = np.asarray(ddp.fwht(jnp.eye(D)))
    assert np.array_equal(H @ H, D * np.eye(D))
    assert set(np.unique(H)) == {-1.0, 1.0}


def test_params_overflow_bound_is_the_target_and_noise_is_calibrated():
    p = ddp.params(650, 50, 0.5, 1.0, 16)
    assert p.padded_dim == 1024
    assert p.overflow_bound <= ddp.OVERFLOW_TARGET * 1.0001
    # n local shares of variance local_stddev² add up to (z c scale)²
    assert math.isclose(p.n * p.local_stddev**2, (1.0 * 0.5 * p.scale) ** 2)
    # the stated bound, recomputed from its formula
    half = 2.0**15
    v = (p.scale * 0.5) ** 2 * (50**2 / 1024 + 1.0)
    assert math.isclose(p.overflow_bound, 2 * 1024 * math.exp(-((half - 50) ** 2) / (2 * v)))
    c = p.scale * p.clip_norm * (1 + 18 * 2.0**-23)  # the float32 margin, log2 D = 10
    assert p.delta2 == pytest.approx(_conditional_delta2(c, 1024), rel=1e-12)
    assert p.delta2 < c + math.sqrt(1024)  # tighter than the unconditional bound
    plain = ddp.params(650, 50, 0.5, 1.0, 16, conditional=False)
    assert plain.delta2 == pytest.approx(c + 32.0, rel=1e-12) and plain.norm_bound == math.inf


def _conditional_delta2(c, D, log_inv_beta=0.5):
    """[KLS21] Theorem 1 with conditional rounding, from the paper's statement: Delta_2 =
    min(c + sqrt(D), sqrt(c² + D/4 + sqrt(2 ln(1/beta)) (c + sqrt(D)/2)))."""
    second = c**2 + 0.25 * D + math.sqrt(2 * log_inv_beta) * (c + 0.5 * math.sqrt(D))
    return min(c + math.sqrt(D), math.sqrt(second))


def _at_clip(p, k, seed=0):
    """k scaled rotated vectors of norm exactly scale * clip_norm (the worst case)."""
    x = jax.random.normal(jax.random.key(seed), (k, p.padded_dim))
    return x / jnp.linalg.norm(x, axis=1, keepdims=True) * jnp.float32(p.scale * p.clip_norm)


def _norms(q):
    return np.linalg.norm(np.asarray(q, np.float64), axis=1)


# ddp.round_batch compiled once per (shapes, params): run op by op, its while loop of
# redraws compiles afresh at every call (seconds each). The function of its inputs is
# the same, and the reference interpreter and the primitive run it compiled too.
_round_batch = jax.jit(ddp.round_batch, static_argnums=2)


def test_conditional_rounding_never_passes_its_bound_where_plain_rounding_does():
    """Vectors at the clip norm: plain randomized rounding lands above the conditional
    Delta_2 for some clients (so the check is needed), the conditional one never."""
    p = ddp.params(650, 50, 0.5, 1.0, 16)
    v, keys = _at_clip(p, 200), jax.random.split(jax.random.key(1), 200)
    cond = _norms(_round_batch(v, keys, p))
    plain = _norms(_round_batch(v, keys, dataclasses.replace(p, conditional=False)))
    assert cond.max() <= p.delta2 == p.norm_bound
    assert (plain > p.delta2).mean() > 0.02
    assert plain.max() <= p.scale * p.clip_norm * (1 + 18 * 2.0**-23) + 32


def test_conditional_rounding_falls_back_toward_zero_after_max_attempts():
    """A bound no rounding can meet: every attempt fails, and each row is rounded
    toward zero, whose norm is at most the unrounded one's."""
    p = ddp.params(650, 50, 0.5, 1.0, 16)
    v = _at_clip(p, 4)
    strict = dataclasses.replace(p, norm_bound=0.5 * p.scale * p.clip_norm)
    q = np.asarray(_round_batch(v, jax.random.split(jax.random.key(2), 4), strict))
    assert np.array_equal(q, np.trunc(np.asarray(v)).astype(np.int32))
    assert np.all(_norms(q) <= np.linalg.norm(np.asarray(v, np.float64), axis=1))
    assert p.rounding_failure == ddp.ROUNDING_BETA**ddp.MAX_ROUNDINGS < 1.3e-14


def test_conditional_rounding_of_a_row_depends_on_its_key_only():
    """Rows redraw a different number of times, yet each row is what it is alone, so
    the reference (client by client), XLA (one batch) and streaming agree."""
    p = ddp.params(650, 50, 0.5, 1.0, 16)
    v, keys = _at_clip(p, 64, seed=3), jax.random.split(jax.random.key(4), 64)
    batch = np.asarray(_round_batch(v, keys, p))
    plain = np.asarray(_round_batch(v, keys, dataclasses.replace(p, conditional=False)))
    assert not np.array_equal(batch, plain)  # some rows were redrawn
    for i in range(0, 64, 7):
        assert np.array_equal(
            np.asarray(_round_batch(v[i : i + 1], keys[i : i + 1], p))[0], batch[i]
        )


def _norm_bound_at(s2: int) -> float:
    """The float64 norm bound whose exact square is in ``[s2, s2 + 1)``."""
    from fractions import Fraction

    nb = math.sqrt(s2)
    while Fraction(nb) ** 2 < s2:
        nb = float(np.nextafter(nb, math.inf))
    return nb


def test_the_norm_check_is_exact_at_the_bound():
    """A client whose rounding is either ``w`` or ``w + e_0``, ``||w + e_0||**2`` the
    bound exactly (about 4e9: float32 cannot tell it from its neighbours). The check is
    exact integer arithmetic, so at ``floor(norm_bound**2) = ||w + e_0||**2`` both
    roundings pass and coordinate 0 goes up about half the time (unbiased), and one
    below it never does (redrawn). The float32 check this replaced rejected both."""
    p = ddp.params(650, 50, 0.5, 1.0, 16)
    D = p.padded_dim
    w = np.asarray(jax.random.randint(jax.random.key(0), (D,), -2000, 2000), np.int64)
    w[0] = abs(w[0])
    up = w.copy()
    up[0] += 1
    s_up = int((up * up).sum())
    assert s_up > 2**30  # far beyond float32's integers (2**24)
    v = jnp.asarray(w + np.eye(D)[0] * 0.5, jnp.float32)[None].repeat(400, 0)
    keys = jax.random.split(jax.random.key(1), 400)
    at = dataclasses.replace(p, norm_bound=_norm_bound_at(s_up))
    below = dataclasses.replace(p, norm_bound=_norm_bound_at(s_up - 1))
    assert ddp.norm_bound_squared(at) == s_up and ddp.norm_bound_squared(below) == s_up - 1
    q_at = np.asarray(_round_batch(v, keys, at))
    q_below = np.asarray(_round_batch(v, keys, below))
    assert np.array_equal(q_at[:, 1:], np.broadcast_to(w[1:], (400, D - 1)))
    assert 0.4 < (q_at[:, 0] == up[0]).mean() < 0.6
    assert np.array_equal(q_below, np.broadcast_to(w, (400, D)))


def test_squared_norms_are_exact_64_bit_integers():
    """``within_norm_bound``'s arithmetic: int32 squares in uint32 word pairs, summed
    with carries, equal Python's integers (extremes included)."""
    rng = np.random.default_rng(0)
    q = rng.integers(-(2**31) + 1, 2**31, size=(6, 4), dtype=np.int64)
    q[0] = [2**31 - 1, -(2**31) + 1, 2**16, -(2**16) - 1]
    q[1] = [65535, -65535, 65536, 1]
    hi, lo = ddp._sum_limbs(*ddp._square_limbs(jnp.asarray(q, jnp.int32)))
    got = [(int(h) << 32) + int(x) for h, x in zip(np.asarray(hi), np.asarray(lo))]
    assert got == [int(sum(int(a) ** 2 for a in row)) for row in q]


@pytest.mark.slow  # 10 s: the clip compiled in four batchings (docs/contributing.md)
def test_the_clip_is_the_same_in_every_batch_and_program():
    """The clip's norm is a fixed pairwise sum (a float decision XLA must not reorder):
    a client's encoding under jit in a batch of 8, of 3, with an elementwise producer
    fused in, and eagerly alone is the same, bit for bit."""
    n = 8
    rng = np.random.default_rng(3)
    leaves = [jnp.asarray(rng.normal(size=(n, *s)), jnp.float32) for s in [(6, 8), (8, 3)]]
    keys = jax.random.split(jax.random.key(5), n)
    p = ddp.params(72, n, 0.05, 0.5, 20)
    f = jax.jit(lambda ls, k: ddp.encode_batch([jnp.tanh(x) * 0.3 for x in ls], k, p))
    full = np.asarray(f(leaves, keys))
    for s in (0, 3, 5):
        assert np.array_equal(
            np.asarray(f([x[s : s + 3] for x in leaves], keys[s : s + 3])), full[s : s + 3]
        )
    alone = ddp.encode([jnp.tanh(x[2]) * 0.3 for x in leaves], keys[2], p)
    assert np.array_equal(np.asarray(alone), full[2])


def test_params_reject_too_few_bits():
    with pytest.raises(fcir.IRTypeError, match="use more bits"):
        ddp.params(10, 8, 1.0, 1.0, 3)
    with pytest.raises(fcir.IRTypeError, match="bits must be an int"):
        ddp.params(10, 8, 1.0, 1.0, 25)


def _encode_all(xs, keys, p):
    """Every client's ``ddp.encode``, compiled as one function (op by op, the vmapped
    sampler's while loops dispatch hundreds of kernels: most of a minute)."""
    return jax.jit(jax.vmap(lambda x, k: ddp.encode([x], k, p)))(xs, keys)


def _decode_sum(enc, p, like):
    """The server's ``decode(aggregate(enc))`` of the clients' encodings ``enc``, compiled
    as one function (op by op, over a hundred kernels compile: 2 s)."""
    return jax.jit(lambda e: ddp.decode(ddp.aggregate(e, p), p, [like], mean=False)[0])(enc)


def test_noiseless_round_trip_is_the_clipped_sum_up_to_rounding():
    n, d = 10, 300
    xs = jax.random.normal(jax.random.key(0), (n, d))
    p = ddp.params(d, n, 1.0, 0.0, 20)
    enc = _encode_all(xs, jax.random.split(jax.random.key(1), n), p)
    assert enc.dtype == jnp.uint32 and int(enc.max()) < 2**20
    out = _decode_sum(enc, p, xs[0])
    want = jax.jit(lambda xs: sum(clip_member([xs[i]], 1.0)[0] for i in range(n)))(xs)
    # rounding moves each client's rotated coordinate by < 1/scale: the sum's L2 error is
    # below n * sqrt(D) / scale (the inverse rotation keeps norms)
    err = float(jnp.linalg.norm(out - want))
    assert err < n * math.sqrt(p.padded_dim) / p.scale
    assert err > 0  # it does round


def test_rounding_is_unbiased():
    n, d = 1, 4
    x = jnp.array([[0.123, -0.321, 0.05, 0.0]])
    p = ddp.params(d, n, 1.0, 0.0, 8)
    keys = jax.random.split(jax.random.key(5), 4000)
    dec = jax.jit(  # one compile for the 4000 clients, not op-by-op dispatch
        jax.vmap(
            lambda k: ddp.decode(
                ddp.aggregate(ddp.encode([x[0]], k, p)[None], p), p, [x[0]], False
            )[0]
        )
    )(keys)
    sem = 1 / p.scale / math.sqrt(4000)  # rounding error per coordinate is within 1/scale
    assert np.all(np.abs(np.asarray(dec.mean(0)) - np.asarray(x[0])) < 5 * sem)


@pytest.mark.slow  # 6 s: a statistical check; the calibration itself stays (docs/contributing.md)
def test_sum_noise_has_std_noise_multiplier_times_clip():
    n, d = 20, 2048
    xs = jnp.zeros((n, d))
    p = ddp.params(d, n, 0.5, 1.3, 20)
    enc = _encode_all(xs, jax.random.split(jax.random.key(2), n), p)
    out = np.asarray(_decode_sum(enc, p, xs[0]))
    # 2048 coordinates: the sample std is within 5% of 0.65 with overwhelming probability
    assert abs(out.std() / 0.65 - 1) < 0.05


def test_a_wrapped_sum_decodes_wrong_which_is_why_the_bound_matters():
    """The modular wrap is real: values past 2**(bits-1) come back on the other side."""
    p = ddp.params(4, 2, 1.0, 0.0, 8)
    half = 1 << (p.bits - 1)
    like = [jnp.zeros(4)]
    wrapped = ddp.decode(jnp.array([half + 3, 0, 0, 0], jnp.uint32), p, like, False)[0]
    unit = ddp.decode(jnp.array([1, 0, 0, 0], jnp.uint32), p, like, False)[0]
    np.testing.assert_allclose(wrapped, -(half - 3) * unit, rtol=1e-6)


# --- the ops ------------------------------------------------------------------------------


def _program(mean: bool, bits: int = 16, clients: int = 5, private: bool = True):
    op = fcir.ddp_mean if mean else fcir.ddp_sum

    @fcir.program(placements={"clients": clients}, private=private)
    def round_(w, keys, x):
        upd = fcir.map_fn(lambda w, x: {"a": x - w, "b": x[:2] * 2.0}, (fcir.broadcast(w), x))
        return op(upd, 1.0, 1.1, keys, bits=bits)

    return round_


def _args(clients=5, seed=0):
    return (
        jnp.zeros(3),
        jax.random.split(jax.random.key(seed), clients),
        jax.random.normal(jax.random.key(seed + 1), (clients, 3)),
    )


# ddp_mean is slow; ddp_sum stays in the fast tier (docs/contributing.md)
@pytest.mark.parametrize(
    "mean",
    [pytest.param(False, id="ddp_sum"), pytest.param(True, id="ddp_mean", marks=pytest.mark.slow)],
)
def test_reference_xla_and_jit_agree_bit_for_bit(mean):
    fn, args = _program(mean), _args()
    m = fcir.capture(fn, *args)
    a = reference.run(m, *args)
    b = xla.compile(m)(*args)
    c = jax.jit(fn)(*args)
    for k in ("a", "b"):
        assert np.array_equal(a[k], b[k]) and np.array_equal(a[k], c[k]), k
    other = reference.run(m, args[0], jax.random.split(jax.random.key(9), 5), args[2])
    assert not np.array_equal(a["a"], other["a"])  # the keys matter


@contextlib.contextmanager
def _xla_compiles():
    """The XLA programs compiled inside the block (JAX's backend-compile events)."""
    seen = []

    def listener(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            seen.append(duration)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield seen
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def test_the_reference_compiles_a_clients_encoding_once_not_op_by_op():
    """The reference interpreter encodes client by client. Run op by op, the encoding's
    while loops compiled again for each client: this round's first run compiled 186 XLA
    programs, a second run 8 (minutes on a loaded 2-core machine). Compiled once per
    shapes and parameters, the first compiles a few dozen (46 alone) and a second none."""

    @fcir.program(placements={"clients": 8}, private=True)
    def round_(w, keys, x):  # shapes and bits no other test here uses: nothing cached
        upd = fcir.map_fn(lambda w, x: x - w, (fcir.broadcast(w), x))
        return fcir.ddp_sum(upd, 1.0, 1.1, keys, bits=14)

    w, x = jnp.zeros(11), jax.random.normal(jax.random.key(1), (8, 11))
    m = fcir.capture(round_, w, jax.random.split(jax.random.key(0), 8), x)
    with _xla_compiles() as first:
        a = reference.run(m, w, jax.random.split(jax.random.key(0), 8), x)
    with _xla_compiles() as second:
        b = reference.run(m, w, jax.random.split(jax.random.key(2), 8), x)
    assert len(first) < 80 and len(second) == 0, (len(first), len(second))
    assert not np.array_equal(a, b)  # other keys, other noise: it did run


@pytest.mark.slow  # 4 s (docs/contributing.md)
def test_raw_uint32_keys_work_too():
    fn = _program(False)
    w, keys, x = _args()
    raw = jax.random.key_data(keys)
    m = fcir.capture(fn, w, raw, x)
    assert np.array_equal(reference.run(m, w, raw, x)["a"], xla.compile(m)(w, raw, x)["a"])


def test_ddp_mean_is_ddp_sum_over_n():
    args = _args()
    s = reference.run(fcir.capture(_program(False), *args), *args)
    m = reference.run(fcir.capture(_program(True), *args), *args)
    np.testing.assert_allclose(m["a"], s["a"] / 5, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("mean", [False, True])
def test_text_and_protobuf_round_trip(mean):
    m = fcir.capture(_program(mean), *_args())
    text = m.to_text()
    assert f"fed.ddp_{'mean' if mean else 'sum'}" in text and "bits=16" in text
    assert fcir.parse(text).to_text() == text
    assert fcir.Module.deserialize(m.serialize()).to_text() == text
    args = _args()
    assert np.array_equal(reference.run(fcir.parse(text), *args)["a"], reference.run(m, *args)["a"])


def test_min_clients_is_kept_only_below_n_and_runs_alike_everywhere():
    """``min_clients`` is an IR attribute only when below the cardinality (n itself is
    the default, so such a module is the one without it); text, protobuf, the reference,
    XLA and the streamed XLA round agree bit for bit, and each client's noise is larger."""

    def with_min(m):
        @fcir.program(placements={"clients": 5}, private=True)
        def round_(w, keys, x):
            upd = fcir.map_fn(lambda w, x: x - w, (fcir.broadcast(w), x))
            return fcir.ddp_sum(upd, 1.0, 1.1, keys, bits=16, min_clients=m)

        return fcir.capture(round_, *_args())

    plain = fcir.capture(_program(False), *_args()).to_text()
    assert "min_clients" not in plain and with_min(5).to_text() == with_min(None).to_text()
    m = with_min(2)
    text = m.to_text()
    assert "min_clients=2" in text
    assert fcir.parse(text).to_text() == text
    assert fcir.Module.deserialize(m.serialize()).to_text() == text
    args = _args()
    a = reference.run(m, *args)
    assert np.array_equal(a, xla.compile(m)(*args))
    assert np.array_equal(a, xla.compile(m, clients_per_step=2)(*args))
    assert not np.array_equal(a, reference.run(with_min(None), *args))
    for bad in (0, 6, 2.0, True):
        with pytest.raises(fcir.PlacementError, match="min_clients"):
            with_min(bad)


@pytest.mark.slow  # 6 s (docs/contributing.md)
def test_gradient_treats_noise_and_rounding_as_constant():
    """The gradient is dp_mean's: that of the mean of the clipped members."""

    @fcir.program(placements={"clients": 4})
    def ddp_loss(w, keys, x):
        upd = fcir.map_fn(lambda w, x: x * w, (fcir.broadcast(w), x))
        return jnp.sum(fcir.ddp_mean(upd, 10.0, 0.5, keys, bits=16))

    @fcir.program(placements={"clients": 4})
    def dp_loss(w, key, x):
        upd = fcir.map_fn(lambda w, x: x * w, (fcir.broadcast(w), x))
        return jnp.sum(fcir.dp_mean(upd, 10.0, 0.5, key))

    w, x = jnp.array([1.0, 0.5, 2.0]), jnp.arange(12.0).reshape(4, 3) / 4
    keys = jax.random.split(jax.random.key(0), 4)
    # Compiled: op by op, the encoding's and the noise's kernels compile one by one.
    g = jax.jit(jax.grad(ddp_loss))(w, keys, x)
    want = jax.jit(jax.grad(dp_loss))(w, jax.random.key(0), x)
    np.testing.assert_allclose(g, want, rtol=1e-6)
    m = fcir.capture(jax.grad(ddp_loss), w, keys, x)
    np.testing.assert_allclose(reference.run(m, w, keys, x), g, rtol=1e-6)


def test_capture_rejects_bad_arguments():
    w, keys, x = _args()

    def with_(**kw):
        @fcir.program(placements={"clients": 5})
        def f(w, keys, x):
            upd = fcir.map_fn(lambda w, x: x - w, (fcir.broadcast(w), x))
            return fcir.ddp_sum(
                upd, kw.get("clip", 1.0), 1.0, kw.get("keys", keys), bits=kw.get("bits", 16)
            )

        return f

    with pytest.raises(fcir.PlacementError, match="bits must be in"):
        fcir.capture(with_(bits=30), w, keys, x)
    with pytest.raises(fcir.PlacementError, match="one PRNG key per member"):
        fcir.capture(with_(keys=jax.random.key(0)), w, keys, x)
    with pytest.raises(fcir.PlacementError, match="clip_norm"):
        fcir.capture(with_(clip=-1.0), w, keys, x)
    with pytest.raises(fcir.IRTypeError, match="use more bits"):
        fcir.capture(with_(bits=2), w, keys, x)


# --- production ---------------------------------------------------------------------------


def test_production_noises_at_clients_and_aggregates_with_a_bitwidth_secure_sum(tmp_path):
    from fcir.interpreters import production

    w, keys, x = _args()
    raw = jax.random.key_data(keys)  # production wire types have no key dtype: raw bits
    module = fcir.capture(_program(True, bits=16), w, raw, x)
    plan = production.export(module)
    client = plan.parts["client_work"].to_text()
    assert "fed.map" in client and "jax.while" in client  # the per-client noise sampler
    agg = plan.parts["client_to_server_aggregation"]
    assert [op.name for op in agg.main.body.ops] == ["fed.secure_sum"]
    (a,) = plan.split.aggregations
    assert (a.intrinsic, a.bitwidth) == ("federated_secure_sum_bitwidth", 16)
    assert "random" not in plan.parts["server_result"].to_text()  # no noise at the server
    out = plan.write(tmp_path / "bundle")
    import json

    privacy = json.loads((out / "manifest.json").read_text())["privacy"]
    (release,) = privacy["releases"]
    assert (release["op"], release["bits"]) == ("fed.ddp_mean", 16)
    assert privacy["mechanism"].startswith("distributed discrete Gaussian")
    want = reference.run(module, w, raw, x)
    got = production.run_bundle(out, w, raw, x)
    for k in want:
        np.testing.assert_allclose(np.asarray(got[k]), np.asarray(want[k]), rtol=1e-5, atol=1e-6)


# --- accounting -----------------------------------------------------------------------------


def _ddp_module(n: int, d: int, z: float, bits: int, clip: float = 1.0, m=None):
    @fcir.program(placements={"clients": n}, private=True)
    def round_(w, keys, x):
        upd = fcir.map_fn(lambda w, x: x - w, (fcir.broadcast(w), x))
        return w + fcir.ddp_mean(upd, clip, z, keys, bits=bits, min_clients=m)

    args = (
        jax.ShapeDtypeStruct((d,), jnp.float32),
        jax.ShapeDtypeStruct((n,), jax.random.key(0).dtype),
        jax.ShapeDtypeStruct((n, d), jnp.float32),
    )
    return fcir.capture(round_, *args)


def _central_module(n: int, d: int, z: float, clip: float = 1.0):
    @fcir.program(placements={"clients": n}, private=True)
    def round_(w, key, x):
        upd = fcir.map_fn(lambda w, x: x - w, (fcir.broadcast(w), x))
        return w + fcir.dp_mean(upd, clip, z, key)

    args = (
        jax.ShapeDtypeStruct((d,), jnp.float32),
        jax.random.key(0),
        jax.ShapeDtypeStruct((n, d), jnp.float32),
    )
    return fcir.capture(round_, *args)


def _independent_epsilon(n, d, z, bits, clip, rounds, delta, m=None):
    """ε of the distributed discrete Gaussian computed here from the papers' formulas,
    without fcir.mechanisms.ddgauss or dp-accounting: the scale of fcir.mechanisms.ddgauss's docstring; Delta_2 =
    Theorem 1's conditional-rounding min(...) (``_conditional_delta2``); the RDP of order a, [KLS21]
    Proposition 14, all three terms; RDP to (ε, δ) with the conversion of Canonne,
    Kamath, Steinke 2020 (Prop. 12) / Asoodeh et al., minimised over a dense grid of a."""
    D = 1 << max(0, (d - 1).bit_length())
    half = 2.0 ** (bits - 1)
    k = math.sqrt(2 * math.log(2 * D / 2.0**-30))
    # m (min_clients): each client noises for m shares, so all n carry n/m the variance
    m = n if m is None else m
    scale = (half - n) / (k * clip * math.sqrt(n * n / D + z * z * n / m))
    local = z * clip * scale / math.sqrt(m)
    d2 = _conditional_delta2(scale * clip * (1 + (math.log2(D) + 8) * 2.0**-23), D)
    d1 = min(d2 * math.sqrt(D), d2 * d2)  # ||v||_1 <= sqrt(D) ||v||_2; integers: <= ||v||²
    tau = 10 * sum(math.exp(-2 * math.pi**2 * local**2 * j / (j + 1)) for j in range(1, n))
    sig = math.sqrt(m) * local  # the fewest shares in the sum; tau over all n (the larger)
    a = np.concatenate([np.linspace(1.01, 10, 4000), np.linspace(10, 2000, 20000)])
    terms = np.minimum.reduce(
        [
            a / 2 * (d2 / sig) ** 2 + tau * D,
            a / 2 * ((d2 / sig) ** 2 + 2 * d1 / sig * tau + tau**2 * D),
            a / 2 * (d2 / sig + math.sqrt(D) * tau) ** 2,
        ]
    )
    rdp = rounds * terms
    eps = rdp + np.log((a - 1) / a) - (math.log(delta) + np.log(a)) / (a - 1)
    return float(eps.min())


@pytest.mark.parametrize(
    "n,d,z,bits,rounds",
    [
        (50, 650, 1.0, 16, 40),
        (50, 650, 1.0, 20, 40),
        (1000, 5000, 0.7, 16, 10),
        (8, 3, 2.0, 12, 100),
        (3, 100, 0.5, 8, 1),
    ],
)
def test_epsilon_matches_an_independent_computation(n, d, z, bits, rounds):
    got = fcir.privacy.epsilon(_ddp_module(n, d, z, bits), rounds, 1e-5)
    want = _independent_epsilon(n, d, z, bits, 1.0, rounds, 1e-5)
    # fcir uses Prop. 14's third term only and dp-accounting's grid of orders: never
    # below the dense-grid minimum of all three terms, and within 2% of it
    assert want <= got * (1 + 1e-9) and got <= want * 1.02, (got, want)


@pytest.mark.parametrize("n,m,d,z,bits", [(50, 30, 650, 1.0, 16), (8, 3, 3, 2.0, 12)])
def test_epsilon_at_min_clients_matches_an_independent_computation(n, m, d, z, bits):
    """Each client noises for min_clients shares; ε, Budget and releases() are at m."""
    module = _ddp_module(n, d, z, bits, m=m)
    got = fcir.privacy.epsilon(module, 20, 1e-5)
    want = _independent_epsilon(n, d, z, bits, 1.0, 20, 1e-5, m=m)
    assert want <= got * (1 + 1e-9) and got <= want * 1.02, (got, want)
    (release,) = fcir.privacy.releases(module)
    assert release.min_clients == m
    p = ddp.op_params(module, module.main.body.ops[-2])
    # any m shares carry the op's noise, noise_multiplier * clip_norm in the update's units
    assert math.isclose(math.sqrt(m) * p.local_stddev / p.scale, z, rel_tol=1e-12)
    budget = fcir.privacy.Budget(module, 1e-5, 1e3)
    budget.spend(20)
    assert budget.epsilon == got
    # ε at min_clients is never below ε with every client's share in the sum
    assert got >= fcir.privacy.epsilon(_ddp_module(n, d, z, bits), 20, 1e-5)


@pytest.mark.parametrize(
    "n,d,z,bits", [(50, 650, 1.0, 16), (1000, 5000, 0.7, 16), (10, 10, 3.0, 8), (20, 64, 0.3, 20)]
)
@pytest.mark.parametrize("q", [1.0, 0.1])
def test_epsilon_is_never_below_central_dp_at_the_same_noise_multiplier(n, d, z, bits, q):
    central = fcir.privacy.epsilon(_central_module(n, d, z), 20, 1e-5, q)
    if q < 1:  # only the sampled clients would add noise shares: refused
        with pytest.raises(fcir.PrivacyError, match="sampled at rate"):
            fcir.privacy.epsilon(_ddp_module(n, d, z, bits), 20, 1e-5, q)
        return
    assert fcir.privacy.epsilon(_ddp_module(n, d, z, bits), 20, 1e-5, q) >= central


def test_rounding_costs_privacy_at_few_bits():
    """Few bits: a coarse scale, so rounding's sqrt(D) is a visible part of Delta_2."""
    few = fcir.privacy.epsilon(_ddp_module(50, 4096, 1.0, 10), 10, 1e-5)
    many = fcir.privacy.epsilon(_ddp_module(50, 4096, 1.0, 20), 10, 1e-5)
    central = fcir.privacy.epsilon(_central_module(50, 4096, 1.0), 10, 1e-5)
    assert few > 1.1 * many and many >= central and many < 1.01 * central


def test_releases_state_the_accounted_noise_and_pld_is_refused():
    m = _ddp_module(50, 650, 1.0, 16)
    (r,) = fcir.privacy.releases(m)
    p = ddp.params(650, 50, 1.0, 1.0, 16)
    assert (r.op, r.bits, r.noise_multiplier) == ("fed.ddp_mean", 16, 1.0)
    assert r.accounted_noise_multiplier == ddp.rdp_noise_multiplier(p) < 1.0
    with pytest.raises(fcir.PrivacyError, match="accountant='rdp'"):
        fcir.privacy.epsilon(m, 3, 1e-5, accountant="pld")


# --- the checker's key rules (fcir.privacy.keys, shared with the central DP ops) ----------------

N = 4


def _fold(keys, i):
    return fcir.map_fn(lambda k: jax.random.fold_in(k, i), keys)


def _capture_private(body, *args):
    @fcir.program(placements={"clients": N}, private=True)
    def round_(w, keys, x):
        return body(w, keys, x)

    return fcir.capture(round_, *args)


def _upd(w, x):
    return fcir.map_fn(lambda w, x: x - w, (fcir.broadcast(w), x))


ARGS = (jnp.zeros(3), jax.random.split(jax.random.key(0), N), jnp.ones((N, 3)))


def test_keys_from_server_data_only_are_rejected_naming_the_op():
    def body(w, keys, x):
        same = fcir.map_fn(lambda w: jax.random.key(7), fcir.broadcast(w))
        return fcir.ddp_sum(_upd(w, x), 1.0, 1.0, same, bits=12)

    with pytest.raises(fcir.PrivacyError, match=r"privacy/C5: fed.ddp_sum takes keys that"):
        _capture_private(body, *ARGS)


def test_keys_reused_by_two_releases_are_rejected():
    def body(w, keys, x):
        a = fcir.ddp_mean(_upd(w, x), 1.0, 1.0, keys, bits=12)
        return fcir.ddp_mean(_upd(a, x), 1.0, 1.0, keys, bits=12)

    with pytest.raises(fcir.PrivacyError, match=r"privacy/C4: fed.ddp_mean reuses the keys"):
        _capture_private(body, *ARGS)


def test_distinct_keys_per_release_pass():
    def body(w, keys, x):
        a = fcir.ddp_mean(_upd(w, x), 1.0, 1.0, _fold(keys, 0), bits=12)
        return fcir.ddp_mean(_upd(a, x), 1.0, 1.0, _fold(keys, 1), bits=12)

    m = _capture_private(body, *ARGS)
    assert [r.count for r in fcir.privacy.releases(m)] == [1, 1]


def test_keys_constant_across_scan_iterations_are_rejected_and_folded_ones_pass():
    def loop(fold: bool):
        def body(w, keys, x):
            def step(carry, _):
                w, t = carry
                k = (
                    fcir.map_fn(lambda k, t: jax.random.fold_in(k, t), (keys, fcir.broadcast(t)))
                    if fold
                    else keys
                )
                return (w + fcir.ddp_mean(_upd(w, x), 1.0, 1.0, k, bits=12), t + 1), None

            return jax.lax.scan(step, (w, jnp.int32(0)), None, length=3)[0][0]

        return body

    with pytest.raises(fcir.PrivacyError, match="every iteration of its loop"):
        _capture_private(loop(False), *ARGS)
    m = _capture_private(loop(True), *ARGS)
    assert [r.count for r in fcir.privacy.releases(m)] == [3]


def test_ddp_results_are_releases_for_the_leak_check():
    """A private program may return what ddp_* release, and not the plain sum."""

    def body(w, keys, x):
        return fcir.ddp_sum(_upd(w, x), 1.0, 1.0, keys, bits=12), fcir.reduce_sum(x)

    with pytest.raises(fcir.PrivacyError, match="privacy/C1"):
        _capture_private(body, *ARGS)


@pytest.mark.parametrize("bits", [16, 20])
def test_noise_multiplier_for_matches_central_epsilon(bits):
    z = ddp.noise_multiplier_for(4.0, 650, 50, 0.5, bits)
    assert z > 4.0
    got = fcir.privacy.epsilon(_ddp_module(50, 650, z, bits, clip=0.5), 40, 1e-5)
    want = fcir.privacy.epsilon(_central_module(50, 650, 4.0, clip=0.5), 40, 1e-5)
    assert got == pytest.approx(want, rel=1e-6)
    with pytest.raises(fcir.IRTypeError, match="use more bits"):
        ddp.noise_multiplier_for(4.0, 2**16, 50, 0.5, 7)


@pytest.mark.slow  # runs the digits example end to end (docs/contributing.md: examples are slow)
def test_example_trains_distributed_dp_at_the_central_epsilon(tmp_path):
    from examples_testing import load

    png = tmp_path / "dp.png"
    curves = load("dp_fedavg_digits").main(
        ["--rounds", "2", "--ddp-bits", "16", "--output", str(png)]
    )
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(curves["ddp_16"]) == 2 and all(0 <= a <= 1 for a in curves["ddp_16"])
    np.testing.assert_allclose(curves["ddp_16_epsilon"], curves["epsilon"], rtol=1e-6)


def test_traffic_counts_the_residues_clients_send_not_their_keys():
    from fcir.report.traffic import communication_bytes

    m = fcir.capture(_program(True), *_args())  # 3 + 2 elements: D = 8 residues
    assert communication_bytes(m)["clients"]["aggregate"] == 5 * 8 * 4


@pytest.mark.parametrize("k", [2, 3, 5])
def test_streaming_accumulates_residues_and_gives_the_same_bits(k):
    """With clients_per_step the op is a streamed reduction: the map's per-client
    updates are never materialized, only the uint32 modular sum is carried."""
    from fcir.interpreters.xla.streaming import plan_region

    fn, args = _program(True), _args()
    m = fcir.capture(fn, *args)
    (stream,) = plan_region(m.main.body, m.cardinality)
    assert [op.name for op in stream.reductions] == ["fed.ddp_mean"]
    assert stream.materialized == []
    want = reference.run(m, *args)
    got = xla.compile(m, clients_per_step=k)(*args)
    for key in want:
        assert np.array_equal(got[key], want[key])


PINNED_SIGNS = np.array([-1, -1, 1, 1, 1, 1, 1, 1], np.float32)


def test_rotation_signs_are_a_fixed_public_constant():
    """The signs come from PCG64's raw stream (stable across NumPy versions): pinned."""
    signs = np.asarray(ddp._signs(16))
    assert signs.dtype == np.float32 and set(np.unique(signs)) == {-1.0, 1.0}
    assert np.array_equal(signs[:8], PINNED_SIGNS)
    assert abs(float(np.asarray(ddp._signs(4096)).mean())) < 0.05


@pytest.mark.slow  # 4 s (docs/contributing.md)
def test_ddp_inside_silos_releases_per_silo_bit_for_bit():
    """Under {"silos": 2, "clients": 3}, a ddp_sum inside the silo map sums each silo's
    clients; reference and XLA agree bit for bit and the accountant counts it once."""

    @fcir.program(placements={"silos": 2, "clients": 3})
    def per_silo(w, keys, x):
        def silo(w, keys, x):
            upd = fcir.map_fn(lambda w, x: x - w, (fcir.broadcast(w), x))
            return fcir.ddp_sum(upd, 1.0, 1.0, keys, bits=12)

        return fcir.map_fn(silo, (fcir.broadcast(w), keys, x))

    keys = jax.random.split(jax.random.key(1), 6).reshape(2, 3)
    args = (jnp.zeros(3), keys, jax.random.normal(jax.random.key(2), (2, 3, 3)))
    m = fcir.capture(per_silo, *args)
    assert np.array_equal(reference.run(m, *args), xla.compile(m)(*args))
    (r,) = fcir.privacy.releases(m)
    assert (r.op, r.count, r.bits) == ("fed.ddp_sum", 1, 12)


MESH_SCRIPT = """
import jax, jax.numpy as jnp, numpy as np, fcir
from fcir.interpreters import reference, xla

@fcir.program(placements={"clients": 6}, private=True)
def r(w, keys, x):
    upd = fcir.map_fn(lambda w, x: x - w, (fcir.broadcast(w), x))
    return w + fcir.ddp_mean(upd, 1.0, 1.0, keys, bits=16)

args = (jnp.zeros(3), jax.random.split(jax.random.key(0), 6),
        jax.random.normal(jax.random.key(1), (6, 3)))
m = fcir.capture(r, *args)
mesh = jax.make_mesh((2,), ("clients",))
want = np.asarray(reference.run(m, *args))
for k in (None, 1, 2):
    got = np.asarray(xla.compile(m, mesh=mesh, clients_per_step=k)(*args))
    assert np.array_equal(got, want), k
print("ok")
"""


@pytest.mark.slow  # 7 s: a two-device child process (docs/contributing.md)
def test_on_a_two_device_mesh_streamed_or_not_the_bits_are_the_references(tmp_path):
    import os
    import subprocess
    import sys

    env = dict(os.environ)
    # LLVM at -O0, as the 8-device children (eight_devices.py): the reference and the
    # mesh's programs are compiled alike in the child, and how the round is split over
    # the devices is decided on the HLO. The single-device checks above keep XLA's
    # defaults. Measured: 11.5 -> 6.9 CPU s (cheap_compile.py: with jaxlib 0.10's older
    # fusion emitters, less).
    flags = " ".join(cheap_compile.flags())
    env["XLA_FLAGS"] = (
        f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=2 {flags}"
    )
    out = subprocess.run(
        [sys.executable, "-c", MESH_SCRIPT],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


def test_ddp_ops_are_registry_fed_ops_of_kind_ddp_with_placed_keys():
    """fed.ddp_* live in fcir.fed (one module each) and every list of DP ops reads them
    from the registry by kind."""
    from fcir import fed as F
    from fcir.privacy import DP_OPS

    assert F.of_kind("ddp") == {"fed.ddp_sum", "fed.ddp_mean"} <= DP_OPS
    for name, mod in (("fed.ddp_sum", "fcir.fed.ddp_sum"), ("fed.ddp_mean", "fcir.fed.ddp_mean")):
        cls = F.ops()[name]
        assert cls.__module__ == mod and cls.multiple_results
        assert cls.attributes == {"clip_norm": float, "noise_multiplier": float, "bits": int}
        assert list(cls.placed_operands(3)) == [0, 1, 2]  # the keys are placed too
        assert F.by_primitive()[cls.primitive.name] is cls


def test_ddp_key_codes_are_privacy_c4_for_repeated_keys_and_c5_for_server_keys():
    assert "distinct" in fcir.privacy.CONSTRAINTS["privacy/C4"]
    assert "client data" in fcir.privacy.CONSTRAINTS["privacy/C5"]


def test_keys_folded_with_the_next_iterations_index_are_rejected():
    """fold_in(keys, t) and fold_in(keys, t + 1) in one scan: the second op's keys in
    iteration t are the first op's in iteration t + 1, so two releases carry the same
    noise. The key analysis shared with the central DP ops (fcir.privacy.keys) sees it."""

    def body(w, keys, x):
        def step(carry, _):
            w, t = carry
            a = fcir.map_fn(lambda k, t: jax.random.fold_in(k, t), (keys, fcir.broadcast(t)))
            b = fcir.map_fn(lambda k, t: jax.random.fold_in(k, t + 1), (keys, fcir.broadcast(t)))
            w = w + fcir.ddp_mean(_upd(w, x), 1.0, 1.0, a, bits=12)
            return (w + fcir.ddp_mean(_upd(w, x), 1.0, 1.0, b, bits=12), t + 1), None

        return jax.lax.scan(step, (w, jnp.int32(0)), None, length=3)[0][0]

    with pytest.raises(fcir.PrivacyError, match=r"privacy/C4: fed.ddp_mean reuses the keys"):
        _capture_private(body, *ARGS)


def test_epsilon_refuses_ddp_keys_reused_in_a_non_private_module_too():
    """As for the central DP ops, the accountant refuses repeated keys whether or not
    the program is private."""

    @fcir.program(placements={"clients": N})
    def round_(w, keys, x):
        a = fcir.ddp_mean(_upd(w, x), 1.0, 1.0, keys, bits=12)
        return fcir.ddp_mean(_upd(a, x), 1.0, 1.0, keys, bits=12)

    m = fcir.capture(round_, *ARGS)
    with pytest.raises(fcir.PrivacyError, match=r"epsilon: privacy/C4: fed.ddp_mean reuses"):
        fcir.privacy.epsilon(m, 1, 1e-5)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_member_with_a_nan_or_inf_entry_contributes_zero(bad):
    """A client whose update has a non-finite entry is encoded as the all-zero vector,
    as the central ops' clip_member does: its integers would otherwise come from a NaN
    (NaN passes no norm test and converts to whatever the backend makes of it), its
    contribution unbounded, and everyone's modular sum garbage."""
    fn, (w, keys, x) = _program(mean=False), _args()
    m = fcir.capture(fn, w, keys, x)
    bad_x = x.at[2, 1].set(bad)
    zero_x = x.at[2].set(0.0)  # "a" = x - w = 0 and "b" = 2 x[:2] = 0 for client 2
    got = reference.run(m, w, keys, bad_x)
    want = reference.run(m, w, keys, zero_x)
    for k in ("a", "b"):
        assert np.all(np.isfinite(got[k])), k
        assert np.array_equal(got[k], want[k]), k
        assert np.array_equal(xla.compile(m)(w, keys, bad_x)[k], want[k]), k


def test_the_clip_zeroes_a_row_with_a_non_finite_entry_before_any_rounding():
    """The zero above must not rest on how a backend converts NaN to an integer (XLA's
    CPU convert gives 0, LLVM's fptosi on a device gives poison): the clip itself
    returns an all-zero row for a row with a NaN or inf entry, and leaves others be."""
    rows = jnp.array([[1.0, jnp.nan, 0.0, 0.0], [jnp.inf, 0.0, 0.0, 0.0], [3.0, 4.0, 0.0, 0.0]])
    out = np.asarray(ddp._clip_rows(rows, 1.0))
    assert np.array_equal(out[:2], np.zeros((2, 4), np.float32))
    np.testing.assert_allclose(out[2], [0.6, 0.8, 0.0, 0.0], rtol=1e-6)
