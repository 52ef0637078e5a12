"""Errors a first-time user meets (issue 17, items 12-21): each says what went wrong in
the user's terms, and only FcirErrors escape."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from fcir.interpreters import production, reference, xla

import fcir
from fcir.report import dot, traffic

N = 4


@fcir.program(placements={"clients": N}, private=True)
def _private_round(w, x, key):
    deltas = fcir.map_fn(lambda w, x: x - w, (fcir.broadcast(w), x))
    return fcir.dp_mean(deltas, 1.0, 1.0, key)


@fcir.program(placements={"clients": N})
def _round(w, x):
    return fcir.reduce_mean(fcir.map_fn(lambda w, x: x - w, (fcir.broadcast(w), x)))


def _modules():
    private = fcir.capture(_private_round, jnp.zeros(3), jnp.ones((N, 3)), jax.random.key(0))
    plain = fcir.capture(_round, jnp.zeros(3), jnp.ones((N, 3)))
    return private, plain


def _in_program(body, *args):
    return lambda: fcir.capture(fcir.program(placements={"clients": N})(body), *args)


# --- item 13: bad arguments to public functions are FcirErrors naming the argument --------

_PRIVATE, _PLAIN = _modules()
_BAD_CALLS = {
    "epsilon delta=None": (lambda: fcir.privacy.epsilon(_PRIVATE, 10, None), "delta"),
    "epsilon delta='x'": (lambda: fcir.privacy.epsilon(_PRIVATE, 10, "x"), "delta"),
    "epsilon sampling_rate=None": (
        lambda: fcir.privacy.epsilon(_PRIVATE, 10, 1e-5, sampling_rate=None),
        "sampling_rate",
    ),
    "epsilon of None": (lambda: fcir.privacy.epsilon(None, 10, 1e-5), "fcir.Module"),
    "round_cost delta=None": (lambda: fcir.privacy.round_cost(_PRIVATE, None), "delta"),
    "leaks of a function": (lambda: fcir.privacy.leaks(_round), "fcir.Module"),
    "capture(None)": (lambda: fcir.capture(None), "fn must be a function"),
    "map_fn(None, x)": (
        _in_program(lambda x: fcir.map_fn(None, x), jnp.ones((N, 3))),
        "fn must be a function",
    ),
    "dp_mean key=None": (
        _in_program(lambda x: fcir.dp_mean(x, 1.0, 1.0, None), jnp.ones((N, 3))),
        "key",
    ),
    "check(None)": (lambda: fcir.check(None), "fcir.Module"),
    "xla.compile(None)": (lambda: xla.compile(None), "fcir.Module"),
    "reference.run(text)": (lambda: reference.run(_PLAIN.to_text(), 1.0), "fcir.Module"),
    "production.export(None)": (lambda: production.export(None), "fcir.Module"),
    "communication_bytes(None)": (lambda: traffic.communication_bytes(None), "fcir.Module"),
    "to_dot(None)": (lambda: dot.to_dot(None), "fcir.Module"),
}


@pytest.mark.parametrize("call", _BAD_CALLS, ids=list(_BAD_CALLS))
def test_bad_arguments_to_public_functions_are_fcir_errors_naming_them(call):
    fn, words = _BAD_CALLS[call]
    with pytest.raises(fcir.FcirError, match=words):
        fn()


# --- item 12: export errors name the user's ops, not those of the DP decomposition -------


@fcir.program(placements={"clients": N}, private=True)
def _two_dp_exchanges(w, x, key):
    k1, k2 = jax.random.split(key)
    d1 = fcir.dp_mean(fcir.map_fn(lambda w, x: x - w, (fcir.broadcast(w), x)), 1.0, 1.0, k1)
    w2 = w + d1
    d2 = fcir.dp_mean(fcir.map_fn(lambda w, x: x * w, (fcir.broadcast(w2), x)), 1.0, 1.0, k2)
    return w2 + d2


def test_export_refusal_of_two_dp_exchanges_names_the_users_ops():
    module = fcir.capture(_two_dp_exchanges, jnp.zeros(3), jnp.ones((N, 3)), jax.random.key(0))
    # The ops the message must name, as the user's IR numbers them (main's ops are the
    # lines indented once; how JAX traces the key split differs between versions).
    body = [line.strip() for line in module.to_text().splitlines() if line.startswith("  %")]

    def where(op_name, k):
        i = [j for j, line in enumerate(body) if f"= {op_name} " in line][k]
        return f"{op_name} (op {i}, defining {body[i].split(':')[0]})"

    with pytest.raises(fcir.ExportError) as info:
        production.export(module)
    message = str(info.value)
    assert where("fed.broadcast", 1) in message
    assert where("fed.dp_mean", 0) + ", at its fed.sum in production" in message


# --- item 15: declaring client data; forgetting fcir.broadcast ------------------------------


def _local(w, x):
    return w - 0.1 * x


def test_a_server_model_with_the_cohorts_leading_axis_is_refused_when_client_data_is_declared():
    @fcir.program(placements={"clients": N}, client_data=("x",))
    def forgot(w, x):
        return fcir.reduce_mean(fcir.map_fn(_local, (w, x)))

    # w is f32[4, 3]: its leading axis equals the cohort, so undeclared it would be
    # silently typed client data and the round would train the wrong thing.
    undeclared = fcir.capture(fcir.program(placements={"clients": N})(forgot.__wrapped__),
                              jnp.ones((N, 3)), jnp.ones((N, 3)))
    assert str(undeclared.main.body.params[0].type) == "{f32[3]}@clients"
    with pytest.raises(fcir.PlacementError, match=r"argument 'w' \(%0: \{f32\[3\]\}@clients\) "
                       r"is used as client data.*did you mean fcir.broadcast\(w\)\?"):
        fcir.capture(forgot, jnp.ones((N, 3)), jnp.ones((N, 3)))


def test_declared_client_data_is_checked_and_a_correct_round_captures():
    @fcir.program(placements={"clients": N}, client_data="x")
    def good(w, x):
        return fcir.reduce_mean(fcir.map_fn(_local, (fcir.broadcast(w), x)))

    module = fcir.capture(good, jnp.ones((N, 3)), jnp.ones((N, 3)))
    assert str(module.main.body.params[0].type) == "f32[4,3]@server"
    with pytest.raises(fcir.PlacementError, match="argument 'x' is declared client data"):
        fcir.capture(good, jnp.ones(3), jnp.ones((N + 1, 3)))
    with pytest.raises(fcir.PlacementError, match="has no argument 'y'"):
        fcir.program(placements={"clients": N}, client_data=("y",))(good.__wrapped__)
    with pytest.raises(fcir.PlacementError, match="client_data must name arguments"):
        fcir.program(placements={"clients": N}, client_data=[0])


def test_a_server_value_given_to_map_fn_says_did_you_mean_broadcast():
    @fcir.program(placements={"clients": N})
    def forgot(w, x):
        return fcir.reduce_mean(fcir.map_fn(_local, (w, x)))

    with pytest.raises(fcir.PlacementError, match=r"did you mean fcir.broadcast"):
        fcir.capture(forgot, jnp.ones(3), jnp.ones((N, 3)))


# --- item 16: capture errors name the user's source line -----------------------------------


def test_capture_error_names_the_source_line_without_locations():
    import inspect

    @fcir.program(placements={"clients": N})
    def leaky(x):
        means = fcir.map_fn(jnp.mean, x)
        return means[0]  # the line the error must name

    line = inspect.getsourcelines(leaky)[1] + 3  # `return means[0]`
    with pytest.raises(fcir.PlacementError) as info:
        fcir.capture(leaky, jnp.ones((N, 3)))
    assert f"(op 1, defining %6) at test_user_errors.py:{line}: local/C1" in str(info.value)
    # The module of a successful capture stays without locations (text and goldens).
    ok = fcir.capture(_round, jnp.zeros(3), jnp.ones((N, 3)))
    assert all(op.location == "" or op.location is None for op in ok.main.body.ops)


# --- item 6, beyond fcir check: readers of an unchecked module's scan length -------------


@pytest.mark.parametrize("length", ["1e309", "-3", "2.5"])
def test_a_bad_scan_length_is_an_fcir_error_in_show_dot_cost_and_export(tmp_path, capsys,
                                                                         length):
    import test_soundness

    from fcir import cli

    path = tmp_path / "bad.fcir"
    path.write_text(test_soundness.FLOW.replace("length=2", f"length={length}"))
    out = tmp_path / "out"
    assert cli.main(["show", str(path)]) == 0  # shown, with why it is not costed
    for argv in (["show", str(path), "--format", "dot"],
                 ["compile", str(path), "--emit", "cost", "-o", str(out)],
                 ["export", "--target", "production", str(path), "-o", str(out)]):
        assert cli.main(argv) == 1, argv
        err = capsys.readouterr().err
        assert "length" in err and "run with --debug" not in err, err  # an FcirError
    module = fcir.parse(path.read_text())
    for fn in (traffic.communication_bytes, fcir.privacy.releases, dot.to_dot):
        with pytest.raises(fcir.FcirError, match="length"):
            fn(module)
