"""Every fed op has a rule or an explicit ``Unsupported`` entry in every backend's own
table (never one inherited from a base class), and every op class declares its kind,
constraints and primitive: nothing is left to a table gap."""

from __future__ import annotations

import pytest

from fcir import fed as F
from fcir.interpreter import Interpreter, impl, own_rules


def backend_tables() -> dict[str, dict]:
    """Each backend's own table: op name -> rule or Unsupported."""
    from fcir.interpreters import reference, xla
    from fcir.interpreters.flower import phases
    from fcir.interpreters.production import splitting
    from fcir.interpreters.xla import streaming

    from fcir import privacy, traffic

    def by_name(table):
        return {cls.name: rule for cls, rule in table.items()}

    return {
        "reference": own_rules(reference.ReferenceInterpreter),
        "xla": own_rules(xla.XlaInterpreter),
        "streaming": by_name(streaming.RULES),
        "production": by_name(splitting.OP_RULES),
        "flower": by_name(phases.RULES),
        "privacy": by_name(privacy.RULES),
        "traffic": by_name(traffic.RULES),
    }


def missing_entries(table: dict) -> list[str]:
    return sorted(set(F.ops()) - set(table))


@pytest.mark.parametrize(
    "backend", ["reference", "xla", "streaming", "production", "flower", "privacy", "traffic"]
)
def test_every_fed_op_has_a_rule_or_unsupported_in_the_backends_own_table(backend):
    table = backend_tables()[backend]
    missing = missing_entries(table)
    assert not missing, f"{backend} has neither a rule nor Unsupported for {missing}"
    for name, rule in table.items():
        if isinstance(rule, F.Unsupported):
            assert rule.reason.strip(), f"{backend}: Unsupported({name}) gives no reason"


def test_a_backend_that_inherits_its_rules_is_caught():
    class Inheriting(Interpreter):  # every rule comes from the base class
        pass

    class Partial(Interpreter):
        @impl(F.Sum)
        def sum(self, op, x):
            return x

        unsupported = {F.Mean: F.Unsupported("no means here")}

    assert missing_entries(own_rules(Inheriting)) == sorted(F.ops())
    missing = missing_entries(own_rules(Partial))
    assert "fed.sum" not in missing and "fed.mean" not in missing
    assert "fed.median" in missing and "fed.broadcast" in missing


def test_a_table_missing_an_op_is_caught():
    from fcir import traffic

    table = {c.name: r for c, r in traffic.RULES.items() if c is not F.TrimmedMean}
    assert missing_entries(table) == ["fed.trimmed_mean"]


def test_unsupported_entries_are_raised_with_their_reason():
    import jax.numpy as jnp
    from fcir.interpreters import xla

    import fcir

    # (The order statistics stream since streaming_order.py; Krum keeps the kind's
    # default entry, an Unsupported with its reason.)
    @fcir.program(placements={"clients": 4})
    def krum(x):
        return fcir.reduce_krum(fcir.map_fn(lambda v: v * 2.0, x), 1)

    m = fcir.capture(krum, jnp.ones((4, 3)))
    with pytest.raises(fcir.UnsupportedError, match="no accumulator for this reduction"):
        xla.compile(m, clients_per_step=2)(jnp.ones((4, 3)))


def test_impl_rejects_what_is_not_an_op():
    with pytest.raises(TypeError):
        impl(42)
    with pytest.raises(TypeError):
        impl(F.Reduction)  # an abstract base, no op
    with pytest.raises(TypeError):
        impl()


def test_every_fed_op_is_a_primitive_with_kind_and_constraints():
    prims = [cls.primitive for cls in F.ops().values()]
    assert all(p is not None for p in prims) and len(set(prims)) == len(prims)
    for name, cls in F.ops().items():
        assert cls.kind in F.KINDS, name
        assert cls.constraints and all(k.startswith("C") for k in cls.constraints), name
        assert cls.__doc__, f"{name} has no docstring"
        assert F.by_primitive()[cls.primitive.name] is cls


def test_each_fed_op_lives_in_its_own_module():
    modules = [cls.__module__ for cls in F.ops().values()]
    assert all(m.startswith("fcir.fed.") for m in modules)
    assert len(set(modules)) == len(modules), modules


