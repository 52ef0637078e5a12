"""Each fed op's public function is defined in the op's module and exported by fcir from
the registry; the base interpreter keys fed ops by class and runs each through it."""

from __future__ import annotations

import inspect

import jax.numpy as jnp
import numpy as np
import pytest

import fcir
from fcir import fed as F
from fcir.base_interpreter import Interpreter, impl, own_rules
from fcir.opkit import placement as api

# The op -> public function pairs fcir's API documents (design/api.md).
PUBLIC = {
    "broadcast": F.Broadcast,
    "map_fn": F.Map,
    "reduce_sum": F.Sum,
    "reduce_mean": F.Mean,
    "reduce_min": F.Min,
    "reduce_max": F.Max,
    "reduce_weighted_mean": F.WeightedMean,
    "secure_sum": F.SecureSum,
    "dp_sum": F.DpSum,
    "dp_mean": F.DpMean,
    "ddp_sum": F.DdpSum,
    "ddp_mean": F.DdpMean,
    "reduce_median": F.Median,
    "reduce_trimmed_mean": F.TrimmedMean,
}


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_each_public_function_is_defined_in_its_op_s_module_and_exported_from_the_registry(
    name,
):
    fn = F.FUNCTIONS[name]
    assert fn.__module__ == PUBLIC[name].__module__
    assert getattr(fcir, name) is fn
    assert fn.__doc__ and fn.__doc__.strip()
    assert not hasattr(api, name), f"fcir.api still defines {name}"


def test_the_placement_module_keeps_only_the_shared_context():
    assert set(api.__all__) == {"PRIVATE_SCOPE", "Placements", "program"}
    assert fcir.program is api.program


def test_a_function_named_as_its_op_s_module_leaves_the_module_reachable():
    import fcir.fed.dp_sum as dp_sum_module

    assert F.dp_sum is dp_sum_module and callable(F.dp_sum.dp_jvp)
    assert fcir.dp_sum is F.FUNCTIONS["dp_sum"] is dp_sum_module.dp_sum
    assert F.reduce_sum is fcir.reduce_sum


def test_signatures_are_the_documented_ones():
    sig = {n: str(inspect.signature(F.FUNCTIONS[n])) for n in PUBLIC}
    assert sig["broadcast"] == "(x, *, to: 'str | None' = None, mesh=None)"
    assert sig["map_fn"] == "(fn: 'Callable', arg, *, mesh=None)"
    assert sig["secure_sum"] == "(x, *, bitwidth: 'int')"
    # exact, gamma (central DP exact on the released bits): keyword-only
    assert sig["dp_mean"] == "(x, clip_norm, noise_multiplier, key, *, exact=False, gamma=None)"
    # min_clients (distributed DP under dropouts): keyword-only
    assert sig["ddp_sum"] == "(x, clip_norm, noise_multiplier, keys, bits=20, *, min_clients=None)"


def test_impl_keys_a_fed_op_by_its_class_whether_named_or_given():
    assert impl("fed.sum")(lambda self, op, x: x).fcir_ops == (F.Sum,)
    assert impl(F.Sum, "jax.scan")(lambda self, op, x: x).fcir_ops == (F.Sum, "jax.scan")

    class Named(Interpreter):
        @impl("fed.median")
        def median(self, op, x):
            return x

    assert set(own_rules(Named)) == {F.Median}
    assert Named._impls[F.Median] == "median"
    assert not any(isinstance(k, str) and k.startswith("fed.") for k in Interpreter._impls)


def test_the_base_interpreter_runs_every_fed_op_through_its_class_and_super_reaches_it():
    seen = []

    class Watch(Interpreter):
        @impl(F.Median)
        def median(self, op, x):
            seen.append(op.name)
            return super().median(op, x) + 1.0

    @fcir.program(placements={"clients": 5})
    def robust(x):
        return fcir.reduce_median(fcir.map_fn(lambda v: v * 2.0, x))

    x = jnp.asarray(np.random.default_rng(0).normal(size=(5, 3)), jnp.float32)
    got = Watch().run(fcir.capture(robust, x), x)
    np.testing.assert_allclose(got, np.median(2 * np.asarray(x), 0) + 1.0, rtol=1e-6)
    assert seen == ["fed.median"]
    for cls in F.ops().values():
        assert callable(getattr(Interpreter, cls.primitive.name.removeprefix("fed_")))
