"""Defects a first-time user finds writing ordinary programs from the README and the docs.

Each test is the program a new user writes, compared with the same program written in
plain JAX (no fcir) or with what the program actually releases.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fcir.interpreters import reference, xla

import fcir

N = 4


# --- f16 / bf16 client data: sums and means accumulate as jnp.sum / jnp.mean do --------------


@fcir.program(placements={"clients": N})
def _sum_and_mean(x):
    return fcir.reduce_sum(x), fcir.reduce_mean(x)


def _plain_sum_and_mean(x):  # the same round without fcir: the member axis is axis 0
    return jnp.sum(x, axis=0), jnp.mean(x, axis=0)


_HALF = [
    # an intermediate sum overflows f16 (max 65504) though the total does not
    np.array([[60000.0], [60000.0], [-60000.0], [-60000.0]], np.float16),
    np.full((N, 1), 60000.0, np.float16),  # the mean is representable, the sum is not
    np.array([[256.0], [1.0], [1.0], [1.0]], jnp.bfloat16),  # bf16 drops the 1s one by one
]


@fcir.program(placements={"clients": N})
def _weighted(x, w):
    return fcir.reduce_weighted_mean(x, w)


@pytest.mark.parametrize("x", _HALF, ids=["f16-cancel", "f16-mean-of-big", "bf16-small-terms"])
def test_half_precision_weighted_mean_equals_jnp_average_on_every_backend(x):
    """Before: the reference interpreter added the weighted members in bf16 one by one
    (256 + 1 + 1 + 1 stayed 256), where jit and jnp.average accumulate in f32."""
    w = np.ones(N, x.dtype)
    want = jnp.average(x, axis=0, weights=w)
    module = fcir.capture(_weighted, x, w)
    for name, got in [
        ("jit", jax.jit(_weighted)(x, w)),
        ("reference", reference.run(module, x, w)),
        ("xla", xla.compile(module)(x, w)),
    ]:
        assert got.dtype == want.dtype, name
        np.testing.assert_array_equal(
            np.asarray(got, np.float32), np.asarray(want, np.float32), name
        )


@fcir.program(placements={"clients": N})
def _dp_unclipped(x, key):  # a clip norm above every member and no noise: the plain sum
    return fcir.dp_sum(x, 1e6, 0.0, key), fcir.dp_mean(x, 1e6, 0.0, key)


@pytest.mark.parametrize("x", _HALF, ids=["f16-cancel", "f16-mean-of-big", "bf16-small-terms"])
def test_half_precision_dp_sum_without_noise_or_clipping_equals_jnp_sum_on_every_backend(x):
    """Before: the reference interpreter added clipped members in the narrow dtype."""
    key = jax.random.key(0)
    want = (jnp.sum(x, axis=0), (jnp.sum(x, axis=0) / N).astype(x.dtype))
    module = fcir.capture(_dp_unclipped, x, key)
    for name, got in [
        ("jit", jax.jit(_dp_unclipped)(x, key)),
        ("reference", reference.run(module, x, key)),
        ("xla", xla.compile(module)(x, key)),
    ]:
        for g, w in zip(got, want):
            assert g.dtype == w.dtype, name
            np.testing.assert_array_equal(
                np.asarray(g, np.float32), np.asarray(w, np.float32), name
            )


@pytest.mark.parametrize("x", _HALF, ids=["f16-cancel", "f16-mean-of-big", "bf16-small-terms"])
def test_half_precision_sum_and_mean_equal_plain_jax_on_every_backend(x):
    want = jax.jit(_plain_sum_and_mean)(x)
    module = fcir.capture(_sum_and_mean, x)
    for name, got in [
        ("jit", jax.jit(_sum_and_mean)(x)),
        ("reference", reference.run(module, x)),
        ("xla", xla.compile(module)(x)),
    ]:
        for g, w in zip(got, want):
            assert g.dtype == w.dtype, name
            np.testing.assert_array_equal(
                np.asarray(g, np.float32), np.asarray(w, np.float32), name
            )


# --- dp_mean: a client's NaN or inf must not reach the release --------------------------------


@fcir.program(placements={"clients": N}, private=True)
def _dp_round(w, key, x):
    upd = fcir.map_fn(lambda w, x: x - w, (fcir.broadcast(w), x))
    return w + fcir.dp_mean(upd, 1.0, 1.1, key)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_client_with_a_non_finite_entry_contributes_zero_and_its_position_is_not_released(bad):
    """Before: clipping left a NaN member unscaled (NaN > 0 is false) and scaled an inf
    one by 0 (inf * 0 = NaN), so the noised mean was NaN exactly at the coordinates where
    one client had a bad entry: a noise-free release of that client's data."""
    w, key = jnp.zeros(3), jax.random.key(0)
    x = np.ones((N, 3), np.float32)
    zeroed = x.copy()
    zeroed[1] = 0.0  # what the checker's guarantee allows: the member contributes nothing
    module = fcir.capture(_dp_round, w, key, x)
    exe = xla.compile(module)
    for at in range(3):
        leaky = x.copy()
        leaky[1, at] = bad
        for name, run in [
            ("jit", jax.jit(_dp_round)),
            ("reference", lambda *a: reference.run(module, *a)),
            ("xla", exe),
        ]:
            got, want = run(w, key, leaky), run(w, key, zeroed)
            assert np.isfinite(np.asarray(got)).all(), (name, at, got)
            np.testing.assert_allclose(got, want, rtol=1e-6, err_msg=f"{name} at {at}")


