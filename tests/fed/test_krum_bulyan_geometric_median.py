"""fcir.reduce_krum, reduce_multi_krum, reduce_bulyan and reduce_geometric_median: each
against a plain numpy oracle written here, on every backend, through the production
export and Flower's ServerApp aggregation, against Flower's own strategy functions on
the same updates, and their gradients."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fcir.interpreters import production, reference, xla
from jax.test_util import check_grads

import fcir

N, F = 7, 1
ROBUST_OPS = (
    fcir.fed.Krum,
    fcir.fed.MultiKrum,
    fcir.fed.BulyanSelect,
    fcir.fed.Bulyan,
    fcir.fed.GeometricMedian,
)


# --- the numpy oracles: loops over members, as the papers state them --------------------


def _bits(a) -> np.ndarray:
    """The bytes of ``a``, to compare bit for bit (a TPU's array may come back to the
    host with strides of its own layout, which a byte view refuses)."""
    return np.ascontiguousarray(a).view(np.uint8)


def _flat(tree_members: list[np.ndarray]) -> np.ndarray:
    n = tree_members[0].shape[0]
    return np.concatenate([leaf.reshape(n, -1) for leaf in tree_members], axis=1)


def _scores(v: np.ndarray, f: int) -> np.ndarray:
    n = len(v)
    q = max(1, n - f - 2)
    out = []
    for i in range(n):
        d = sorted(float(np.sum((v[i].astype(np.float64) - v[j]) ** 2)) for j in range(n) if j != i)
        out.append(sum(d[:q]))
    return np.asarray(out)


def krum_oracle(v, f):
    s = _scores(v, f)
    return v[min(range(len(v)), key=lambda i: (s[i], i))]


def multi_krum_oracle(v, f, m):
    s = _scores(v, f)
    best = sorted(range(len(v)), key=lambda i: (s[i], i))[:m]
    return v[best].astype(np.float64).mean(axis=0)


def bulyan_oracle(v, f):
    left, chosen = list(range(len(v))), []
    for _ in range(len(v) - 2 * f):
        s = _scores(v[left], f)
        k = min(range(len(left)), key=lambda i: (s[i], i))
        chosen.append(left.pop(k))
    sel = v[chosen].astype(np.float64)
    beta = len(chosen) - 2 * f
    med = np.median(sel, axis=0)
    out = np.empty(sel.shape[1])
    for c in range(sel.shape[1]):
        vals = sorted(sel[:, c], key=lambda a: (abs(a - med[c]), a))[:beta]
        out[c] = np.mean(vals)
    return out


def geomed_oracle(v, iters, eps):
    v = v.astype(np.float64)
    z = v.mean(axis=0)
    for _ in range(iters):
        w = np.array([1 / max(np.linalg.norm(x - z), eps) for x in v])
        z = (w[:, None] * v).sum(axis=0) / w.sum()
    return z


def _split(flat: np.ndarray, like: dict) -> dict:
    out, start = {}, 0
    for k in sorted(like):
        size = int(np.prod(like[k].shape[1:]))
        out[k] = flat[start : start + size].reshape(like[k].shape[1:])
        start += size
    return out


def updates(n=N, seed=0):
    rng = np.random.default_rng(seed)
    x = {"a": rng.normal(size=(n, 3, 2)), "b": rng.normal(size=(n, 4))}
    x["b"][n - 1] += 25.0  # an outlier every rule should resist
    return {k: v.astype(np.float32) for k, v in x.items()}


def oracles(x, f=F, m=3, iters=6, eps=1e-6):
    v = _flat([x[k] for k in sorted(x)])
    return {
        "krum": _split(krum_oracle(v, f), x),
        "multi_krum": _split(multi_krum_oracle(v, f, m), x),
        "bulyan": _split(bulyan_oracle(v, f), x),
        "geomed": _split(geomed_oracle(v, iters, eps), x),
    }


def robust_program(n=N, f=F, m=3, iters=6, eps=1e-6, names=None):
    """The four aggregates of the members ``x``, or those ``names`` lists."""
    aggregates = {
        "krum": lambda x: fcir.reduce_krum(x, f),
        "multi_krum": lambda x: fcir.reduce_multi_krum(x, f, m),
        "bulyan": lambda x: fcir.reduce_bulyan(x, f),
        "geomed": lambda x: fcir.reduce_geometric_median(x, iters, eps),
    }

    @fcir.program(placements={"clients": n})
    def robust(x):
        return {k: agg(x) for k, agg in aggregates.items() if names is None or k in names}

    return robust


def close(got, want, rtol=1e-5, atol=1e-5):
    jax.tree.map(
        lambda g, w: np.testing.assert_allclose(np.asarray(g), w, rtol=rtol, atol=atol), got, want
    )


# --- semantics on every backend -----------------------------------------------------------


def test_every_backend_computes_the_numpy_oracles(tmp_path):
    x = updates()
    want = oracles(x)
    f = robust_program()
    module = fcir.capture(f, x)
    plan = production.export(module)
    plan.write(tmp_path / "b")
    runs = {
        "eager": f(x),
        "jit": jax.jit(f)(x),
        "reference": reference.run(module, x),
        "xla": xla.compile(module)(x),
        "production": production.run_bundle(tmp_path / "b", x),
    }
    for name, got in runs.items():
        got = got if isinstance(got, dict) else jax.tree.unflatten(jax.tree.structure(want), got)
        close(got, want)
        # The selections pick members' values: bit for bit, not approximately.
        np.testing.assert_array_equal(np.asarray(got["krum"]["b"]), want["krum"]["b"], name)
        assert abs(float(np.max(got["geomed"]["b"]))) < 5  # the outlier is resisted


def test_export_gathers_every_value_and_says_it_is_not_secure(tmp_path):
    import json

    from fcir.interpreters.production import splitting

    for cls in ROBUST_OPS:
        assert "every client's value" in str(splitting.OP_RULES[cls])
        assert "not secure" in cls.__doc__.lower() or "Not secure" in cls.__doc__
    x = updates()
    production.export(fcir.capture(robust_program(), x)).write(tmp_path / "b")
    aggs = json.loads((tmp_path / "b" / "manifest.json").read_text())["aggregations"]
    assert sorted((a["fed_op"], a["intrinsic"]) for a in aggs) == [
        ("fed.bulyan", "federated_aggregate"),
        ("fed.geometric_median", "federated_aggregate"),
        ("fed.krum", "federated_aggregate"),
        ("fed.multi_krum", "federated_aggregate"),
    ]


# --- streamed (interpreters/xla/streaming_robust.py) ------------------------------------

STREAMED_N = 33  # k = 1, and k = 8 (ragged: the last chunk overlaps the one before)


def _streamed_program(n: int):
    @fcir.program(placements={"clients": n})
    def robust(w, x):
        upd = fcir.map_fn(
            lambda w, x: {"a": w * x["a"] + 1.0, "b": x["b"] * 2.0}, (fcir.broadcast(w), x)
        )
        return {
            "krum": fcir.reduce_krum(upd, 2),
            "multi_krum": fcir.reduce_multi_krum(upd, 2, 12),
            "bulyan": fcir.reduce_bulyan(upd, 2),
            "geomed": fcir.reduce_geometric_median(upd, 3, 1e-6),
        }

    return robust


def _streamed_values(n: int, dtype) -> dict:
    rng = np.random.default_rng(n)
    # 1,004 coordinates over many binades: XLA's own row sum adds a member's squares in
    # another order for a chunk of 3 or 8 rows than for 33 (measured), which moved the
    # streamed geometric median's last bits before row_sums.
    a = rng.normal(size=(n, 500, 2)) * np.exp(2 * rng.normal(size=(n, 500, 2)))
    b = rng.normal(size=(n, 4))
    b[3] += 50.0  # an outlier
    a[5, 0, 0] = np.nan  # never chosen; makes every coordinate of the geometric median NaN
    return {"a": a.astype(dtype), "b": b.astype(dtype)}


@pytest.mark.parametrize("dtype", [np.float32, pytest.param(jnp.bfloat16, marks=pytest.mark.slow)])
def test_streamed_robust_aggregates_equal_the_unstreamed_bit_for_bit(dtype):
    from fcir.interpreters.xla.interpreter import XlaInterpreter
    from fcir.interpreters.xla.streaming import StreamingInterpreter

    x, w = _streamed_values(STREAMED_N, dtype), np.asarray(0.7, dtype)
    module = fcir.capture(_streamed_program(STREAMED_N), w, x)
    ks = (1, 8)

    def every_budget(*a):  # one compile for the unstreamed program and every budget
        plain = XlaInterpreter().run(module, *a)
        return plain, [StreamingInterpreter(clients_per_step=k).run(module, *a) for k in ks]

    # At XLA's optimization level 0 (cheaper to compile), where a value computed twice
    # is the likeliest to come out in other bits.
    level_0 = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
    want, got = jax.jit(every_budget).lower(w, x).compile(level_0)(w, x)
    for k, outs in zip(ks, got):
        for g, e in zip(jax.tree.leaves(outs), jax.tree.leaves(want)):
            g, e = np.asarray(g), np.asarray(e)
            np.testing.assert_array_equal(_bits(g), _bits(e), f"k={k}")
    # The NaN member is never chosen; it makes the geometric median NaN.
    for name in ("krum", "multi_krum", "bulyan"):
        assert not np.isnan(np.asarray(want[name]["a"], np.float32)).any(), name
    assert np.isnan(np.asarray(want["geomed"]["a"], np.float32)).all()


@pytest.mark.slow  # compiles the round at two cohort sizes (docs/contributing.md)
def test_streamed_robust_aggregates_temp_memory_is_flat_apart_from_the_distances():
    """XLA's memory analysis of the streamed round at 64 and 256 members of 4,096 floats:
    the temporaries grow by less than four float32 n x n matrices (the distances, their
    sorted rows, Bulyan's masked copies), where the members alone would add 3 MiB."""
    from fcir.interpreters.xla import streaming

    for cls in ROBUST_OPS:
        assert callable(streaming.RULES[cls].run)
    size, temps = 4096, {}
    for n in (64, 256):

        @fcir.program(placements={"clients": n})
        def robust(w, x):
            upd = fcir.map_fn(lambda w, x: w * x + 1.0, (fcir.broadcast(w), x))
            return (
                fcir.reduce_krum(upd, 1),
                fcir.reduce_multi_krum(upd, 1, 4),
                fcir.reduce_bulyan(upd, 1),
                fcir.reduce_geometric_median(upd, 2),
            )

        spec = (jax.ShapeDtypeStruct((), jnp.float32), jax.ShapeDtypeStruct((n, size), jnp.float32))
        run = xla.compile(fcir.capture(robust, *spec), clients_per_step=8)
        args = (np.float32(1.0), np.zeros((n, size), np.float32))
        temps[n] = run.compiled(*args).memory_analysis().temp_size_in_bytes
    print("streamed temp bytes", temps)
    assert temps[256] - temps[64] < 4 * 4 * (256**2 - 64**2) < (256 - 64) * size * 4


def test_the_flower_server_aggregate_is_the_oracle():
    from fcir.interpreters.flower.app import runtime

    v = _flat([updates()[k] for k in ("a", "b")])
    cases = [
        (fcir.fed.Krum, {"f": F, "m": 1}, krum_oracle(v, F)[None]),
        (fcir.fed.Krum, {"f": F, "m": 3}, None),
        (fcir.fed.BulyanSelect, {"f": F}, None),
        (fcir.fed.GeometricMedian, {"iters": 6, "eps": 1e-6}, geomed_oracle(v, 6, 1e-6)),
    ]
    for cls, attrs, want in cases:
        fn = runtime._server_aggregate(cls.server_aggregate_source())
        got = jax.jit(lambda a, fn=fn, attrs=attrs: fn(a, **attrs))(v)
        np.testing.assert_allclose(got, cls.reference(v, attrs), rtol=1e-5, atol=1e-6)
        if want is not None:
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_an_in_process_flower_round_aggregates_them(tmp_path):
    pytest.importorskip("flwr")
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from fcir.interpreters import flower
    from flowerlib import files, inprocess, rounds

    n = rounds.NODES  # 3 nodes: f = 0 is all Krum and Bulyan allow

    @fcir.program(placements={"clients": n})
    def robust_round(w, x):
        upd = fcir.map_fn(lambda w, x: {"w": w * jnp.mean(x), "x": x[:2]}, (fcir.broadcast(w), x))
        return {
            "krum": fcir.reduce_krum(upd, 0),
            "multi": fcir.reduce_multi_krum(upd, 0, 2),
            "bulyan": fcir.reduce_bulyan(upd, 0),
            "geomed": fcir.reduce_geometric_median(upd, 4, 1e-6),
        }

    w = jnp.asarray([1.0, -2.0, 0.5], jnp.float32)
    x = jnp.asarray(np.random.default_rng(1).normal(size=(n, 5)), jnp.float32)
    module = fcir.capture(robust_round, w, x)
    app = flower.export(module, tmp_path / "app", inputs=[np.asarray(w)])
    nodes = {}
    for i in range(n):
        np.savez(tmp_path / f"n{i}.npz", np.asarray(x[i]))
        nodes[10 + i] = {"partition-id": i, "data-path": str(tmp_path / f"n{i}.npz")}
    inprocess.run(app, nodes, {"output": str(tmp_path / "o.npz")})
    got = files.read_outputs(tmp_path / "o.npz")
    want = [np.asarray(v) for v in jax.tree.leaves(reference.run(module, w, x))]
    assert len(got) == len(want)
    for g, e in zip(got, want):
        np.testing.assert_allclose(g, e, rtol=1e-6, atol=1e-6)


# --- against Flower's own strategy functions --------------------------------------------


def test_flower_strategies_agree_on_the_same_updates():
    flwr_aggregate = pytest.importorskip("flwr.server.strategy.aggregate")
    x = updates(n=9, seed=3)
    f = 1
    results = [([x["a"][i], x["b"][i]], 1) for i in range(9)]
    prog = robust_program(n=9, f=f, m=4)
    got = prog(x)
    krum = flwr_aggregate.aggregate_krum(results, num_malicious=f, to_keep=0)
    np.testing.assert_array_equal(got["krum"]["a"], krum[0])
    np.testing.assert_array_equal(got["krum"]["b"], krum[1])
    multi = flwr_aggregate.aggregate_krum(results, num_malicious=f, to_keep=4)
    np.testing.assert_allclose(got["multi_krum"]["a"], multi[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got["multi_krum"]["b"], multi[1], rtol=1e-5, atol=1e-6)
    bulyan = flwr_aggregate.aggregate_bulyan(
        list(results), f, flwr_aggregate.aggregate_krum, to_keep=0
    )
    np.testing.assert_allclose(got["bulyan"]["a"], bulyan[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got["bulyan"]["b"], bulyan[1], rtol=1e-5, atol=1e-6)


def test_flower_1_42_multikrum_selection_agrees():
    mk = pytest.importorskip("flwr.serverapp.strategy.multikrum")
    from flwr.app import Array, ArrayRecord, RecordDict

    x = updates(n=8, seed=5)
    contents = [
        RecordDict({"arrays": ArrayRecord({"a": Array(x["a"][i]), "b": Array(x["b"][i])})})
        for i in range(8)
    ]
    chosen = mk.select_multikrum(contents, 1, 3)
    want = np.mean([np.asarray(c["arrays"]["b"].numpy()) for c in chosen], axis=0)
    got = robust_program(n=8, f=1, m=3)(x)["multi_krum"]["b"]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


# --- gradients ----------------------------------------------------------------------------


def _one(name, n=N, **kw):
    # Only the aggregate differentiated: run op by op, the others cost as much again.
    prog = robust_program(n=n, names=(name,), **kw)
    return lambda a: prog({"a": a, "b": jnp.zeros((n, 4), a.dtype) + a[:, :1, 0]})[name]["a"]


@pytest.mark.slow  # 17 s for the four: finite differences (docs/contributing.md)
@pytest.mark.parametrize("name", ["krum", "multi_krum", "bulyan", "geomed"])
def test_gradients_match_finite_differences(name):
    a = jnp.asarray(np.random.default_rng(7).normal(size=(N, 3, 2)), jnp.float32)
    check_grads(_one(name), (a,), order=1, modes=["fwd", "rev"], atol=2e-2, rtol=2e-2, eps=1e-3)


def test_gradients_match_the_numpy_oracle_by_central_differences():
    x = updates(seed=11)
    v = _flat([x[k] for k in sorted(x)]).astype(np.float64)
    prog = robust_program()
    g = jax.grad(lambda x: sum(jnp.sum(jnp.sin(leaf)) for leaf in jax.tree.leaves(prog(x))))(x)
    gv = _flat([np.asarray(g[k]) for k in sorted(g)])

    def total(v):
        xs = {k: _split_members(v, x)[k] for k in x}
        return sum(
            np.sum(np.sin(np.concatenate([o[k].ravel() for k in sorted(o)])))
            for o in oracles(xs).values()
        )

    rng = np.random.default_rng(0)
    for _ in range(6):
        i, j = rng.integers(v.shape[0]), rng.integers(v.shape[1])
        h = 1e-4
        up, down = v.copy(), v.copy()
        up[i, j] += h
        down[i, j] -= h
        fd = (total(up) - total(down)) / (2 * h)
        np.testing.assert_allclose(gv[i, j], fd, rtol=2e-3, atol=2e-3)


def _split_members(v, like):
    out, start = {}, 0
    for k in sorted(like):
        size = int(np.prod(like[k].shape[1:]))
        out[k] = v[:, start : start + size].reshape(like[k].shape)
        start += size
    return out


def test_the_gradient_program_is_federated_and_runs_on_every_backend():
    x = updates(seed=2)
    prog = robust_program()
    grad = jax.grad(lambda x: sum(jnp.sum(jnp.sin(leaf)) for leaf in jax.tree.leaves(prog(x))))
    module = fcir.capture(grad, x)  # checks: no client-to-client op in the derivative
    want = jax.jit(grad)(x)  # compiled: op by op, the four gradients took 6.7 CPU s
    close(reference.run(module, x), want, rtol=1e-4, atol=1e-5)
    close(xla.compile(module)(x), want, rtol=1e-4, atol=1e-5)


def test_krum_gradient_reaches_only_the_chosen_member():
    x = updates(seed=4)
    prog = robust_program()
    g = jax.grad(lambda x: jnp.sum(prog(x)["krum"]["b"]))(x)
    v = _flat([x[k] for k in sorted(x)])
    chosen = int(np.flatnonzero((v == krum_oracle(v, F)).all(axis=1))[0])
    want = np.zeros_like(x["b"])
    want[chosen] = 1.0
    np.testing.assert_array_equal(np.asarray(g["b"]), want)
    np.testing.assert_array_equal(np.asarray(g["a"]), np.zeros_like(x["a"]))


def test_duplicate_members_share_the_chosen_members_gradient():
    x = updates(seed=4)
    v = _flat([x[k] for k in sorted(x)])
    chosen = int(np.flatnonzero((v == krum_oracle(v, F)).all(axis=1))[0])
    other = (chosen + 1) % N
    for k in x:
        x[k][other] = x[k][chosen]
    g = jax.grad(lambda x: jnp.sum(robust_program()(x)["krum"]["b"]))(x)
    assert np.asarray(g["b"])[[chosen, other]].tolist() == [[0.5] * 4, [0.5] * 4]


def test_vmap_over_a_batch_of_rounds():
    xs = [updates(seed=s) for s in (20, 21)]
    batch = jax.tree.map(lambda *a: jnp.stack(a), *xs)
    got = jax.vmap(robust_program())(batch)
    for b, x in enumerate(xs):
        close(jax.tree.map(lambda g, b=b: g[b], got), oracles(x))


# --- constraints, tracing and checking ----------------------------------------------------


def test_tracing_cites_the_numbered_constraints():
    x = jnp.ones((4, 3))

    def run(body, x=x):
        return jax.make_jaxpr(fcir.program(placements={"clients": 4})(body))(x)

    with pytest.raises(
        fcir.IRTypeError, match=r"fed\.krum/C5: attribute 'f' must be an int >= 0 with n >= f \+ 3"
    ):
        run(lambda x: fcir.reduce_krum(x, 2))
    with pytest.raises(fcir.IRTypeError, match=r"fed\.multi_krum/C6: attribute 'm'"):
        run(lambda x: fcir.reduce_multi_krum(x, 0, 5))
    with pytest.raises(fcir.IRTypeError, match=r"fed\.bulyan/C5: .* n >= 4f \+ 3"):
        run(lambda x: fcir.reduce_bulyan(x, 1))
    with pytest.raises(fcir.IRTypeError, match=r"fed\.geometric_median/C6: attribute 'eps'"):
        run(lambda x: fcir.reduce_geometric_median(x, 3, 0.0))
    with pytest.raises(fcir.IRTypeError, match=r"fed\.krum/C4: operand must be a floating"):
        run(lambda x: fcir.reduce_krum(x, 0), jnp.ones((4, 3), jnp.int32))
    with pytest.raises(fcir.PlacementError, match="f must be an int"):
        run(lambda x: fcir.reduce_krum(x, 1.0))


def test_text_round_trip_and_privacy_and_traffic():
    from fcir.report import traffic

    x = updates()
    module = fcir.capture(robust_program(), x)
    text = module.to_text()
    assert "fed.krum %" in text and "fed.multi_krum %" in text and "{f=1, m=3}" in text
    assert "fed.bulyan %" in text
    assert fcir.parse(text).to_text() == text
    per_member = (3 * 2 + 4) * 4
    assert traffic.communication_bytes(module)["clients"]["aggregate"] == 4 * N * per_member

    @fcir.program(placements={"clients": N}, private=True)
    def leaky(x):
        return fcir.reduce_krum(x, 1)

    with pytest.raises(fcir.PrivacyError, match="privacy/C1: fed.krum releases"):
        fcir.capture(leaky, x)


def test_a_nan_member_is_never_chosen():
    x = updates()
    x["a"][2, 0, 0] = np.nan
    got = robust_program()(x)
    assert not np.isnan(np.asarray(got["krum"]["a"])).any()
    assert not np.isnan(np.asarray(got["bulyan"]["a"])).any()
    assert np.isnan(np.asarray(got["geomed"]["a"])).all()  # its norm is NaN: every weight


# --- order statistics streamed (interpreters/xla/streaming_order.py) ----------------------


def _order_program(n: int, trim: int):
    @fcir.program(placements={"clients": n})
    def robust(w, x):
        upd = fcir.map_fn(lambda w, x: w * x + 1.0, (fcir.broadcast(w), x))
        return fcir.reduce_median(upd), fcir.reduce_trimmed_mean(upd, trim=trim)

    return robust


def _hard_values(n: int, dtype=np.float32) -> np.ndarray:
    rng = np.random.default_rng(n)
    # Magnitudes over many binades, where the order of float adds shows in the bits.
    x = rng.normal(size=(n, 4, 3)) * np.exp(3 * rng.normal(size=(n, 4, 3)))
    x[:, 0, 0] = 1.5  # every member ties
    x[:, 0, 1] = rng.integers(0, 2, n)  # two values, many ties
    x[n - 1, 0, 2] = np.nan  # one NaN member: NaN out
    x[:, 1, 0] = -0.0  # signed zeros rank equal
    x[0, 1, 0] = 0.0
    x[: min(2, n), 1, 1] = np.inf
    return x.astype(dtype)


def _median_program(n: int):
    @fcir.program(placements={"clients": n})
    def robust(w, x):
        upd = fcir.map_fn(lambda w, x: w * x + 1.0, (fcir.broadcast(w), x))
        return (fcir.reduce_median(upd),)

    return robust


@pytest.mark.parametrize("n", [1, 2, 5, 6, 9, 10])
# The bfloat16 half of the sweep is slow; float32 at every n stays in the fast tier
# (docs/contributing.md).
@pytest.mark.parametrize("dtype", [np.float32, pytest.param(jnp.bfloat16, marks=pytest.mark.slow)])
def test_streamed_median_equals_the_unstreamed_bit_for_bit(n, dtype):
    x = _hard_values(n, dtype)
    w = np.asarray(0.7, dtype)
    module = fcir.capture(_median_program(n), w, x)
    want = [np.asarray(v) for v in xla.compile(module)(w, x)]
    for k in sorted({1, 2, 3, n}):
        got = xla.compile(module, clients_per_step=k)(w, x)
        for g, e in zip(got, want):
            g = np.asarray(g)
            assert g.dtype == e.dtype
            np.testing.assert_array_equal(_bits(g), _bits(e), f"k={k}")
    med = np.where(np.isnan(x).any(axis=0), np.nan, np.median(0.7 * x.astype(np.float32) + 1, 0))
    np.testing.assert_allclose(want[0].astype(np.float32), med, rtol=5e-2 if n > 2 else 1e-2)


@pytest.mark.parametrize("n, trim", [(5, 1), (6, 2), (6, 1), (9, 0), (10, 3), (33, 4)])
# The bfloat16 half of the sweep is slow; float32 at every n stays in the fast tier
# (docs/contributing.md).
@pytest.mark.parametrize("dtype", [np.float32, pytest.param(jnp.bfloat16, marks=pytest.mark.slow)])
def test_order_statistic_passes_give_the_unstreamed_trimmed_mean_bits(n, trim, dtype):
    from fcir.interpreters.xla.streaming_order import OrderStatistic

    from fcir.fed.trimmed_mean import l_estimate

    x = _hard_values(n, dtype)
    want = np.asarray(jax.jit(lambda x: l_estimate(x, n=n, trim=trim))(x))
    for k in sorted({1, 3, n}):
        stat = OrderStatistic(n, trim, x.shape[1:], np.dtype(dtype))
        got = np.asarray(jax.jit(lambda x, k=k, stat=stat: stat.run(_over_chunks(x, k)))(x))
        np.testing.assert_array_equal(_bits(got), _bits(want), f"k={k}")


def _over_chunks(x, k: int):
    """One pass over the members of ``x`` ``k`` at a time, as a stream makes it."""
    from fcir.interpreters.xla.streaming import Chunks

    return Chunks(x.shape[0], k, lambda start: jax.lax.dynamic_slice_in_dim(x, start, k, 0)).fold


@pytest.mark.parametrize("n, trim", [(5, 1), (6, 2), (9, 4), (10, 3)])
def test_band_edges_passes_give_the_unstreamed_record_bits(n, trim):
    """fed.band_edges (the order statistics' derivative's record) by passes equals its
    unstreamed sort's, ties, signed zeros and infinities included, and a coordinate with
    a NaN member records only that."""
    from fcir.interpreters.xla.streaming_order import OrderStatistic

    x = _hard_values(n)
    want = np.asarray(jax.jit(lambda x: fcir.fed.BandEdges.server_aggregate(x, trim=trim))(x))
    np.testing.assert_array_equal(want, fcir.fed.BandEdges.reference(x, {"trim": trim}))
    assert (want[:8, 0, 2] == 0).all() and want[8, 0, 2] == 1  # the NaN member
    for k in sorted({1, 3, n}):
        stat = OrderStatistic(n, trim, x.shape[1:], np.dtype(np.float32))
        got = np.asarray(jax.jit(lambda x, k=k, stat=stat: stat.edges(_over_chunks(x, k)))(x))
        np.testing.assert_array_equal(_bits(got), _bits(want), f"k={k}")


def _trimmed_program(n: int, trim: int):
    @fcir.program(placements={"clients": n})
    def robust(w, x):
        upd = fcir.map_fn(lambda w, x: w * x + 1.0, (fcir.broadcast(w), x))
        return (fcir.reduce_trimmed_mean(upd, trim=trim),)

    return robust


@pytest.mark.parametrize(
    "n, trim, dtype",
    [(6, 1, np.float32), (9, 2, np.float32), (9, 2, jnp.bfloat16), (6, 2, jnp.bfloat16)],
)
def test_streamed_trimmed_mean_equals_the_unstreamed_bit_for_bit(n, trim, dtype):
    x = _hard_values(n, dtype)  # ties, a NaN, signed zeros, infinities
    w = np.asarray(0.7, dtype)
    module = fcir.capture(_trimmed_program(n, trim), w, x)
    want = np.asarray(xla.compile(module)(w, x)[0])
    for k in sorted({1, 2, 4, n}):
        got = np.asarray(xla.compile(module, clients_per_step=k)(w, x)[0])
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(_bits(got), _bits(want), f"k={k}")
    kept = np.sort(0.7 * x.astype(np.float32) + 1, axis=0)[trim : n - trim].mean(0)
    kept = np.where(np.isnan(x).any(axis=0), np.nan, kept)
    np.testing.assert_allclose(want.astype(np.float32), kept, rtol=5e-2)


def test_streamed_trimmed_mean_is_exact_at_xla_optimization_level_0():
    """Members that take a gradient step (a dot, a mean), compiled at XLA backend
    optimization level 0: a separate count of the members below the lower threshold
    counted one equal to it, and the band walk dropped the largest kept value (-0.1064
    for -0.0388, on both JAX versions)."""
    from fcir.interpreters.xla.interpreter import XlaInterpreter
    from fcir.interpreters.xla.streaming import StreamingInterpreter

    n = 7

    @fcir.program(placements={"clients": n})
    def robust(w, x, y):
        def step(w, x, y):
            return w - 0.1 * jax.grad(lambda w: jnp.mean(jnp.square(x @ w - y)))(w)

        return fcir.reduce_trimmed_mean(fcir.map_fn(step, (fcir.broadcast(w), x, y)), trim=1)

    rng = np.random.default_rng(21)
    args = [rng.normal(size=s).astype(np.float32) for s in [(4,), (n, 6, 4), (n, 6)]]
    args[2][3] *= 1000.0
    module = fcir.capture(robust, *args)

    def every_budget(*a):
        plain = XlaInterpreter().run(module, *a)
        return plain, [StreamingInterpreter(clients_per_step=k).run(module, *a) for k in (1, 3)]

    level_0 = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
    want, got = jax.jit(every_budget).lower(*args).compile(level_0)(*args)
    for k, g in zip((1, 3), got):
        np.testing.assert_array_equal(
            np.asarray(g).view(np.uint32), np.asarray(want).view(np.uint32), f"k={k}"
        )


def test_a_streamed_order_statistic_refuses_a_derivative():
    n = 5
    x = _hard_values(n)[:, 2:]  # no NaN
    module = fcir.capture(_median_program(n), np.float32(0.7), x)
    run = xla.compile(module, clients_per_step=2)
    with pytest.raises(fcir.FcirError, match="no derivative here"):
        jax.grad(lambda w: run(w, x)[0].sum())(np.float32(0.7))


@pytest.mark.parametrize("op", ["median", "trimmed_mean"])
def test_streamed_order_statistic_temp_memory_is_flat_in_the_cohort(op):
    from fcir.interpreters.xla import streaming

    assert callable(streaming.RULES[fcir.fed.Median].run)
    assert callable(streaming.RULES[fcir.fed.TrimmedMean].run)
    temps = {}
    for n in (64, 512):
        x = jax.ShapeDtypeStruct((n, 256), jnp.float32)
        program = _median_program(n) if op == "median" else _trimmed_program(n, n // 10)
        module = fcir.capture(program, jax.ShapeDtypeStruct((), jnp.float32), x)
        run = xla.compile(module, clients_per_step=8)
        args = (np.float32(1.0), np.zeros((n, 256), np.float32))
        temps[n] = run.compiled(*args).memory_analysis().temp_size_in_bytes
        whole = xla.compile(module).compiled(*args).memory_analysis().temp_size_in_bytes
        assert whole >= n * 256 * 4  # unstreamed: the sorted cohort
    print("streamed temp bytes", temps)
    assert temps[512] <= 1.1 * temps[64] + 4096
