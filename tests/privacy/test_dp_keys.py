"""privacy/C4: every DP release the accountant counts draws noise no other release draws.

``fcir.privacy.epsilon`` counts a DP op inside a ``jax.scan`` of length L as L
independent Gaussian releases, two DP ops as two. With one key reused, the noise is
identical and the difference of two releases is noise-free. ``fcir.privacy.keys`` follows
each key to its origin; a private program whose releases it cannot tell apart does not
check, and ``epsilon`` refuses such a module.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fcir.interpreters import reference, xla

import fcir

N, ROUNDS = 3, 4
W = jnp.asarray([0.5, -1.0, 2.0], jnp.float32)
KEY = jax.random.key(3)
XS = jnp.asarray(np.random.default_rng(0).normal(size=(N, 3)), jnp.float32)


def rounds(key_of, *, private=True, ops=1):
    """ROUNDS DP rounds in a scan; ``key_of(key, carried, i)`` gives the keys of the
    round's ``ops`` DP ops and the next carried key."""

    @fcir.program(placements={"clients": N}, private=private)
    def program(w, key, xs):
        def body(carry, i):
            w, k = carry
            upd = fcir.map_fn(lambda w, x: x - w, (fcir.broadcast(w), xs))
            keys, k = key_of(key, k, i)
            assert len(keys) == ops
            for sub in keys:
                w = w + 0.5 * fcir.dp_mean(upd, 1.0, 0.7, sub)
            return (w, k), None

        return jax.lax.scan(body, (w, key), jnp.arange(ROUNDS))[0][0]

    return program


def _split(k, n=2):
    keys = jax.random.split(k, n)
    return [keys[j] for j in range(n)]


SAME_EVERY_ROUND = {
    "the key argument (a scan const)": lambda key, k, i: ([key], k),
    "a key carried but never advanced": lambda key, k, i: ([_split(k)[1]], k),
    "fold_in with a constant": lambda key, k, i: ([jax.random.fold_in(key, 7)], k),
}


@pytest.mark.parametrize("key_of", SAME_EVERY_ROUND.values(), ids=SAME_EVERY_ROUND.keys())
def test_one_key_in_every_scan_iteration_is_rejected_naming_the_dp_op(key_of):
    with pytest.raises(fcir.PrivacyError) as info:
        fcir.capture(rounds(key_of), W, KEY, XS)
    msg = str(info.value)
    assert re.match(r"fed.dp_mean \(op \d+/0/\d+", msg), msg
    assert "privacy/C4" in msg and "every iteration" in msg and "fold_in(key, i)" in msg
    # Not declared private, it captures, but the accountant will not count identical
    # noise as ROUNDS independent releases.
    module = fcir.capture(rounds(key_of, private=False), W, KEY, XS)
    with pytest.raises(fcir.PrivacyError, match="privacy/C4"):
        fcir.privacy.epsilon(module, 10, 1e-5)
    assert "privacy/C4" in fcir.privacy.round_cost(module)["error"]


DISTINCT_PER_ROUND = {
    "fold_in with the scan index": lambda key, k, i: ([jax.random.fold_in(key, i)], k),
    "split of the carried key": lambda key, k, i: (lambda a: ([a[1]], a[0]))(_split(k)),
    "the carried key, advanced": lambda key, k, i: (lambda a: ([a[0]], a[0]))(_split(k)),
    "fold_in of fold_in with the index": lambda key, k, i: (
        [jax.random.fold_in(jax.random.fold_in(key, i), 5)],
        k,
    ),
}