# --- first mistakes: plain-Python errors become FcirErrors that say what to do ---------------


def test_program_without_placements_says_how_to_declare_them():
    """Before: ``@fcir.program`` without parentheses was a raw ``TypeError: program()
    takes 0 positional arguments but 1 was given``."""
    with pytest.raises(fcir.PlacementError, match=r"@fcir.program\(placements=\{'clients'"):

        @fcir.program
        def round_(x):
            return fcir.reduce_mean(x)

    with pytest.raises(fcir.PlacementError, match="needs its placements"):
        fcir.program()


def test_capture_of_a_non_array_argument_names_the_argument():
    """Before: a raw JAX TypeError about jit-wrapped functions and static arguments."""

    @fcir.program(placements={"clients": N})
    def round_(w, data):
        return fcir.reduce_mean(fcir.map_fn(lambda w, x: w * x, (fcir.broadcast(w), data["x"])))

    with pytest.raises(fcir.IRTypeError, match=r"argument \[1\]\['name'\] is a str"):
        fcir.capture(round_, jnp.ones(()), {"x": jnp.ones(N), "name": "mnist"})


# --- private programs: a DP op without noise is no DP op -------------------------------------


@pytest.mark.parametrize("op", [fcir.dp_sum, fcir.dp_mean])
def test_a_private_program_whose_dp_op_has_no_noise_is_rejected(op):
    """Before: ``noise_multiplier=0`` passed the private check (the clipped sum of client
    data reached the server un-noised) and only ``fcir.privacy.epsilon`` said inf."""

    @fcir.program(placements={"clients": N}, private=True)
    def round_(w, key, x):
        upd = fcir.map_fn(lambda w, x: x - w, (fcir.broadcast(w), x))
        return w + op(upd, 1.0, 0.0, key)

    with pytest.raises(fcir.PrivacyError, match="privacy/C1: fed.dp_.* has noise_multiplier=0"):
        fcir.capture(round_, jnp.zeros(3), jax.random.key(0), jnp.ones((N, 3)))
    # without private=True it is a clipped sum, as documented
    plain = fcir.program(placements={"clients": N})(round_.__wrapped__)
    fcir.capture(plain, jnp.zeros(3), jax.random.key(0), jnp.ones((N, 3)))


def test_cli_args_with_a_missing_type_names_the_parameters(tmp_path, capsys):
    """Before: ``TypeError: fedavg_round() missing 1 required positional argument``."""
    from fcir import cli

    code = cli.main(
        ["compile", "examples/fedavg.py:fedavg_round", "--args", "f32[3]", "-o", str(tmp_path)]
    )
    err = capsys.readouterr().err
    assert code == 1
    assert "fedavg_round(model, client_data) takes 2 argument(s) but --args gave 1" in err
    assert "TypeError" not in err


