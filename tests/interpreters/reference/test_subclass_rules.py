"""A ReferenceInterpreter subclass's rules: they see every run of their op, inside local
and federated loops and nested jits, and a rule that returns None is blamed on itself;
an ``@fcir.impl`` name must be an op's (a misspelt one names the closest), and an
``unsupported`` entry must map a fed op class to ``fcir.fed.Unsupported``."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fcir.interpreters import reference
from fcir.interpreters.reference import ReferenceInterpreter

import fcir

CLIENTS, ROUNDS, STEPS = 3, 2, 5


def _local_scan(w, x):
    def step(w, batch):
        return w - 0.1 * (batch @ w), None

    return jax.lax.scan(step, w, x)[0]


def _local_while(w, x):
    def body(carry):
        i, w = carry
        return i + 1, w - 0.1 * (x[i] @ w)

    return jax.lax.while_loop(lambda c: c[0] < STEPS, body, (0, w))[1]


def _local_jit(w, x):
    step = jax.jit(lambda w, b: w - 0.1 * (b @ w))
    for i in range(STEPS):
        w = step(w, x[i])
    return w


def _rounds(local):
    @fcir.program(placements={"clients": CLIENTS})
    def rounds(w, x):
        def one(w, _):
            return fcir.reduce_mean(fcir.map_fn(local, (fcir.broadcast(w), x))), None

        return jax.lax.scan(one, w, None, length=ROUNDS)[0]

    return rounds


def _args():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(CLIENTS, STEPS, 4, 4)) * 0.3, jnp.float32)
    return jnp.full((4, 4), 0.1), x


class CountDots(ReferenceInterpreter):
    def __init__(self):
        super().__init__()
        self.calls = 0

    @fcir.impl("jax.dot_general")
    def dot_general(self, op, x, y):
        self.calls += 1
        return super().local(op, x, y)


@pytest.mark.parametrize(
    "local", [_local_scan, _local_while, _local_jit], ids=["scan", "while", "jit"]
)
def test_a_rule_for_a_jax_op_sees_every_local_iteration_of_every_round(local):
    args = _args()
    module = fcir.capture(_rounds(local), *args)
    counter = CountDots()
    out = counter.run(module, *args)
    assert counter.calls == ROUNDS * CLIENTS * STEPS
    np.testing.assert_allclose(out, reference.run(module, *args), rtol=1e-6)
    again = counter.calls
    counter.run(module, *args)  # a second run counts as many again (nothing cached)
    assert counter.calls == 2 * again


def test_a_subclass_overriding_nothing_inside_a_local_loop_keeps_it_compiled():
    class CountMeans(ReferenceInterpreter):
        calls = 0

        @fcir.impl(fcir.fed.Mean)
        def mean(self, op, x):
            CountMeans.calls += 1
            return super().mean(op, x)

    args = _args()
    module = fcir.capture(_rounds(_local_scan), *args)
    np.testing.assert_array_equal(CountMeans().run(module, *args), reference.run(module, *args))
    assert CountMeans.calls == ROUNDS


def test_a_broadcast_in_a_server_scan_is_seen_per_round_and_per_leaf():
    class CountBroadcasts(ReferenceInterpreter):
        calls = 0

        @fcir.impl(fcir.fed.Broadcast)
        def broadcast(self, op, x):
            CountBroadcasts.calls += 1
            return super().broadcast(op, x)

    @fcir.program(placements={"clients": 3})
    def three_rounds(p, x):
        def one(p, _):
            new = fcir.map_fn(lambda p, x: {"a": p["a"] + x, "b": p["b"]}, (fcir.broadcast(p), x))
            return jax.tree.map(fcir.reduce_mean, new), None

        return jax.lax.scan(one, p, None, length=3)[0]

    p, x = {"a": jnp.zeros(2), "b": jnp.zeros(2)}, jnp.ones((3, 2))
    CountBroadcasts().run(fcir.capture(three_rounds, p, x), p, x)
    assert CountBroadcasts.calls == 3 * 2


def test_a_rule_returning_none_is_blamed_on_the_rule_not_on_the_op_reading_it():
    class Forgot(ReferenceInterpreter):
        @fcir.impl("jax.dot_general")
        def dot_general(self, op, x, y):
            super().local(op, x, y)  # no return

    class ForgotMean(ReferenceInterpreter):
        @fcir.impl(fcir.fed.Mean)
        def mean(self, op, x):
            super().mean(op, x)

    args = _args()
    module = fcir.capture(_rounds(_local_scan), *args)
    with pytest.raises(fcir.InterpreterError) as e:
        Forgot().run(module, *args)
    msg = str(e.value)
    assert "while running jax.dot_general" in msg
    assert "Forgot.dot_general returned None for jax.dot_general" in msg
    assert "super().local(op, ...)" in msg and "NoneType" not in msg
    with pytest.raises(
        fcir.InterpreterError,
        match=r"ForgotMean.mean returned None for "
        r"fed.mean.*super\(\)\.mean\(op, \.\.\.\)",
    ):
        ForgotMean().run(module, *args)


def test_a_rule_returning_a_list_for_its_one_result_is_blamed_on_the_rule():
    # A one-result list was taken as the value: read by jnp.asarray as a (1, ...) stack,
    # or, iterated from the result, as its rows sliced and stacked again.
    class Listed(ReferenceInterpreter):
        @fcir.impl(fcir.fed.Mean)
        def mean(self, op, x):
            return [super().mean(op, x)]

    args = _args()
    module = fcir.capture(_rounds(_local_scan), *args)
    with pytest.raises(
        fcir.InterpreterError,
        match=r"Listed.mean returned a list of 1 for "
        r"fed.mean, which has one result: return the value itself",
    ):
        Listed().run(module, *args)


# --- @fcir.impl with a misspelt op name: the method was dead code --------------------------


def test_a_misspelt_fed_op_name_in_impl_is_an_error_naming_the_closest_op():
    with pytest.raises(fcir.FcirError, match=r"'fed\.braodcast'.*did you mean 'fed\.broadcast'"):

        class Count(ReferenceInterpreter):
            @fcir.impl("fed.braodcast")
            def broadcast(self, op, x):
                return super().broadcast(op, x)


def test_impl_refuses_unprefixed_and_unknown_fcir_names_but_takes_any_jax_primitive_name():
    with pytest.raises(fcir.FcirError, match=r"did you mean 'fed\.broadcast'"):
        fcir.impl("broadcast")
    with pytest.raises(fcir.FcirError, match=r"did you mean 'jax\.scan'"):
        fcir.impl("scan")
    with pytest.raises(fcir.FcirError, match=r"did you mean 'fcir\.constant'"):
        fcir.impl("fcir.constnat")
    with pytest.raises(fcir.FcirError, match="an op name is fed"):
        fcir.impl("jax.not a name")
    # jax.* is JAX's open set of primitives (different per JAX version, and an
    # interpreter may implement one the running JAX lacks): taken as written.
    for name in ("jax.scan", "jax.scatter-add", "jax.a_primitive_of_another_jax"):
        assert fcir.impl(name)(lambda self, op: None).fcir_ops == (name,)


def test_an_impl_spelt_right_still_runs_in_place_of_the_inherited_one():
    seen = []

    class Count(ReferenceInterpreter):
        @fcir.impl("fed.broadcast")
        def broadcast(self, op, x):
            seen.append(op.attrs["to"])
            return super().broadcast(op, x)

    @fcir.program(placements={"clients": 2})
    def echo(w):
        return fcir.reduce_sum(fcir.broadcast(w))

    assert float(Count().run(fcir.capture(echo, jnp.float32(3.0)), jnp.float32(3.0))) == 6.0
    assert seen == ["clients"]


# --- an interpreter's unsupported table: a plain string was taken for a method name -------


def test_an_unsupported_entry_that_is_not_an_unsupported_object_is_refused_at_the_class():
    with pytest.raises(fcir.FcirError, match=r"fcir\.fed\.Unsupported\('use fed\.mean'\)"):

        class NoMedian(ReferenceInterpreter):
            unsupported = {fcir.fed.Median: "use fed.mean"}

    with pytest.raises(fcir.FcirError, match="not a fed op class"):

        class NoMedianByName(ReferenceInterpreter):
            unsupported = {"fed.median": fcir.fed.Unsupported("use fed.mean")}

    class Refuses(ReferenceInterpreter):
        unsupported = {fcir.fed.Median: fcir.fed.Unsupported("use fed.mean")}

    @fcir.program(placements={"clients": 3})
    def middle(x):
        return fcir.reduce_median(x)

    module = fcir.capture(middle, jnp.arange(3.0))
    with pytest.raises(fcir.UnsupportedError, match="fed.median: use fed.mean"):
        Refuses().run(module, jnp.arange(3.0))