# --- constraint codes ---------------------------------------------------------------------

_CODE = __import__("re").compile(r"(?<![\w/.])([a-z_]+(?:\.[a-z_]+)?)/C(\d+)\b")


def constraint_tables() -> list[dict[str, str]]:
    import importlib

    check, check_local, privacy = (
        importlib.import_module(f"fcir.{m}") for m in ("check", "check_local", "privacy")
    )
    fed = {f"{cls.name}/{c}": t for cls in F.ops().values() for c, t in cls.constraints.items()}
    return [fed, check.CONSTRAINTS, check_local.CONSTRAINTS, privacy.CONSTRAINTS]


def cited_codes() -> dict[str, list[str]]:
    """Every ``ns/Cn`` written in the source of fcir and its backends -> where."""
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[1]
    found: dict[str, list[str]] = {}
    for folder in ("fcir", "interpreters"):
        for path in sorted((root / folder).rglob("*.py")):
            for i, line in enumerate(path.read_text().splitlines(), 1):
                for m in _CODE.finditer(line):
                    found.setdefault(f"{m[1]}/C{m[2]}", []).append(f"{path.name}:{i}")
    return found


def test_every_constraint_code_in_the_source_resolves_to_exactly_one_table_entry():
    tables = constraint_tables()
    codes = cited_codes()
    assert "fed.secure_sum/C4" in codes or codes, "the scan found nothing"
    for code, where in codes.items():
        hits = sum(code in t for t in tables)
        assert hits == 1, f"{code} (cited at {where[:3]}) is in {hits} constraint tables"


def test_a_code_that_no_table_defines_is_caught():
    tables = constraint_tables()
    assert sum("fed.secure_sum/C9" in t for t in tables) == 0
    assert sum("local/C4" in t for t in tables) == 1


def test_tracing_and_checking_cite_one_constraint_with_one_text():
    import jax
    import jax.numpy as jnp

    import fcir
    from fcir.capture import capture_unchecked

    @fcir.program(placements={"clients": 3})
    def agg(x):
        return fcir.secure_sum(x, bitwidth=4)

    with pytest.raises(fcir.IRTypeError) as traced:
        jax.make_jaxpr(agg)(jnp.ones((3, 2), jnp.float32))
    m = capture_unchecked(agg, jnp.ones((3, 2), jnp.int32))
    m.main.body.params[0].type = m.main.body.params[0].type.__class__(
        fcir.types.TensorType("f32", (2,)), "clients"
    )
    (diag,) = fcir.verify(m)
    assert diag.code == "fed.secure_sum/C4"
    text = F.SecureSum.constraints["C4"]
    assert f"fed.secure_sum/C4: {text}" in str(traced.value)
    assert f"fed.secure_sum/C4: {text}" in diag.message


def test_an_interpreter_subclass_runs_every_fed_op_through_the_base_class():
    import jax.numpy as jnp
    import numpy as np

    import fcir

    class Plain(Interpreter):
        pass

    @fcir.program(placements={"clients": 5})
    def robust(x):
        return fcir.reduce_median(x), fcir.reduce_trimmed_mean(x, trim=2), fcir.reduce_sum(x)

    x = jnp.asarray(np.random.default_rng(0).normal(size=(5, 3)), jnp.float32)
    got = Plain().run(fcir.capture(robust, x), x)
    np.testing.assert_allclose(got[0], np.median(np.asarray(x), 0), rtol=1e-6)
    np.testing.assert_allclose(got[1], np.median(np.asarray(x), 0), rtol=1e-6)
    np.testing.assert_allclose(got[2], np.sum(np.asarray(x), 0), rtol=1e-6)


# --- each op's JAX rules are in its own module -------------------------------------------

_GENERIC_RULES = {
    ("fcir.autodiff", "linear_jvp"),  # the same primitive on the tangent
    ("jax._src.interpreters.ad", "zero_jvp"),  # AD.def_jvp_zero: never differentiable
}


def _rule_home(rule) -> tuple[str, str]:
    fn = getattr(rule, "func", rule)  # functools.partial(shared_rule, prim)
    return fn.__module__, fn.__qualname__.split(".")[0]


