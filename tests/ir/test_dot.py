"""``fcir.report.dot`` pictures and the per-round traffic they are labelled with
(``fcir.report.traffic.communication_bytes``), and ``fcir show --format dot|svg``."""

from __future__ import annotations

import functools
import re
import shutil

import jax
import jax.numpy as jnp
import pytest
from corpus import case

import fcir
from fcir import cli
from fcir.report import dot
from fcir.report.traffic import communication_bytes, total_bytes


@functools.cache
def corpus_module(name: str) -> fcir.Module:
    c = case(name)
    return fcir.capture(c.fn, *c.make_args(), name=name)


@fcir.program(placements={"clients": 4})
def small_round(w, x):
    """f32[3] to 4 clients (12 B each), f32[3] and f32[] back from each."""
    updated, loss = fcir.map_fn(lambda w, x: (w * x.mean(), x.sum()), (fcir.broadcast(w), x))
    return fcir.reduce_mean(updated), fcir.reduce_sum(loss)


def small_module() -> fcir.Module:
    return fcir.capture(small_round, jnp.ones(3), jnp.ones((4, 5)))


# --- structure of the dot text ---------------------------------------------------------------


def strip_strings(text: str) -> str:
    return re.sub(r'"(?:[^"\\]|\\.)*"', '""', text)


def clusters(text: str) -> list[str]:
    return re.findall(r"^\s*subgraph (cluster_\w+) \{", text, re.MULTILINE)


def comm_edges(text: str) -> list[tuple[str, str]]:
    """(class, label) of every communication edge."""
    return re.findall(r'-> \w+ \[class="(broadcast|aggregate)".*?label="([^"]*)"', text)


def assert_well_formed(text: str, module: fcir.Module) -> None:
    bare = strip_strings(text)
    assert bare.startswith("digraph ") and bare.rstrip().endswith("}")
    depth = 0
    for ch in bare:
        depth += {"{": 1, "}": -1}.get(ch, 0)
        assert depth >= 0, "a } closes nothing"
    assert depth == 0, "unbalanced braces"
    assert bare.count("[") == bare.count("]")
    expected = ["cluster_server", *(f"cluster_{p}" for p, _ in module.placements)]
    assert clusters(text) == expected
    ids = set(re.findall(r"^\s+(\w+) \[", bare, re.MULTILINE))
    for src, dst in re.findall(r"^\s+(\w+) -> (\w+)", bare, re.MULTILINE):
        assert src in ids and dst in ids, f"edge {src} -> {dst} names an undeclared node"


@pytest.mark.parametrize(
    "name", ["fedavg_transformer", "hierarchical_fedavg", "secure_histogram", "minmax_agg"]
)
def test_dot_is_well_formed_with_one_cluster_per_placement(name):
    module = corpus_module(name)
    text = dot.to_dot(module)
    assert_well_formed(text, module)
    assert text == dot.to_dot(module), "output must be deterministic"
    assert dot.to_dot(fcir.parse(module.to_text())) == text, "same picture after a text round trip"


def test_communication_edges_are_labelled_with_bytes_per_round():
    text = dot.to_dot(small_module())
    assert comm_edges(text) == [
        ("broadcast", "48 B/round\\n4 x 12 B"),
        ("aggregate", "48 B/round\\n4 x 12 B"),
        ("aggregate", "16 B/round\\n4 x 4 B"),
    ]
    assert "112 B communicated per round" in text


def test_transformer_round_is_a_handful_of_boxes():
    """Readability: the member computation (hundreds of ops) is one box, the 15
    parameter arrays one argument box, one broadcast box and one mean box."""
    text = dot.to_dot(corpus_module("fedavg_transformer"))
    nodes = re.findall(r"^\s+(n\d+) \[.*label=\"([^\"]*)\"", text, re.MULTILINE)
    assert len(nodes) <= 10, nodes
    labels = [label for _, label in nodes]
    assert any(label.startswith("fed.map: member computation") for label in labels)
    assert "fed.broadcast x15" in labels and "fed.mean x15" in labels
    assert [k for k, _ in comm_edges(text)] == ["broadcast", "aggregate", "aggregate"]


def test_hierarchy_draws_the_silo_body_open_and_client_body_closed():
    module = corpus_module("hierarchical_fedavg")
    text = dot.to_dot(module)
    body = {
        name: block
        for name, block in re.findall(r"subgraph (cluster_\w+) \{(.*?)\n  \}", text, re.DOTALL)
    }
    assert "fed.broadcast x4" in body["cluster_silos"] and "fed.mean x5" in body["cluster_silos"]
    assert "fed.map: member computation" in body["cluster_clients"]
    assert "fed.map" not in body["cluster_silos"]
    assert "clients (3 per silo, 6 in all)" in text
    kinds = [k for k, _ in comm_edges(text)]
    assert kinds.count("broadcast") == 2 and kinds.count("aggregate") == 3


