"""Every fed op has a rule or an explicit ``Unsupported`` entry in every backend's own
table (never one inherited from a base class), and every op class declares its kind,
constraints and primitive: nothing is left to a table gap."""

from __future__ import annotations

import pytest
from examples_testing import tool

from fcir import fed as F
from fcir.base_interpreter import Interpreter, impl, own_rules


def backend_tables() -> dict[str, dict]:
    """Each backend's own table, as docs/ops.md shows it (tools/gen_ops_doc.py)."""
    return tool("gen_ops_doc").backend_tables()


# The tables whose entries are the behaviour itself: each must be callable (a method, a
# function), never prose describing a branch written elsewhere.
CALLABLE_TABLES = ("reference", "xla", "privacy", "traffic")


def missing_entries(table: dict) -> list[str]:
    keys = {k.name if isinstance(k, type) else k for k in table}
    return sorted(set(F.ops()) - keys)


def not_callable(table: dict) -> list[str]:
    """The ops whose entry is neither an Unsupported nor callable behaviour."""
    return sorted(
        k.name if isinstance(k, type) else k
        for k, rule in table.items()
        if not isinstance(rule, F.Unsupported) and not callable(rule)
    )


@pytest.mark.parametrize(
    "backend", ["reference", "xla", "streaming", "production", "flower", "privacy", "traffic"]
)
def test_every_fed_op_has_a_rule_or_unsupported_in_the_backends_own_table(backend):
    table = backend_tables()[backend]
    missing = missing_entries(table)
    assert not missing, f"{backend} has neither a rule nor Unsupported for {missing}"
    for key, rule in table.items():
        if isinstance(rule, F.Unsupported):
            assert rule.reason.strip(), f"{backend}: Unsupported({key}) gives no reason"


@pytest.mark.parametrize("backend", CALLABLE_TABLES)
def test_every_entry_of_a_backend_s_own_table_is_callable_behaviour(backend):
    table = backend_tables()[backend]
    assert not not_callable(table), f"{backend}'s entries for {not_callable(table)} are prose"


def test_a_prose_entry_is_caught():
    table = {**F.resolve({"reduction": lambda *a: None}), F.Sum: "sums the members"}
    assert not_callable(table) == ["fed.sum"]
    assert not_callable({F.Median: F.Unsupported("no")}) == []


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
    from fcir.report import traffic

    table = {c: r for c, r in traffic.RULES.items() if c is not F.TrimmedMean}
    assert missing_entries(table) == ["fed.trimmed_mean"]


def test_unsupported_entries_are_raised_with_their_reason(monkeypatch):
    import jax.numpy as jnp
    from fcir.interpreters import xla
    from fcir.interpreters.xla import streaming

    import fcir

    # Every reduction streams now; streaming's kind default (an Unsupported with its
    # reason) is what a reduction without an entry of its own gets: Krum's entry is
    # taken out here to run it.
    default = streaming._OWN_RULES["reduction"]
    monkeypatch.setitem(streaming.RULES, F.Krum, default)
    impls = {**streaming.StreamingInterpreter._impls, F.Krum: default}
    monkeypatch.setattr(streaming.StreamingInterpreter, "_impls", impls)

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


# What an op may add beyond its type rule, declared on FedOp / Reduction with a docstring:
# a backend asks for it by name (``cls.reference is not None``), never with hasattr.
HOOKS = {
    "reference": ("x", "attrs"),
    "server_aggregate": ("x",),  # then the op's attributes, keyword-only
    "problem": ("dtype", "n", "attrs"),
    "trim_for": ("n", "attrs"),
    "result_shape": ("shape", "attrs", "n"),
}


def documented_hooks() -> set[str]:
    """The names FedOp and Reduction declare with a docstring: a method's own, or the
    string right after a class attribute (``reference: ... = None`` then its text)."""
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(F.base))
    out = set()
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        if cls.name not in ("FedOp", "Reduction"):
            continue
        for stmt, after in zip(cls.body, [*cls.body[1:], None]):
            if isinstance(stmt, ast.FunctionDef) and ast.get_docstring(stmt):
                out.add(stmt.name)
            elif isinstance(stmt, ast.AnnAssign) and isinstance(after, ast.Expr):
                if isinstance(after.value, ast.Constant) and isinstance(after.value.value, str):
                    out.add(stmt.target.id)
    return out


