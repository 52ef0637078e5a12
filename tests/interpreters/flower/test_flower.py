"""Exported rounds on a real Flower deployment: one SuperLink and 3 SuperNodes on
localhost (separate processes, free ports, own FLWR_HOME each), started once for the
module and stopped by PID.

Flower polls every 3 s and every message starts a fresh ClientApp process (jax import,
artifact compile), so a run costs 15-30 s here however small the round. The SuperLink
of flwr 1.42 does not run two apps side by side reliably (concurrent runs fail with
"task-token authentication failed"), so runs go one after another; the deployment is
shared (each node's data-path is a template, ``node<i>/{round}.npz``), and semantics
that need no network (minimum participation, bad data shapes, state mapping) are
tested in-process by test_flower_app.py. docs/flower.md's own commands (the quickstart's
`flwr run`, `fcir flower run`'s failure, the scaffold app) run as written on the page's
own `fcir flower up` in test_flower_doc_commands.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pathlib

import jax
import numpy as np
import pytest
from corpus.compare import assert_trees_match
from fcir.interpreters import reference
from flowerlib import deployment, rounds, secure
from flowerlib.rounds import NODES

import fcir

pytestmark = pytest.mark.slow  # docs/contributing.md: left out of the fast tier

pytest.importorskip("flwr", reason="the Flower tests need flwr (pip install 'fcir[flower]')")

CORPUS = ("fedavg_mlp", "fedavg_weighted", "minmax_agg", "bf16_client", "secure_histogram")


@pytest.fixture(scope="module")
def dep(tmp_path_factory):
    d = deployment.start(tmp_path_factory.mktemp("flower"))
    try:
        yield d
    finally:
        d.stop()


def _outputs(path) -> list:
    with np.load(path) as f:
        return [f[f"arr_{i}"] for i in range(len(f.files))]


def _renamed(r: rounds.Round, name: str) -> rounds.Round:
    return dataclasses.replace(r, name=name, module=dataclasses.replace(r.module, name=name))


def _stage(r: rounds.Round, root, dep) -> pathlib.Path:
    app = rounds.export(r, pathlib.Path(root) / "apps" / r.name)
    plan = rounds.plan_of(app)
    for i in range(NODES):
        np.savez(deployment.node_data(dep.root.parent, i, r.name), *r.node_leaves(plan, i))
    return app


def test_corpus_rounds_match_run_bundle_and_the_reference(dep, tmp_path):
    """Corpus rounds equal run_bundle bit for bit and the reference within 1e-5."""
    runs = {}
    for name in CORPUS:
        r = rounds.corpus_round(name)
        # secure_histogram's secure sum is summed by the ServerApp here (one exchange):
        # test_secure_sums_on_secagg_plus runs secure sums through SecAgg+.
        runs[name] = (r, _stage(r, tmp_path, dep), "secagg=false")

    results = {}
    for key, (_, app, config) in runs.items():
        out = tmp_path / f"{key}.out.npz"
        results[key] = deployment.finish(deployment.launch(dep, app, f'output="{out}" {config}'))

    for name in CORPUS:
        code, log = results[name]
        assert code == 0, log[-3000:]
        assert "3/3 clients replied" in log, log[-3000:]
        r = runs[name][0]
        got = _outputs(tmp_path / f"{name}.out.npz")
        bundle = rounds.bundle_outputs(r, tmp_path / "bundles" / name)
        assert len(got) == len(bundle)
        for g, b in zip(got, bundle):
            assert g.dtype == b.dtype and g.shape == b.shape, name
            assert g.tobytes() == b.tobytes(), f"{name}: not bit-for-bit run_bundle"
        assert_trees_match(got, rounds.reference_outputs(r), rtol=1e-5, atol=1e-5)


def test_secure_sums_on_secagg_plus(dep, tmp_path):
    """One round through SecAgg+ on the deployment: a secure sum at 32 bits on uint32
    and one at 12 bits on int32 (and a full-width int16 one) exact, i.e. bit for bit
    the reference interpreter, beside a plain mean of values scaled by a broadcast."""
    args = secure.make_args()
    module = fcir.capture(secure.secure_mix, *args)
    r = rounds.Round(module.name, module, list(args), [False] + [True] * (len(args) - 1))
    app = _stage(r, tmp_path, dep)
    out = tmp_path / "out.npz"
    code, log = deployment.finish(deployment.launch(dep, app, f'output="{out}"'))
    assert code == 0, log[-3000:]
    assert "3/3 clients replied" in log, log[-3000:]
    expected = [np.asarray(v) for v in jax.tree.leaves(reference.run(module, *args))]
    secure.assert_matches(_outputs(out), expected)


def test_training_resumes_after_the_superlink_is_killed(dep, tmp_path):
    """2 rounds of FedAvg with state mapping and checkpoints, whose third client raises
    every round (its data file is missing): each round completes with the other two.
    The SuperLink is killed (SIGKILL) after round 1 is checkpointed and restarted; the
    run started again runs only round 2, from round 1's checkpoint, and the result is
    bit for bit that of 2 uninterrupted rounds of run_bundle on the first two clients
    (so within 1e-5 of the reference interpreter on them, which the corpus test pins
    for one round). Two rounds are what a resume needs (one before the kill, one from
    its checkpoint); each more started three ClientApp processes (jax each)."""
    r = _renamed(rounds.corpus_round("fedavg_mlp"), "fedavg_train")
    app = _stage(r, tmp_path, dep)
    deployment.node_data(dep.root.parent, 2, r.name).unlink()
    n_state = len(r.server_leaves)
    state = ",".join(f"{i}={i}" for i in range(n_state))
    ckpt = tmp_path / "ckpt"
    config = (
        f'num-server-rounds=2 state="{state}" checkpoint-dir="{ckpt}" output="{tmp_path}/out.npz" '
        "min-train-nodes=2"
    )
    proc = deployment.launch(dep, app, config)
    try:
        deployment.wait_for(
            lambda: (ckpt / "1").is_dir() or proc.poll() is not None,
            timeout=240,
            what="round 1's checkpoint",
        )
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        dep.kill_one("superlink")
    finally:
        proc.kill()
        proc.communicate()
    assert not (tmp_path / "out.npz").exists()
    dep.restart()
    code, log = deployment.finish(deployment.launch(dep, app, config))
    assert code == 0, log[-3000:]
    assert "resuming after round 1" in log and "round 2/2" in log, log[-3000:]
    assert "round 1/2" not in log, log[-3000:]
    assert log.count("2/3 clients replied") == 1, log[-3000:]
    assert "data-path: no such file" in log, log[-3000:]

    outs = rounds.bundle_rounds(rounds.first_clients(r, 2), tmp_path / "b", 2)
    got = _outputs(tmp_path / "out.npz")
    assert [g.tobytes() for g in got] == [o.tobytes() for o in outs]


def _processes_with_home_under(root: pathlib.Path) -> list[int]:
    """PIDs whose FLWR_HOME lies under ``root`` (what a deployment there started)."""
    pids = []
    for proc in pathlib.Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            env = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(e.startswith(f"FLWR_HOME={root}".encode()) for e in env):
            pids.append(int(proc.name))
    return pids


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM", "SIGHUP"])
def test_flower_up_prints_how_to_run_and_stops_everything_on_ctrl_c_sigterm_and_sighup(
    tmp_path, sig
):
    """Ctrl-C, `kill PID` and a closed terminal all stop the SuperLink and SuperNodes
    (they run in sessions of their own, so no signal reaches them otherwise), exit 0."""
    import signal
    import subprocess
    import sys
    import urllib.request

    root = tmp_path / "up"
    cmd = [sys.executable, "-m", "fcir.cli", "flower", "up", "--nodes", "2", "--dir", str(root)]
    # As from a terminal, where Ctrl-C reaches the child: a SIGINT that this process
    # ignores (something run in it earlier may have left it so) would be ignored by the
    # child too, which inherits an ignored signal across exec.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    finally:
        signal.signal(signal.SIGINT, previous)
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("Ctrl-C"):
                break
        text = "".join(lines)
        assert "fcir flower run APPDIR" in text and f"FLWR_HOME={root}" in text, text
        address = text.split("SuperLink on ")[1].split(";")[0]
        with urllib.request.urlopen(f"http://{address}/health", timeout=5) as r:
            assert r.status == 200
        assert len(_processes_with_home_under(root)) >= 3  # SuperLink + 2 SuperNodes
        proc.send_signal(getattr(signal, sig))
        assert proc.wait(30) == 0, proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        # Whatever the deployment left running is stopped by PID (the SuperLink and
        # SuperNodes run in sessions of their own: killing `fcir flower up` leaves
        # them), so a failing run leaves nothing behind; leaving any is the failure.
        left = _processes_with_home_under(root)
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert left == []


def test_one_round_over_tls_with_a_generated_localhost_ca(tmp_path):
    """`fcir flower up --tls`'s deployment: the SuperLink serves HTTPS with a certificate
    of a CA made for localhost (plain HTTP is refused), the SuperNodes and flwr run
    verify it, and a round runs bit for bit as without TLS."""
    import ssl
    import urllib.request

    from fcir.interpreters.flower.local import Deployment

    r = rounds.first_clients(_renamed(rounds.corpus_round("fedavg_mlp"), "fedavg_tls"), 2)
    app = rounds.export(r, tmp_path / "app")
    plan = rounds.plan_of(app)
    data = []
    for i in range(2):
        data.append(tmp_path / f"node{i}.npz")
        np.savez(data[-1], *r.node_leaves(plan, i))
    with Deployment(tmp_path / "dep", 2, data, tls=True) as d:
        ca = d.certificates.ca
        assert 'root-certificates = "' in (d.cli_home / "config.toml").read_text()
        context = ssl.create_default_context(cafile=str(ca))
        with urllib.request.urlopen(f"https://{d.address}/health", timeout=5, context=context) as h:
            assert h.status == 200
        with pytest.raises(OSError):
            urllib.request.urlopen(f"http://{d.address}/health", timeout=5).close()
        with pytest.raises(OSError):  # an unknown CA is not trusted
            urllib.request.urlopen(f"https://{d.address}/health", timeout=5).close()
        proc = d.run(app, f'output="{tmp_path}/out.npz" min-train-nodes=2', timeout=300)
        assert proc.returncode == 0 and "2/2 clients replied" in proc.stdout, proc.stdout[-3000:]
    got = _outputs(tmp_path / "out.npz")
    assert [g.tobytes() for g in got] == [
        b.tobytes() for b in rounds.bundle_outputs(r, tmp_path / "bundle")
    ]


def test_per_client_state_survives_a_supernode_restart_mid_run(dep, tmp_path):
    """examples/scaffold.py (4 rounds in a lax.scan; each client's control is a carry
    placed at the clients) on the deployment: node 1 keeps its control on disk under
    its FLWR_HOME, keyed by the run and its partition-id. While it runs round 2 (its
    round-2 state just written) its SuperNode is stopped (SIGTERM, its ClientApp with
    it) and started again: a new process with a new node id, which takes part in a later
    round with the control it kept before the restart. Whichever rounds node 1 was
    counted in (its round-2 reply may be lost), the outputs are the plain-JAX SCAFFOLD
    loop's with those clients taking part, which for full participation is reference.run's
    (test_flower_program.py)."""
    import importlib.util
    import re

    path = pathlib.Path(__file__).resolve().parents[3] / "examples" / "scaffold.py"
    spec = importlib.util.spec_from_file_location("example_scaffold", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    args = example.make_example_args(NODES)
    module = fcir.capture(example.make_program(NODES), *args)
    from fcir.interpreters import flower

    app = flower.export(module, tmp_path / "app", inputs=[np.asarray(a) for a in args[:2]])
    for i in range(NODES):
        np.savez(
            deployment.node_data(dep.root.parent, i, module.name),
            *(np.asarray(a)[i] for a in args[2:]),
        )
    kept = dep.root / "home-supernode-1" / "fcir-state"
    out = tmp_path / "out.npz"
    # Replies may take long: each SuperNode's first round starts JAX and compiles, three at
    # once, and on a loaded 2-core machine none answered within 20 s. A node that is
    # down is reported at once, so the longer wait costs nothing when all goes well.
    proc = deployment.launch(dep, app, f'output="{out}" timeout=120')
    try:
        deployment.wait_for(
            lambda: any(kept.glob("*-run-*/partition-1/round-2.npz")) or proc.poll() is not None,
            timeout=300,
            what="node 1's state of round 2",
        )
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        (before,) = {p.parent for p in kept.glob("*-run-*/partition-1/round-2.npz")}
        dep.stop_one("supernode-1")
        dep.start_supernode(1)
        code, log = deployment.finish(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert code == 0 and "round 4/4" in log, log[-3000:]
    # Only the round node 1 was stopped in may lose it ("Node Unavailable"); none fails.
    failed = re.findall(r"round (\d): client failed", log)
    assert set(failed) <= {"2"}, log[-3000:]
    counted = [
        [int(p) for p in m.group(2).split(",")]
        for m in re.finditer(r"round (\d)/4: .* client state of partition\(s\) ([\d,]+)", log)
    ]
    assert len(counted) == 4 and counted[0] == [0, 1, 2], log[-3000:]
    assert any(1 in who for who in counted[2:]), f"node 1 never came back: {counted}"
    assert sorted(int(p.stem.split("-")[1]) for p in before.glob("round-*.npz"))[-1] == 4
    want = example.by_hand(*args, participation=counted)
    got = _outputs(out)
    assert [(g.dtype, g.shape) for g in got] == [(np.dtype("float32"), w.shape) for w in want[:3]]
    assert_trees_match(got, [np.asarray(w) for w in want[:3]], rtol=1e-5, atol=1e-6)