def test_federated_ops_inside_scan_count_once_per_iteration():
    @fcir.program(placements={"clients": 3})
    def rounds(w, x):
        def body(w, _):
            u = fcir.map_fn(lambda w, x: w * x.mean(), (fcir.broadcast(w), x))
            return fcir.reduce_mean(u), None

        return jax.lax.scan(body, w, None, length=5)[0]

    module = fcir.capture(rounds, jnp.ones(4), jnp.ones((3, 2)))
    assert communication_bytes(module) == {"clients": {"broadcast": 240, "aggregate": 240}}
    text = dot.to_dot(module)
    assert_well_formed(text, module)
    # One iteration of the scan is one round (3 clients x 16 B), run 5 times a call.
    assert ("broadcast", "48 B/round\\n3 x 16 B x 5 times") in comm_edges(text)
    assert "(in scan x5)" in text
    assert "480 B communicated per call of @rounds (jax.scan x5 of rounds)" in text
    assert "communicated per round" not in text


# --- communication_bytes ---------------------------------------------------------------------


def test_communication_bytes_counts_every_member_of_nested_placements():
    module = corpus_module("hierarchical_fedavg")
    params = 4 * (8 + 1 + 4 * 8 + 8 * 1)  # f32 leaves b1, b2, w1, w2: 196 B
    # 2 silos receive the model; 3 clients in each silo receive it again.
    assert communication_bytes(module) == {
        "silos": {"broadcast": 2 * params, "aggregate": 2 * (params + 4)},
        "clients": {"broadcast": 6 * params, "aggregate": 6 * (params + 4)},
    }
    assert total_bytes(module) == 8 * params + 8 * (params + 4)


def test_communication_bytes_of_secure_sum_and_weighted_mean():
    assert communication_bytes(corpus_module("secure_histogram")) == {
        "clients": {"broadcast": 0, "aggregate": 6 * (8 * 4 + 4)}
    }

    @fcir.program(placements={"clients": 5})
    def weighted(x, w):
        return fcir.reduce_weighted_mean(x, w)

    module = fcir.capture(weighted, jnp.ones((5, 2)), jnp.ones(5))
    assert communication_bytes(module) == {"clients": {"broadcast": 0, "aggregate": 5 * (8 + 4)}}


# --- svg and the command line ----------------------------------------------------------------


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz `dot` is not installed")
def test_svg_renders_with_graphviz():
    svg = dot.to_svg(corpus_module("hierarchical_fedavg"))
    assert svg.lstrip().startswith("<?xml") and "</svg>" in svg
    for title in ("server", "silos (2)", "clients (3 per silo, 6 in all)"):
        assert title in svg


def test_svg_without_graphviz_says_what_to_install(monkeypatch):
    monkeypatch.setattr(dot.shutil, "which", lambda name: None)
    with pytest.raises(fcir.FcirError, match=r"apt-get install graphviz.*--format dot"):
        dot.to_svg(small_module())


def test_cli_show_draws_dot_and_reports_missing_graphviz(tmp_path, capsys, monkeypatch):
    path = tmp_path / "small.fcir"
    path.write_text(small_module().to_text())
    assert cli.main(["show", str(path), "--format", "dot"]) == 0
    out = capsys.readouterr().out
    assert clusters(out) == ["cluster_server", "cluster_clients"]
    monkeypatch.setattr(dot.shutil, "which", lambda name: None)
    assert cli.main(["show", str(path), "--format", "svg", "-o", str(tmp_path / "g.svg")]) == 1
    err = capsys.readouterr().err
    assert "install graphviz" in err and "Traceback" not in err


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz `dot` is not installed")
def test_cli_show_writes_svg(tmp_path, capsys):
    path = tmp_path / "small.fcir"
    path.write_text(small_module().to_text())
    out = tmp_path / "small.svg"
    assert cli.main(["show", str(path), "--format", "svg", "-o", str(out)]) == 0
    assert "</svg>" in out.read_text()


def test_show_states_privacy_per_call_for_rounds_in_a_scan(tmp_path, capsys):
    @fcir.program(placements={"clients": 4}, private=True)
    def rounds(w, x, key):
        def one(w, i):
            up = fcir.map_fn(lambda w, x: x - w, (fcir.broadcast(w), x))
            return fcir.dp_mean(up, 1.0, 1.0, jax.random.fold_in(key, i)), None

        return jax.lax.scan(one, w, jnp.arange(5))[0]

    module = fcir.capture(rounds, jnp.zeros(3), jnp.ones((4, 3)), jax.random.key(0))
    path = tmp_path / "rounds.fcir"
    path.write_text(module.to_text(full_constants=True))
    assert cli.main(["show", str(path)]) == 0
    out = capsys.readouterr().out
    assert "// privacy (per call of @rounds (jax.scan x5 of rounds), every client" in out
    assert "fcir.privacy.epsilon composes calls" in out