def fills(cls, hook: str) -> bool:
    """Whether op class ``cls`` fills ``hook`` declared on a base it has (a two-operand
    op such as fed.weighted_mean has a ``problem`` of its own, no Reduction's)."""
    base = F.FedOp if hook in vars(F.FedOp) else F.Reduction
    return issubclass(cls, base) and any(
        hook in vars(c) for c in cls.__mro__ if c not in (F.FedOp, F.Reduction, object)
    )


def test_every_hook_an_op_fills_is_declared_on_its_base_and_takes_the_declared_arguments():
    import inspect

    assert set(HOOKS) <= documented_hooks(), set(HOOKS) - documented_hooks()
    filled = [(name, hook) for name, cls in F.ops().items() for hook in HOOKS if fills(cls, hook)]
    for name, hook in filled:
        cls = F.ops()[name]
        got = inspect.signature(getattr(cls, hook)).parameters
        positional = tuple(p for p, v in got.items() if v.kind != v.KEYWORD_ONLY)
        assert positional == HOOKS[hook], f"{name}.{hook}{tuple(got)}: declared {HOOKS[hook]}"
        if hook == "server_aggregate":
            keywords = {p for p, v in got.items() if v.kind == v.KEYWORD_ONLY}
            assert keywords == set(cls.attributes), f"{name}.server_aggregate takes {keywords}"
    # the order statistics and selectors fill them (and secure_sum its problem)
    assert {h for _, h in filled} == set(HOOKS) and len(filled) >= 15, filled


def test_no_backend_looks_for_an_op_s_hook_by_name():
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parents[2]
    hooks = "|".join(HOOKS)
    found = re.compile(rf"(hasattr|getattr)\([^)]*[\"']({hooks})[\"']")
    hits = [
        f"{path.relative_to(root)}: {m.group(0)}"
        for folder in ("fcir", "interpreters")
        for path in sorted((root / folder).rglob("*.py"))
        for m in found.finditer(path.read_text())
    ]
    assert not hits, hits


def test_each_fed_op_lives_in_its_own_module():
    modules = [cls.__module__ for cls in F.ops().values()]
    assert all(m.startswith("fcir.fed.") for m in modules)
    assert len(set(modules)) == len(modules), modules


# --- constraint codes ---------------------------------------------------------------------

_CODE = __import__("re").compile(r"(?<![\w/.])([a-z_]+(?:\.[a-z_]+)?)/C(\d+)\b")


def constraint_tables() -> list[dict[str, str]]:
    import importlib

    check, check_local, privacy = (
        importlib.import_module(f"fcir.{m}")
        for m in ("checker.check", "checker.local_ops", "privacy")
    )
    fed = {f"{cls.name}/{c}": t for cls in F.ops().values() for c, t in cls.constraints.items()}
    return [fed, check.CONSTRAINTS, check_local.CONSTRAINTS, privacy.CONSTRAINTS]


def cited_codes() -> dict[str, list[str]]:
    """Every ``ns/Cn`` written in the source of fcir and its backends -> where."""
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[2]
    found: dict[str, list[str]] = {}
    for folder in ("fcir", "interpreters", "checkpoint"):
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
    from fcir.frontend.capture import capture_unchecked

    @fcir.program(placements={"clients": 3})
    def agg(x):
        return fcir.secure_sum(x, bitwidth=4)

    with pytest.raises(fcir.IRTypeError) as traced:
        jax.make_jaxpr(agg)(jnp.ones((3, 2), jnp.float32))
    m = capture_unchecked(agg, jnp.ones((3, 2), jnp.int32))
    m.main.body.params[0].type = m.main.body.params[0].type.__class__(
        fcir.ir.types.TensorType("f32", (2,)), "clients"
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
    ("fcir.opkit.autodiff", "linear_jvp"),  # the same primitive on the tangent
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
                "kind's base module), registered with fcir.opkit.autodiff.def_jvp/def_transpose"
            )


def test_the_generic_primitive_and_autodiff_machinery_names_no_fed_op():
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parents[2] / "fcir"
    for module in ("opkit/primitives.py", "opkit/autodiff.py"):
        code = (root / module).read_text()
        for name, cls in F.ops().items():
            if cls is F.Map:  # the shared helpers run per-member work in a fed.map region
                continue
            short = cls.primitive.name.removeprefix("fed_")
            for word in (cls.primitive.name, f"{short}_p", cls.__name__):
                hit = re.search(rf"(?<![\w.]){word}\b", code)
                assert hit is None, f"fcir/{module} names {word} ({name}): move it to the op"