def test_every_fed_op_s_derivative_rules_are_defined_in_a_fed_op_module():
    from fcir.jaxcompat import ad

    for name, cls in F.ops().items():
        jvp = ad.primitive_jvps.get(cls.primitive)
        assert jvp is not None, f"{name} has no JVP rule"
        for what, rule in (("jvp", jvp), ("transpose", ad.primitive_transposes.get(cls.primitive))):
            if rule is None:
                continue
            home = _rule_home(rule)
            assert home[0].startswith("fcir.fed.") or home in _GENERIC_RULES, (
                f"{name}'s {what} rule is {home}: it belongs in the op's module (or its "
                "kind's base module), registered with fcir.autodiff.def_jvp/def_transpose"
            )


def test_the_generic_primitive_and_autodiff_machinery_names_no_fed_op():
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parents[1] / "fcir"
    for module in ("primitives.py", "autodiff.py"):
        code = (root / module).read_text()
        for name, cls in F.ops().items():
            if cls is F.Map:  # the shared helpers run per-member work in a fed.map region
                continue
            short = cls.primitive.name.removeprefix("fed_")
            for word in (cls.primitive.name, f"{short}_p", cls.__name__):
                hit = re.search(rf"(?<![\w.]){word}\b", code)
                assert hit is None, f"fcir/{module} names {word} ({name}): move it to the op"


def test_legacy_primitive_names_resolve_through_the_registry():
    from fcir import primitives as P

    assert P.sum_p is F.Sum.primitive and P.map_p is F.Map.primitive
    assert P.ddp_mean_p is F.DdpMean.primitive
    with pytest.raises(AttributeError):
        P.no_such_op_p  # noqa: B018


# --- what a Flower ServerApp runs for a reduction with no intrinsic ------------------------


def test_every_gathered_reduction_has_a_self_contained_server_aggregate_equal_to_its_primitive():
    """A reduction splitting lowers to federated_aggregate (every client's value to the
    server) reaches the Flower app only as its op's server_aggregate source, run with
    nothing but numpy in scope (the app cannot import fcir): it must exist, stand alone
    and give the primitive's bits over the replies."""
    import jax.numpy as jnp
    import numpy as np
    from fcir.interpreters.flower.app import runtime
    from fcir.interpreters.production import splitting

    gathered = [c for c, uri in F.resolve(splitting._INTRINSIC_OF).items()
                if uri == "federated_aggregate"]
    assert {c.name for c in gathered} >= {"fed.median", "fed.trimmed_mean"}
    for cls in gathered:
        source = cls.server_aggregate_source()
        assert source is not None, f"{cls.name} has no server_aggregate for the Flower app"
        assert "fcir." not in source, f"{cls.name}'s server_aggregate uses fcir"
        fn = runtime._server_aggregate(source)
        attrs = {k: 1 for k in cls.attributes}  # trim=1
        for n in (5, 6):
            x = jnp.asarray(np.random.default_rng(n).normal(size=(n, 3)), jnp.float32)
            want = cls.primitive.bind(x, placement="clients", n=n, **attrs)
            np.testing.assert_array_equal(np.asarray(fn(x, **attrs)), np.asarray(want))


def test_the_flower_app_runtime_names_no_op_without_an_intrinsic():
    import pathlib

    from fcir.interpreters.production import splitting

    root = pathlib.Path(__file__).resolve().parents[1] / "interpreters" / "flower" / "app"
    text = (root / "runtime.py").read_text()
    for name, uri in splitting.INTRINSICS.items():
        if uri == "federated_aggregate":
            assert f'"{name}"' not in text, f"app/runtime.py special-cases {name}"


def test_a_kind_default_covers_only_the_ops_of_that_kind_and_only_where_declared():
    ops = F.resolve({F.Sum: "accumulated", "reduction": F.Unsupported("no accumulator")})
    assert ops[F.Sum] == "accumulated"
    assert ops[F.Median] == F.Unsupported("no accumulator")
    assert F.Broadcast not in ops and F.DpSum not in ops
    # Without the default a reduction the table does not name is missing (the test fails).
    assert missing_entries({c.name: r for c, r in F.resolve({F.Sum: "x"}).items()}) == sorted(
        set(F.ops()) - {"fed.sum"}
    )
    with pytest.raises(ValueError, match="neither an op class nor a kind"):
        F.resolve({"reductions": "typo"})