@pytest.mark.parametrize("key_of", DISTINCT_PER_ROUND.values(), ids=DISTINCT_PER_ROUND.keys())
def test_keys_that_change_every_iteration_pass_and_run_like_jit(key_of):
    program = rounds(key_of)
    module = fcir.capture(program, W, KEY, XS)
    assert module.private
    want = jax.jit(program)(W, KEY, XS)
    np.testing.assert_allclose(reference.run(module, W, KEY, XS), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(xla.compile(module)(W, KEY, XS), want)
    assert [r.count for r in fcir.privacy.releases(module)] == [ROUNDS]
    assert fcir.privacy.epsilon(module, 2, 1e-5) > 0


def test_scanning_over_split_keys_and_a_fori_loop_counter_pass():
    @fcir.program(placements={"clients": N}, private=True)
    def over_split(w, key, xs):
        def body(w, k):
            upd = fcir.map_fn(lambda w, x: x - w, (fcir.broadcast(w), xs))
            return w + fcir.dp_mean(upd, 1.0, 0.7, k), None

        return jax.lax.scan(body, w, jax.random.split(key, ROUNDS))[0]

    @fcir.program(placements={"clients": N}, private=True)
    def fori(w, key, xs):
        def body(i, w):
            upd = fcir.map_fn(lambda w, x: x - w, (fcir.broadcast(w), xs))
            return w + fcir.dp_mean(upd, 1.0, 0.7, jax.random.fold_in(key, i))

        return jax.lax.fori_loop(0, ROUNDS, body, w)

    for program in (over_split, fori):
        module = fcir.capture(program, W, KEY, XS)
        want = jax.jit(program)(W, KEY, XS)
        np.testing.assert_allclose(reference.run(module, W, KEY, XS), want, rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(xla.compile(module)(W, KEY, XS), want)


TWO_OPS = {
    "one key": (lambda key, k, i: ([jax.random.fold_in(key, i)] * 2, k), False),
    "fold_in i and i + 1": (
        lambda key, k, i: ([jax.random.fold_in(key, i), jax.random.fold_in(key, i + 1)], k),
        False,
    ),
    "the carried key and its successor": (
        lambda key, k, i: (lambda a: ([k, a[0]], a[0]))(_split(k)),
        False,
    ),
    "fold_in(fold_in(key, i), 0 / 1)": (
        lambda key, k, i: ([jax.random.fold_in(jax.random.fold_in(key, i), j) for j in (0, 1)], k),
        True,
    ),
    "split(carried, 3)[1] / [2]": (
        lambda key, k, i: (lambda a: ([a[1], a[2]], a[0]))(_split(k, 3)),
        True,
    ),
}


@pytest.mark.parametrize("key_of,ok", TWO_OPS.values(), ids=TWO_OPS.keys())
def test_two_dp_ops_of_a_round_need_keys_that_never_coincide(key_of, ok):
    # fold_in(key, i + 1) in round i is fold_in(key, i) of the other op in round i + 1.
    program = rounds(key_of, ops=2)
    if ok:
        module = fcir.capture(program, W, KEY, XS)
        np.testing.assert_array_equal(xla.compile(module)(W, KEY, XS), jax.jit(program)(W, KEY, XS))
        assert [r.count for r in fcir.privacy.releases(module)] == [ROUNDS, ROUNDS]
        return
    with pytest.raises(
        fcir.PrivacyError,
        match=r"privacy/C4: fed.dp_mean may draw the same "
        r"noise as fed.dp_mean \(op \d+/0/\d+\)",
    ):
        fcir.capture(program, W, KEY, XS)


def test_straight_line_releases_two_arguments_constants_and_cond_branches():
    def upd(w, xs):
        return fcir.map_fn(lambda w, x: x - w, (fcir.broadcast(w), xs))

    def private(fn):
        return fcir.program(placements={"clients": N}, private=True)(fn)

    @private
    def one_key_twice(w, key, xs):
        return fcir.dp_mean(upd(w, xs), 1.0, 1.0, key) + fcir.dp_sum(upd(w, xs), 1.0, 1.0, key)

    @private
    def two_key_arguments(w, key, key2, xs):  # the caller may pass one key twice
        return fcir.dp_mean(upd(w, xs), 1.0, 1.0, key) + fcir.dp_sum(upd(w, xs), 1.0, 1.0, key2)

    @private
    def constant_key(w, xs):  # every run, every round, the same noise
        return fcir.dp_mean(upd(w, xs), 1.0, 1.0, jax.random.key(0))

    with pytest.raises(fcir.PrivacyError, match=r"^fed.dp_sum \(op .*privacy/C4: .*same noise"):
        fcir.capture(one_key_twice, W, KEY, XS)
    with pytest.raises(fcir.PrivacyError, match="privacy/C4: .*same noise"):
        fcir.capture(two_key_arguments, W, KEY, KEY, XS)
    with pytest.raises(fcir.PrivacyError, match="privacy/C4: .*constant of the program"):
        fcir.capture(constant_key, W, XS)

    @private
    def split_and_fold(w, key, xs):
        k1, _ = jax.random.split(key)
        a = fcir.dp_mean(upd(w, xs), 1.0, 1.0, k1)
        return a + fcir.dp_sum(upd(w, xs), 1.0, 1.0, jax.random.fold_in(key, 0))

    # With jax_threefry_partitionable (JAX's default), split(key)[0] is fold_in(key, 0).
    assert jax.config.jax_threefry_partitionable
    np.testing.assert_array_equal(
        jax.random.key_data(jax.random.split(KEY)[0]),
        jax.random.key_data(jax.random.fold_in(KEY, 0)),
    )
    with pytest.raises(fcir.PrivacyError, match="privacy/C4: .*same noise"):
        fcir.capture(split_and_fold, W, KEY, XS)

    @private
    def derived(w, key, xs):  # the key itself and a key derived from it differ
        k1, k2 = jax.random.split(key)
        a = fcir.dp_mean(upd(w, xs), 1.0, 1.0, key)
        b = fcir.dp_sum(upd(w, xs), 1.0, 1.0, jax.random.fold_in(key, 2))
        return a + b + fcir.dp_sum(upd(w, xs), 1.0, 1.0, k1) + fcir.dp_sum(upd(w, xs), 1.0, 1.0, k2)

    @private
    def either(w, key, xs, flag):  # one branch runs: one release, whichever it is
        return jax.lax.cond(
            flag,
            lambda w: fcir.dp_mean(upd(w, xs), 1.0, 1.0, key),
            lambda w: fcir.dp_sum(upd(w, xs), 1.0, 1.0, key),
            w,
        )

    for program, args in ((derived, (W, KEY, XS)), (either, (W, KEY, XS, True))):
        module = fcir.capture(program, *args)
        np.testing.assert_array_equal(xla.compile(module)(*args), jax.jit(program)(*args))


def test_a_dp_op_inside_a_map_over_silos_needs_a_key_per_silo():
    silos, per_silo = 2, 3

    def hierarchical(per_member_keys):
        @fcir.program(placements={"silos": silos, "clients": per_silo}, private=True)
        def program(w, key, x):
            def silo(w, k, x):
                upd = fcir.map_fn(lambda w, x: x - w, (fcir.broadcast(w), x))
                return fcir.dp_mean(upd, 1.0, 1.0, k)

            keys = key if per_member_keys else fcir.broadcast(key)
            return fcir.reduce_mean(fcir.map_fn(silo, (fcir.broadcast(w), keys, x)))

        return program

    x = jnp.asarray(np.random.default_rng(1).normal(size=(silos, per_silo, 3)), jnp.float32)
    # One key broadcast to the silos: every silo's release has the same noise.
    with pytest.raises(fcir.PrivacyError, match="privacy/C4: .*every member of the fed.map"):
        fcir.capture(hierarchical(False), W, KEY, x)
    # A key per silo (the caller's, like a key argument) passes.
    keys = jax.random.split(KEY, silos)
    program = hierarchical(True)
    module = fcir.capture(program, W, keys, x)
    np.testing.assert_array_equal(xla.compile(module)(W, keys, x), jax.jit(program)(W, keys, x))
