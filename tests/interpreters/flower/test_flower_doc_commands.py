"""Every command of docs/flower.md's code blocks, run as written.

Each ```bash line (continuations joined, comments dropped) and each ``$ `` line of a
```text block is a command. The tests below declare the doc commands they run
(``SCRIPTS``), in a fresh folder where ``examples`` links to the checkout's (the page's
commands run "in the fcir checkout"); test_every_command_of_the_page_is_checked fails
when the page has a command no script holds, or a script a command the page lost.
Process start-ups are what cost (20-40 s each here), so one deployment (the page's own
``fcir flower up``) serves every command that needs one, and one staged folder every
simulation. Commands for another machine (a SuperNode on a device, pip on a device) are
marked so on the page; what of them can be checked here is.
"""

from __future__ import annotations

import os
import pathlib
import re
import shlex
import shutil
import signal
import subprocess

import numpy as np
import pytest
from flowerlib import rounds

ROOT = pathlib.Path(__file__).resolve().parents[3]
DOC = ROOT / "docs" / "flower.md"

DATA = "fcir flower data examples/fedavg.py:fedavg_round -o parts/"
EXPORT = "fcir export --target flower examples/fedavg.py:fedavg_round -o app/ --inputs parts/server_inputs.npz"
UP = "fcir flower up --nodes 3 --data parts/ --dir dep/ &"
QUICK_RUN = "FLWR_HOME=dep/home-cli flwr run app/ local --stream --run-config 'num-server-rounds=3 state=\"0=0\"'"
FAILING_RUN = "FLWR_HOME=dep/home-cli fcir flower run app/ --run-config 'state=\"0=9\"'"
SCAFFOLD_DATA = "fcir flower data examples/scaffold.py:scaffold -o parts/"
SCAFFOLD_EXPORT = "fcir export --target flower examples/scaffold.py:scaffold -o app/ --inputs parts/server_inputs.npz"
SCAFFOLD_RUN = "FLWR_HOME=dep/home-cli fcir flower run app/ --run-config 'output=\"scaffold.npz\"'"
SIMULATE = "fcir flower simulate app/ --nodes 8 --data parts/ --run-config 'num-server-rounds=3'"
SIMULATE_METRICS = (
    "fcir flower simulate app/ --nodes 8 --data parts/ --run-config "
    '\'num-server-rounds=8 metrics-file="metrics.json" output="out.npz"\''
)
PLOT = "fcir flower plot metrics.json -o loss.png"
SUPERNODE = (
    "flower-supernode --insecure --superlink SERVER:8000 --port 9094 --node-config "
    "\"partition-id=0 data-path='/data/client.npz'\""
)
IREE_EXPORT = (
    "fcir export --target flower examples/fedavg.py:fedavg_round -o app/ --inputs "
    "parts/server_inputs.npz --device-runtime iree --device-target llvm-cpu "
    "--device-target aarch64-linux-android34"
)
DEVICE_PIP = (
    "pip install flwr==1.42.0 'numpy>=2.0' 'iree-base-runtime>=3.13,<3.14' 'ml_dtypes>=0.5,<0.7'"
)
DP_EXAMPLE = "python examples/dp_flower_training.py --nodes 30 --rounds 20 --max-epsilon 6"

# test name -> the doc commands it runs (or, for another machine's, checks).
SCRIPTS = {
    "test_install_commands_name_extras_this_environment_satisfies": [
        'pip install -e ".[flower]"',
        'pip install -e ".[flower,iree]"',
    ],
    "test_the_device_install_is_the_iree_apps_dependencies": [DEVICE_PIP],
    "test_the_supernode_line_for_a_device_parses": [SUPERNODE],
    "test_quickstart_failing_run_and_scaffold_on_one_local_deployment": [
        DATA,
        EXPORT,
        UP,
        QUICK_RUN,
        FAILING_RUN,
        SCAFFOLD_DATA,
        SCAFFOLD_EXPORT,
        SCAFFOLD_RUN,
    ],
    "test_the_simulations_and_the_plot": [DATA, EXPORT, SIMULATE, SIMULATE_METRICS, PLOT],
    "test_the_iree_export": [DATA, IREE_EXPORT],
    "test_the_dp_example_runs_as_the_page_says": [DP_EXAMPLE],
}