# --- client data that never goes through map_fn's arguments ----------------------------------

_X = jnp.arange(12.0).reshape(N, 3)


def test_declared_client_data_read_through_a_closure_is_refused():
    """Before: with ``client_data=("x",)`` declared, a map_fn body that closed over ``x``
    captured: ``x`` was typed a server value and broadcast, so every client computed on
    all clients' data (what jit computes too, so no backend disagreed)."""

    @fcir.program(placements={"clients": N}, client_data=("x",))
    def round_(w, x):
        return fcir.reduce_mean(fcir.map_fn(lambda w: w * jnp.mean(x), fcir.broadcast(w)))

    with pytest.raises(fcir.PlacementError, match="'x' is declared client data .* closure"):
        fcir.capture(round_, jnp.ones(3), _X)


def _leaky_closure(w, key, x):
    return fcir.dp_mean(fcir.map_fn(lambda w: w * jnp.mean(x), fcir.broadcast(w)), 1.0, 1.0, key)


def _leaky_server_read(w, key, x):
    upd = fcir.map_fn(lambda w: w, fcir.broadcast(w))
    return fcir.dp_mean(upd, 1.0, 1.0, key) + jnp.mean(x)


@pytest.mark.parametrize("body", [_leaky_closure, _leaky_server_read], ids=["closure", "server"])
def test_a_private_program_that_reads_declared_client_data_at_the_server_is_rejected(body):
    """Before: the private check follows client-*placed* values only; client data read
    whole at the server (directly, or by a closure in map_fn) is typed a server value, so
    ``jnp.mean(x)`` over every client's data reached the server un-noised and passed.
    Declaring the client data is how a private program says which arguments they are
    (undeclared, fcir cannot tell ``x`` from a model with the cohort's leading axis)."""
    declared = fcir.program(placements={"clients": N}, private=True, client_data=("x",))(body)
    with pytest.raises(fcir.PlacementError, match="'x' is declared client data"):
        fcir.capture(declared, jnp.ones(3), jax.random.key(0), _X)
    # passed to map_fn, the same data is client data and the round checks
    ok = fcir.program(placements={"clients": N}, private=True, client_data=("x",))(
        _dp_round.__wrapped__
    )
    fcir.capture(ok, jnp.ones(3), jax.random.key(0), _X)


def test_cli_run_with_a_non_npz_inputs_file_says_how_to_write_one(tmp_path, capsys):
    """Before: numpy's 'If you trust the file you can load it unsafely using the
    allow_pickle= keyword' advice, which fcir cannot take and a user should not."""
    from fcir import cli

    ir = tmp_path / "r.fcir"
    ir.write_text(fcir.capture(_sum_and_mean, np.ones((N, 1), np.float32)).to_text())
    assert cli.main(["run", str(ir), "--backend", "reference", "--inputs", str(ir)]) == 1
    err = capsys.readouterr().err
    assert "is not an .npz of arrays" in err and "np.savez(" in err
    assert "allow_pickle" not in err


def test_vmap_over_client_data_batched_in_front_of_the_members_says_use_in_axes_1():
    """jit runs ``jax.vmap(round_, in_axes=(None, 0))`` over data sets ``[B, N, ...]``,
    but capture sees a server value ``[B, N, ...]`` (its leading axis is not the cohort):
    the error said only 'pass per-member values as client data', which the user did."""

    @fcir.program(placements={"clients": N})
    def round_(w, x):
        return fcir.reduce_mean(fcir.map_fn(lambda w, x: w * jnp.sum(x), (fcir.broadcast(w), x)))

    with pytest.raises(fcir.PlacementError, match=r"under jax.vmap, .* in_axes=1"):
        fcir.capture(
            lambda w, xs: jax.vmap(round_, (None, 0))(w, xs), jnp.ones(3), jnp.ones((2, N, 3))
        )
    module = fcir.capture(
        lambda w, xs: jax.vmap(round_, (None, 1))(w, xs), jnp.ones(3), jnp.ones((N, 2, 3))
    )
    np.testing.assert_array_equal(
        reference.run(module, jnp.ones(3), jnp.ones((N, 2, 3))), np.full((2, 3), 3.0)
    )