def test_an_op_s_primitive_is_named_by_its_module_not_by_the_generic_machinery():
    from fcir.fed.ddp_mean import ddp_mean_p
    from fcir.fed.map import map_p
    from fcir.fed.sum import sum_p
    from fcir.opkit import primitives as P

    assert sum_p is F.Sum.primitive and map_p is F.Map.primitive
    assert ddp_mean_p is F.DdpMean.primitive
    for name in ("sum_p", "no_such_op_p"):
        with pytest.raises(AttributeError):
            getattr(P, name)


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

    gathered = [
        F.ops()[name] for name, uri in splitting.INTRINSICS.items() if uri == "federated_aggregate"
    ]
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


def test_the_flower_app_names_no_fed_op_and_computes_every_intrinsic_the_split_uses():
    """The ServerApp's aggregations are keyed by intrinsic (its fixed vocabulary), never
    by op: what an op means stays in its module and the backends' tables."""
    import pathlib

    from fcir.interpreters.flower.app import runtime
    from fcir.interpreters.production import splitting

    root = pathlib.Path(__file__).resolve().parents[2] / "interpreters" / "flower" / "app"
    for path in sorted(root.glob("*.py")):
        text = path.read_text()
        for name in F.ops():
            assert f'"{name}"' not in text, f"app/{path.name} special-cases {name}"
    lowered = set(splitting.INTRINSICS.values()) - {"federated_aggregate"}
    assert lowered and lowered <= set(runtime.AGGREGATES)


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


# --- each backend's own table holds behaviour, not prose ------------------------------------


def _behaviour_tables() -> dict[str, dict]:
    """The tables whose entries a backend calls: op class -> rule."""
    from fcir.interpreters.flower import phases
    from fcir.interpreters.production import splitting
    from fcir.interpreters.xla import streaming

    return {"streaming": streaming.RULES, "production": splitting.OP_RULES, "flower": phases.RULES}


def behaviour_problems(table: dict, accumulator=None) -> list[str]:
    """The ops of ``table`` (op class -> entry) that have no entry, or one that is
    neither Unsupported nor something the backend can run: a callable, or (streaming)
    an accumulator object with init / step / combine / finish."""
    problems = [f"{name}: missing" for name in sorted(set(F.ops()) - {c.name for c in table})]
    for cls, rule in table.items():
        if isinstance(rule, F.Unsupported):
            continue
        if accumulator is not None and isinstance(rule, accumulator):
            continue
        if isinstance(rule, str) or not callable(rule):
            problems.append(f"{cls.name}: {type(rule).__name__} {rule!s:.60}")
    return problems


@pytest.mark.parametrize("backend", ["streaming", "production", "flower"])
def test_every_backend_table_entry_is_behaviour_or_unsupported(backend):
    from fcir.interpreters.xla.accumulators import Accumulator
    from fcir.interpreters.xla.streaming_order import ByPasses

    table = _behaviour_tables()[backend]
    assert behaviour_problems(table, (Accumulator, ByPasses)) == []
    if backend == "streaming":  # every reduction it runs is folded by an accumulator
        for cls in F.ops().values():
            rule = table[cls]
            if cls.kind in ("reduction", "dp", "ddp") and not isinstance(rule, F.Unsupported):
                if isinstance(rule, ByPasses):  # the order statistics: passes over chunks
                    assert callable(rule.run), cls.name
                    continue
                assert isinstance(rule, Accumulator), cls.name
                for method in ("init", "step", "combine", "finish"):
                    assert callable(getattr(rule, method)), (cls.name, method)


def test_a_prose_or_missing_table_entry_is_caught():
    from fcir.interpreters.xla import streaming
    from fcir.interpreters.xla.accumulators import Accumulator
    from fcir.interpreters.xla.streaming_order import ByPasses

    prose = dict(streaming.RULES)
    prose[F.Sum] = "accumulated: a running sum"
    del prose[F.Max]
    assert behaviour_problems(prose, (Accumulator, ByPasses)) == [
        "fed.max: missing",
        "fed.sum: str accumulated: a running sum",
    ]
    plain = {cls: object() for cls in F.ops().values()}  # neither callable nor a rule
    assert len(behaviour_problems(plain)) == len(F.ops())