def doc_commands(text: str) -> list[str]:
    """The commands of the page's ```bash blocks and its ``$ `` transcript lines."""
    out = []
    for lang, body in re.findall(r"^```(\w*)\n(.*?)^```", text, re.S | re.M):
        if lang == "bash":
            for line in body.replace("\\\n", " ").splitlines():
                line = re.sub(r"\s+#.*$", "", line).strip()
                if line and not line.startswith("#"):
                    out.append(" ".join(line.split()))
        else:
            out += [line[2:].strip() for line in body.splitlines() if line.startswith("$ ")]
    return out


def test_every_command_of_the_page_is_checked():
    on_page = set(doc_commands(DOC.read_text()))
    scripted = {c for cs in SCRIPTS.values() for c in cs}
    assert on_page - scripted == set(), "docs/flower.md commands no test runs: map them in SCRIPTS"
    assert scripted - on_page == set(), "SCRIPTS commands docs/flower.md no longer has"
    tests = {name for name in globals() if name.startswith("test_")}
    assert set(SCRIPTS) <= tests
    assert len(on_page) >= 15  # the parser still finds the page's blocks


def test_doc_commands_joins_continuations_and_drops_comments():
    text = "```bash\n# a note\na --b \\\n    c   # why\nd &\n```\n```text\n$ e f\nout\n```\n"
    assert doc_commands(text) == ["a --b c", "d &", "e f"]


# --- running a script --------------------------------------------------------------------


def _env() -> dict:
    """This environment's commands first on PATH: Flower's (bound to this Python, as a
    deployment runs them), then fcir and python from this Python's folder."""
    import sys

    path = [str(pathlib.Path(sys.executable).parent), os.environ.get("PATH", "")]
    try:
        from fcir.interpreters.flower.local import _bin

        path.insert(0, str(pathlib.Path(_bin("flwr")).parent))
    except Exception:  # noqa: BLE001  (no flwr: the commands that need it skip)
        pass
    return {
        **os.environ,
        "PATH": os.pathsep.join(path),
        "FLWR_TELEMETRY_ENABLED": "0",
        "FLWR_DISABLE_UPDATE_CHECK": "1",
    }