def test_weighted_mean_with_cancelling_weights_is_what_the_docstring_says():
    """The docstring said compiled code returns NaN for a zero total weight; with
    weights that cancel (``[-1, 1, 0, 0]``) it is +-inf, as jnp.average's."""

    @fcir.program(placements={"clients": N})
    def round_(x, w):
        return fcir.reduce_weighted_mean(x, w)

    x = jnp.arange(12.0).reshape(N, 3)
    cancel, zero = jnp.array([-1.0, 1.0, 0.0, 0.0]), jnp.zeros(N)
    got = jax.jit(round_)(x, cancel)
    np.testing.assert_array_equal(got, jnp.average(x, axis=0, weights=cancel))
    assert np.isinf(got).all() and np.isnan(jax.jit(round_)(x, zero)).all()
    assert "+-inf where it is not" in fcir.reduce_weighted_mean.__doc__
    with pytest.raises(fcir.InterpreterError, match="total weight is zero"):
        reference.run(fcir.capture(round_, x, cancel), x, cancel)


def test_a_map_fn_body_that_returns_a_string_is_an_fcir_error():
    """Before: JAX's 'function flat_body at fcir/frontend/program.py traced for jit returned a value of
    type <class 'str'>', naming fcir's internals instead of the user's body."""

    @fcir.program(placements={"clients": N})
    def round_(x):
        return fcir.map_fn(lambda x: {"loss": jnp.sum(x), "tag": "client"}, x)

    with pytest.raises(fcir.PlacementError, match=r"fn returned a str \('client'\)"):
        fcir.capture(round_, jnp.ones((N, 3)))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_a_clipped_half_precision_member_never_exceeds_the_clip_norm(dtype):
    """The accountant assumes each member's clipped norm is at most clip_norm. Before:
    scaling bf16 leaves by a bf16-rounded ``min(1, c / norm)`` and rounding the product
    gave norms up to 1.0034 * c (f16: 1.0005 * c), a sensitivity above the accounted."""
    from fcir.frontend.primitives import clip_member

    rng = np.random.default_rng(0)
    worst = 0.0
    for _ in range(200):
        a = jnp.asarray(rng.normal(size=(48,)) * rng.uniform(0.5, 5.0), dtype)
        b = jnp.asarray(rng.normal(size=(3, 5)), dtype)
        clipped = clip_member([a, b], 1.0)
        norm = np.sqrt(sum(np.sum(np.asarray(c, np.float64) ** 2) for c in clipped))
        worst = max(worst, norm)
    assert worst <= 1.0, worst
    assert worst > 0.99  # still clipped to about the norm, not far below it


@pytest.mark.parametrize("sizes", [(1000,), (4096, 33), (7, 1, 250_001)])
def test_a_clipped_float32_member_never_exceeds_the_clip_norm_exactly(sizes):
    """The same bound in float32, where the error is the norm's own: scaling by
    ``clip_norm / norm`` with a computed norm a few ulps low left about half the clipped
    members above clip_norm (by up to ~1e-7 relative) before ``clip_margin``."""
    from fcir.frontend.primitives import clip_member

    rng = np.random.default_rng(len(sizes))
    clip = jax.jit(lambda leaves: clip_member(leaves, 1.0))
    norms = []
    for _ in range(40):
        leaves = [
            jnp.asarray(rng.normal(size=n) * rng.uniform(0.1, 9.0), jnp.float32) for n in sizes
        ]
        out = clip(leaves)
        exact = sum(np.sum(np.asarray(c, np.float64) ** 2) for c in out)
        norms.append(float(np.sqrt(exact)))
    assert max(norms) <= 1.0, max(norms)
    assert min(norms) > 1 - 1e-5  # each is clipped to the norm, less a few ulps


