"""An interpreter subclass is checked where it is defined: an ``@fcir.impl`` name
must be an op's (a misspelt one names the closest), and an ``unsupported`` entry
must map a fed op class to ``fcir.fed.Unsupported``."""

from __future__ import annotations

import jax.numpy as jnp
import pytest
from fcir.interpreters.reference import ReferenceInterpreter

import fcir

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