def _folder(tmp_path) -> pathlib.Path:
    """A fresh folder where ``examples/`` is the checkout's, as in the checkout."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "examples").symlink_to(ROOT / "examples")
    return work


def sh(line: str, cwd, timeout: float = 600, tmp=None) -> subprocess.CompletedProcess:
    """``line`` in bash in ``cwd``; ``tmp``: its TMPDIR (where a command without
    ``--dir`` puts its processes' files, to find what it left running)."""
    assert line in SCRIPTS[_current()], f"{line!r} is not in this test's script"
    env = _env() if tmp is None else {**_env(), "TMPDIR": str(tmp)}
    return subprocess.run(
        ["bash", "-c", line], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


def ok(line: str, cwd, timeout: float = 600, tmp=None) -> str:
    p = sh(line, cwd, timeout, tmp)
    assert p.returncode == 0, f"{line}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p.stdout + p.stderr


def _current() -> str:
    return os.environ["PYTEST_CURRENT_TEST"].split("::")[-1].split(" ")[0].split("[")[0]


def _short_tmp(tmp_path) -> pathlib.Path:
    """A TMPDIR for a command that puts its files there: short, since Ray's sockets go
    under it and an AF_UNIX path has at most 107 bytes (pytest's tmp_path is too long,
    and so is a TMPDIR of CI's own, /tmp/fcir-ci-leg2.XXXXXX: hence /tmp itself)."""
    import tempfile

    tmp = pathlib.Path(
        tempfile.mkdtemp(prefix="fd-", dir="/tmp" if os.path.isdir("/tmp") else None)
    ).resolve()
    (tmp_path / "tmp").symlink_to(tmp)  # removed with tmp_path's; the folder itself:
    _CLEANUP.append(tmp)
    return tmp


_CLEANUP: list[pathlib.Path] = []


@pytest.fixture(autouse=True)
def _remove_short_tmps():
    yield
    while _CLEANUP:
        shutil.rmtree(_CLEANUP.pop(), ignore_errors=True)


def _outputs(path) -> list:
    from flowerlib import files

    return files.read_outputs(path)


# --- commands for another machine: what can be checked here ------------------------------


def test_install_commands_name_extras_this_environment_satisfies():
    """`pip install -e ".[EXTRAS]"` (the page's, for the checkout): each extra exists
    and this environment, installed from it, satisfies every requirement it adds."""
    from importlib import metadata

    from packaging.requirements import Requirement

    requires = [Requirement(r) for r in metadata.requires("fcir") or []]
    for line in SCRIPTS[_current()]:
        (extras,) = re.findall(r'pip install -e "\.\[([a-z,]+)\]"', line)
        for extra in extras.split(","):
            reqs = [r for r in requires if r.marker and r.marker.evaluate({"extra": extra})]
            assert reqs, f"{line}: no extra {extra!r}"
            for r in reqs:
                version = metadata.version(r.name)
                assert r.specifier.contains(version, prereleases=True), (line, str(r), version)


def test_the_device_install_is_the_iree_apps_dependencies():
    """The page's pip line for a device is exactly what an IREE app's pyproject.toml
    asks for: test_flower_iree.py's node venv (built from those requirements)
    runs real SuperNodes on it."""
    import tomllib

    from fcir.interpreters.flower.app_writer import _pyproject

    (line,) = SCRIPTS[_current()]
    argv = shlex.split(line)
    assert argv[:2] == ["pip", "install"]
    deps = tomllib.loads(_pyproject("x", "iree"))["project"]["dependencies"]
    assert argv[2:] == deps
    assert not any(d.startswith(("jax", "fcir")) for d in deps)


@pytest.mark.slow  # flower-supernode --help: 15 s of imports here
def test_the_supernode_line_for_a_device_parses():
    """The page's SuperNode line needs a server elsewhere (SERVER). Its options are
    flower-supernode's (--help), its node config parses to what the ClientApp reads,
    and fcir flower up starts its SuperNodes (which the deployment test runs) with
    the same options."""
    pytest.importorskip("flwr", reason="the Flower tests need flwr (pip install -e '.[flower]')")
    from fcir.interpreters.flower.local import Deployment, _bin
    from flwr.common.config import parse_config_args

    (line,) = SCRIPTS[_current()]
    argv = shlex.split(line)
    assert argv[0] == "flower-supernode"
    options = [a for a in argv[1:] if a.startswith("--")]
    assert options == ["--insecure", "--superlink", "--port", "--node-config"]
    help_text = subprocess.run(
        [_bin("flower-supernode"), "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(),
    ).stdout
    for opt in [*options, "--root-certificates"]:  # the page's TLS advice too
        assert opt in help_text, opt
    config = parse_config_args([argv[argv.index("--node-config") + 1]])
    assert config == {"partition-id": 0, "data-path": "/data/client.npz"}
    dep = Deployment(pathlib.Path("/nonexistent"), 1)
    assert dep._security(server=False) == ["--insecure"]


# --- the quickstart, the failing run and the scaffold app on the page's deployment -------


@pytest.mark.slow
def test_quickstart_failing_run_and_scaffold_on_one_local_deployment(tmp_path):
    """The page's `fcir flower up` serves, one after another: the quickstart's `flwr run`
    (3 rounds; final_model.npz in the SuperLink's folder, bit for bit the same app run
    in-process on the same files), the transcript's failing `fcir flower run` (exit 1
    with the ServerApp's error, as the page shows it), and the scaffold app (whose
    files replace the quickstart's in parts/: 4 rounds, reference.run's outputs within
    rtol 1e-5, atol 1e-6). SIGTERM then stops it (exit 0) and everything it started."""
    pytest.importorskip("flwr", reason="the Flower tests need flwr (pip install -e '.[flower]')")
    from fcir.interpreters.flower.simulation import _pids_with_home_under
    from flowerlib import inprocess

    import fcir
    from fcir.frontend.loading import load_python_target

    work = _folder(tmp_path)
    ok(DATA, work)
    ok(EXPORT, work)
    assert UP in SCRIPTS[_current()]
    up = subprocess.Popen(
        ["bash", "-c", "exec " + UP.rstrip("& ")],
        cwd=work,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    dep = work / "dep"
    try:
        said = []
        for line in up.stdout:
            said.append(line)
            if line.startswith("Ctrl-C"):
                break
        assert f"FLWR_HOME={dep.resolve() / 'home-cli'}" in "".join(said), "".join(said)
        assert "3 SuperNode(s)" in "".join(said), "".join(said)

        log = ok(QUICK_RUN, work)
        assert log.count("3/3 clients replied") == 3, log[-3000:]
        (written,) = re.findall(r"wrote \d+ output array\(s\) to (\S+)", log)
        assert pathlib.Path(written) == dep.resolve() / "home-superlink" / "final_model.npz"
        config = dict(kv.split("=", 1) for kv in shlex.split(shlex.split(QUICK_RUN)[-1]))
        nodes = {
            101 + i: {"partition-id": i, "data-path": str(work / "parts" / f"node{i}.npz")}
            for i in range(3)
        }
        grid = inprocess.run(work / "app", nodes, config)
        assert [g.tobytes() for g in _outputs(written)] == [w.tobytes() for w in grid.final_model]

        p = sh(FAILING_RUN, work, 300)
        assert p.returncode == 1, p.stdout[-2000:] + p.stderr[-2000:]
        shown = "failed: finished: failed (ServerApp failed with exception: run config state='0=9'"
        assert shown in p.stderr and "Traceback" not in p.stderr, p.stderr[-2000:]
        assert "fcir flower run: error: run " in p.stderr

        ok(SCAFFOLD_DATA, work)
        ok(SCAFFOLD_EXPORT, work)
        log = ok(SCAFFOLD_RUN, work)
        assert "round 4/4" in log and "3/3 clients replied" in log, log[-3000:]
        fn, args = load_python_target(f"{ROOT}/examples/scaffold.py:scaffold")
        module = fcir.capture(fn, *args, name="scaffold")
        want = rounds.module_reference_outputs(module, args)
        got = _outputs(dep / "home-superlink" / "scaffold.npz")
        assert [(g.dtype, g.shape) for g in got] == [(w.dtype, w.shape) for w in want]
        from corpus.compare import assert_trees_match

        assert_trees_match(got, want, rtol=1e-5, atol=1e-6)
    finally:
        up.send_signal(signal.SIGTERM)
        rest = up.communicate(timeout=60)[0]
    assert up.returncode == 0, rest[-2000:]
    assert _pids_with_home_under(dep.resolve()) == []


# --- the simulations and the plot ---------------------------------------------------------


def _fedavg_round(work) -> rounds.Round:
    """examples/fedavg.py's round on EXAMPLE_ARGS, as `fcir flower data` split it."""
    import jax

    import fcir
    from fcir.frontend.loading import load_python_target

    fn, args = load_python_target(f"{ROOT}/examples/fedavg.py:fedavg_round")
    module = fcir.capture(fn, *args, name="fedavg_round")
    leaves = [np.asarray(x) for x in jax.tree.leaves(args)]
    with np.load(work / "parts" / "server_inputs.npz") as f:
        server = [f[f"arr_{i}"] for i in range(len(f.files))]
    assert [x.tobytes() for x in leaves[: len(server)]] == [x.tobytes() for x in server]
    return rounds.Round(
        "fedavg_round", module, leaves, [i >= len(server) for i in range(len(leaves))]
    )


@pytest.mark.slow
def test_the_simulations_and_the_plot(tmp_path):
    """The page's simulations of its fedavg app on 8 virtual nodes (one per node file):
    3 rounds (state inferred) and 8 rounds with a metrics file, then its plot. Each
    equals that many rounds of run_bundle bit for bit; the first writes final_model.npz
    in the folder it was started in, the second out.npz and metrics.json there (relative
    paths); the output is quiet (no fork warning, no Python warning, none of Flower's
    notes that do not apply), and nothing of either simulation is left running."""
    pytest.importorskip("flwr", reason="the Flower tests need flwr (pip install -e '.[flower]')")
    pytest.importorskip(
        "ray", reason="the Simulation Engine needs ray (pip install -e '.[flower]')"
    )
    import json

    from fcir.interpreters.flower.simulation import _pids_with_home_under

    work = _folder(tmp_path)
    tmp = _short_tmp(tmp_path)
    ok(DATA, work)
    ok(EXPORT, work)
    r = _fedavg_round(work)

    p = sh(SIMULATE, work, tmp=tmp)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert p.stdout.count("8/8 clients replied") == 3, p.stdout[-3000:]
    assert "finished: completed\n" in p.stdout
    said = p.stdout + p.stderr
    for noise in (
        "os.fork()",
        "Warning:",
        "default simulated SuperNodes",
        "simulation-config",
        "Manually terminating",
    ):
        assert noise not in said, said[-3000:]
    out = work.resolve() / "final_model.npz"
    assert f"to {out}\n" in p.stdout, p.stdout[-3000:]
    outs = rounds.bundle_rounds(r, tmp_path / "b3", 3)
    assert [g.tobytes() for g in _outputs(out)] == [o.tobytes() for o in outs]
    assert _pids_with_home_under(tmp.resolve()) == []

    p = sh(SIMULATE_METRICS, work, tmp=tmp)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert p.stdout.count("8/8 clients replied") == 8, p.stdout[-3000:]
    outs = rounds.bundle_rounds(r, tmp_path / "b8", 8)
    assert [g.tobytes() for g in _outputs(work / "out.npz")] == [o.tobytes() for o in outs]
    history = json.loads((work / "metrics.json").read_text())
    assert history.pop("round") == list(range(1, 9))
    (loss,) = history.values()  # the round's one scalar output that is not state
    assert len(loss) == 8 and loss[-1] < loss[0], loss
    assert _pids_with_home_under(tmp.resolve()) == []

    said = ok(PLOT, work)
    assert (work / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", said


def test_simulate_takes_relative_run_config_paths_from_where_it_was_started():
    from fcir.interpreters.flower.simulation import absolute_paths

    got = absolute_paths('num-server-rounds=8 metrics-file="m.json" output="o.npz"', "/w")
    assert got == 'num-server-rounds=8 metrics-file="/w/m.json" output="/w/o.npz"'
    kept = 'output="none" checkpoint-dir="/abs/c" inputs="" dataset="/d.npz"'
    assert absolute_paths(kept, "/w") == kept
    assert absolute_paths('checkpoint-dir="c" dataset="d.npz"', "/w") == (
        'checkpoint-dir="/w/c" dataset="/w/d.npz"'
    )


# --- the IREE export ---------------------------------------------------------------------


@pytest.mark.slow
def test_the_iree_export(tmp_path):
    """The page's IREE export of its fedavg round: a module per target, each verified
    at the level kept (the aarch64 one run under qemu when the machine has it)."""
    pytest.importorskip("flwr", reason="the Flower tests need flwr (pip install -e '.[flower]')")
    pytest.importorskip(
        "iree.compiler", reason="needs iree-base-compiler (pip install -e '.[iree]')"
    )
    import json

    work = _folder(tmp_path)
    ok(DATA, work)
    said = ok(IREE_EXPORT, work)
    assert "wrote Flower app to" in said, said[-2000:]
    plan = json.loads((work / "app" / "fcir_app" / "plan.json").read_text())
    assert plan["device_runtime"] == "iree"
    (step,) = [s for s in plan["steps"] if s["kind"] == "exchange"]
    modules = step["client"]["iree"]["modules"]
    assert sorted(modules) == ["aarch64-linux-android34", "llvm-cpu"]
    assert modules["llvm-cpu"]["verified"].startswith("ran and matched")
    import tomllib

    project = tomllib.loads((work / "app" / "pyproject.toml").read_text())["project"]
    assert " ".join(project["dependencies"]) == " ".join(DEVICE_PIP.replace("'", "").split()[2:])


# --- examples/dp_flower_training.py, as the page runs it ----------------------------------


@pytest.mark.slow
def test_the_dp_example_runs_as_the_page_says(tmp_path):
    """`python examples/dp_flower_training.py --nodes 30 --rounds 20 --max-epsilon 6`:
    what the page says it does (2 rounds, then resumed, rounds 3 to 6, epsilon 5.979,
    round 7 would bring it to 6.543, the held-out accuracy it states to 0.01), nothing
    left running. The example's own checks ride on this run (its two Simulation Engine
    runs are the cost): it stops on its budget, as many rounds as fcir.privacy.Budget on
    the round's module allows, and the resume keeps spending the first run's (a fresh
    budget would run 6 more); the model it writes is 6 rounds of the production bundle
    bit for bit (reference.run's to 1e-5)."""
    pytest.importorskip("flwr", reason="the Flower tests need flwr (pip install -e '.[flower]')")
    pytest.importorskip(
        "ray", reason="the Simulation Engine needs ray (pip install -e '.[flower]')"
    )
    pytest.importorskip("sklearn")
    from fcir.interpreters.flower.simulation import _pids_with_home_under

    text = DOC.read_text()
    assert (
        "runs 2 rounds, then resumes and runs rounds\n3 to 6 (ε 5.979; round 7 would bring it to 6.543)"
        in text
    )
    work = _folder(tmp_path)
    tmp = _short_tmp(tmp_path)
    log = ok(DP_EXAMPLE, work, tmp=tmp)
    assert re.findall(r"round (\d+)/2:", log) == ["1", "2"], log[-3000:]
    assert "resuming after round 2" in log, log[-3000:]
    assert re.findall(r"round (\d+)/20:", log) == ["3", "4", "5", "6"], log[-3000:]
    assert "stopping before round 7: it would bring epsilon to 6.543" in log, log[-3000:]
    assert "6 rounds ran in all" in log and "ε 5.979 spent" in log, log[-3000:]
    (accuracy,) = re.findall(r"test accuracy (\d\.\d+)", log)
    (stated,) = re.findall(r"reaching (\d\.\d+) held-out accuracy", text)
    assert abs(float(accuracy) - float(stated)) <= 0.01, (accuracy, stated)
    assert _pids_with_home_under(tmp.resolve()) == []
    (written,) = re.findall(r"the model: (\S+)\n", log)
    _the_dp_example_spends_its_budget_and_writes_the_bundle_s_model(
        log, _outputs(written), tmp_path
    )


def _the_dp_example_spends_its_budget_and_writes_the_bundle_s_model(log, got, tmp_path):
    """The page's run against the example's round (30 nodes, clip 0.5, noise 2.0, seed
    0: its defaults): the budget and ε it printed, and its model."""
    import jax
    from corpus.compare import assert_trees_match
    from examples_testing import load
    from fcir.interpreters import reference

    import fcir

    example = load("dp_flower_training")
    args, _ = example.round_args(30, 0, None)
    module = fcir.capture(example.make_round(30, 0.5, 2.0, None), *args)
    budget = fcir.privacy.Budget(module, 1e-5, 6.0)
    while budget.can_spend():
        budget.spend()
    assert budget.rounds == 6 and "allows 6 of 20 rounds" in log, log[-3000:]
    assert "6 rounds ran in all (the budget planned 6)" in log, log[-3000:]
    eps = [fcir.privacy.epsilon(module, r, 1e-5) for r in (6, 7)]
    assert eps[0] <= 6.0 < budget.epsilon_after(1) == eps[1]
    assert f"epsilon={eps[0]:.4g} after 6 round(s)" in log, log[-3000:]
    assert f"it would bring epsilon to {eps[1]:.4g}" in log and f"ε {eps[0]:.4g} spent" in log

    assert int(got[-1]) == 7  # the round counter: 6 rounds ran
    leaves = [np.asarray(x) for x in jax.tree.leaves(args)]
    dp_round = rounds.Round("dp_round", module, leaves, rounds.client_params(module))
    outs = rounds.bundle_rounds(dp_round, tmp_path / "bundle", 6)
    model, r, key, clients = args
    for _ in range(6):
        model, r = reference.run(module, model, r, key, clients)
    # Bit for bit the production bundle's 6 rounds; the reference interpreter's to 1e-5.
    assert [g.tobytes() for g in got] == [x.tobytes() for x in outs]
    want = [np.asarray(v) for v in jax.tree.leaves((model, r))]
    assert_trees_match(got, want, rtol=1e-5, atol=1e-6)