# --- keyword arguments: a module captured with f(w, x=x) runs with f(w, x=x) ---------------


@fcir.program(placements={"clients": N})
def _scaled_stats(w, x, y):
    return {"mean": w * fcir.reduce_mean(x), "max": fcir.reduce_max(y) - w}


def _keyword_args():
    w = jnp.float32(3.0)
    x = jnp.arange(N, dtype=jnp.float32)
    y = jnp.asarray([5.0, -1.0, 2.0, 0.5], jnp.float32)
    return w, x, y


def test_reference_and_xla_run_with_the_keyword_arguments_capture_recorded():
    w, x, y = _keyword_args()
    module = fcir.capture(_scaled_stats, w, y=y, x=x)
    assert '.args (($0,), {"x": $1, "y": $2})' in module.to_text()
    want = _scaled_stats(w, x=x, y=y)
    exe = xla.compile(module)
    for got in (
        reference.run(module, w, x=x, y=y),
        reference.run(module, w, y=y, x=x),  # keyword order is free, as in Python
        exe(w, x=x, y=y),
        exe(w, y=np.asarray(y), x=x),  # numpy leaves take the checked path
        exe(w, x=x, y=y),  # warm
    ):
        np.testing.assert_allclose(got["mean"], want["mean"])
        np.testing.assert_allclose(got["max"], want["max"])
    assert exe.lower(w, x=x, y=y).as_text() == exe.lower(w, x=x, y=y).as_text()
    exe(w, x, y)  # positional leaves in flatten order still run, as before


def test_cost_and_as_text_take_the_keyword_arguments_capture_recorded():
    w, x, y = _keyword_args()
    exe = xla.compile(fcir.capture(_scaled_stats, w, x=x, y=y))
    by_keyword, by_specs = exe.cost(w, x=x, y=y), exe.cost()
    assert by_keyword["xla"] == by_specs["xla"]
    assert exe.as_text("hlo", w, x=x, y=y) == exe.as_text("hlo")
    with pytest.raises(fcir.InterpreterError, match=r"cost: .*got \(1 positional, x=\)"):
        exe.cost(w, x=x)


@fcir.program(placements={"clients": N})
def _with_intermediates_keyword(w, intermediates):
    return w * fcir.reduce_mean(intermediates)


def test_a_program_keyword_named_intermediates_is_the_programs_not_run_s_flag():
    w, x, _ = _keyword_args()
    module = fcir.capture(_with_intermediates_keyword, w, intermediates=x)
    want = _with_intermediates_keyword(w, intermediates=x)
    np.testing.assert_allclose(reference.run(module, w, intermediates=x), want)
    plain = fcir.capture(_with_intermediates_keyword, w, x)
    with pytest.raises(fcir.InterpreterError, match=r"takes True or False, got .*Array"):
        reference.run(plain, w, intermediates=x)


def test_keyword_arguments_that_do_not_match_the_capture_are_an_fcir_error_naming_them():
    w, x, y = _keyword_args()
    module = fcir.capture(_scaled_stats, w, x=x, y=y)
    exe = xla.compile(module)
    for run in (lambda **kw: reference.run(module, w, **kw), lambda **kw: exe(w, **kw)):
        with pytest.raises(
            fcir.InterpreterError, match=r"1 positional, x=, y=.*got \(1 positional, x=, z=\)"
        ):
            run(x=x, z=y)
        with pytest.raises(fcir.InterpreterError, match=r"1 positional, x=, y="):
            run(x=x)
    with pytest.raises(fcir.InterpreterError, match=r"got \(2 positional, y=\)"):
        exe(w, x, y=y)
    positional = fcir.capture(_scaled_stats, w, x, y)
    for run in (
        lambda: reference.run(positional, w, x, y=y),
        lambda: xla.compile(positional)(w, x, y=y),
    ):
        with pytest.raises(
            fcir.InterpreterError,
            match=r"captured without keyword arguments \(it takes 3 positional\)",
        ):
            run()
