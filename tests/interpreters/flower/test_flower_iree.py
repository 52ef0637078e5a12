"""``--device-runtime iree`` Flower apps: client work as verified IREE modules that the
ClientApp runs with iree.runtime and numpy, never jax.

In-process (tests/flowerlib/inprocess.py) for every round kind the jax path runs: plain
FedAvg, secure sums through SecAgg+, a DP round, a multi-exchange round; in a child
process that refuses to import jax; and on real SuperNodes started from a venv that
has no jax (built once per machine, cached under the temp dir).
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from corpus.compare import assert_trees_match
from fcir.interpreters import flower, reference
from flowerlib import files, inprocess, programs, rounds, secure
from productionlib import iree_faults

import fcir

pytestmark = pytest.mark.slow  # docs/contributing.md: left out of the fast tier

pytest.importorskip("flwr", reason="the Flower tests need flwr (pip install 'fcir[flower]')")
pytest.importorskip("iree.compiler", reason="needs iree-base-compiler (pip install 'fcir[iree]')")
pytest.importorskip("iree.runtime", reason="needs iree-base-runtime (pip install 'fcir[iree]')")

N = rounds.NODES


def _nodes(root, rows: list[list]) -> dict:
    """Nodes 101, 102, 103, node ``101 + i`` reading ``rows[i]``."""
    return files.write_nodes(root, rows, 101)


def _both(module, root, inputs, rows, run_config=None):
    """The round exported with jax and with iree, run in-process on the same nodes:
    (iree outputs, jax outputs, iree plan)."""
    root = pathlib.Path(root)
    nodes = _nodes(root, rows)
    outs = {}
    for runtime in ("jax", "iree"):
        app = flower.export(module, root / runtime, inputs=inputs, device_runtime=runtime)
        out = root / f"{runtime}.npz"
        inprocess.run(app, nodes, {"output": str(out), **(run_config or {})})
        outs[runtime] = files.read_outputs(out)
    return outs["iree"], outs["jax"], rounds.plan_of(root / "iree")


def _assert_same_numbers(got, want, rtol=1e-5, atol=1e-6):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        if g.dtype.kind in "iub":
            assert g.tobytes() == w.tobytes()
        else:
            np.testing.assert_allclose(g, w, rtol=rtol, atol=atol)


def _export_by_cli(r: rounds.Round, root, out: str, capsys, *flags: str):
    """``fcir export --target flower ROUND.fcir -o ROOT/OUT --inputs IN.npz
    --device-runtime iree FLAGS``, the round's text and server inputs written under
    ``root`` first; returns the .fcir file."""
    from fcir.cli import main

    src = root / "round.fcir"
    src.write_text(r.module.to_text(full_constants=True))
    np.savez(root / "in.npz", *r.server_leaves)
    args = ["export", "--target", "flower", str(src), "-o", str(root / out)]
    args += ["--inputs", str(root / "in.npz"), "--device-runtime", "iree", *flags]
    assert main(args) == 0, capsys.readouterr().err
    return src


def _client_steps(plan):
    return [s for s in plan["steps"] if s["kind"] == "exchange"]


# --- every round kind ---------------------------------------------------------------------


def test_fedavg_app_runs_client_work_as_iree_modules(tmp_path):
    r = rounds.corpus_round("fedavg_mlp")
    app = flower.export(r.module, tmp_path / "probe", inputs=r.server_leaves, device_runtime="iree")
    plan = rounds.plan_of(app)
    rows = [r.node_leaves(plan, i) for i in range(N)]
    got, jax_outs, plan = _both(r.module, tmp_path, r.server_leaves, rows)
    (step,) = _client_steps(plan)
    assert plan["device_runtime"] == "iree"
    assert "artifact" not in step["client"]  # no jax.export artifact for the clients
    # two seeded input sets, and one per client on the server's real inputs (--inputs)
    assert step["client"]["iree"]["input_sets"] == 2 + N
    assert step["client"]["iree"]["modules"]["llvm-cpu"]["verified"].startswith("ran and matched")
    assert (app / "fcir_app" / "iree_runtime.py").is_file()
    assert not (tmp_path / "jax" / "fcir_app" / "iree_runtime.py").exists()
    artifacts = json.loads((app / "fcir_app" / "artifacts.json").read_text())
    assert "client_work" not in artifacts and "client_work@llvm-cpu" in artifacts
    _assert_same_numbers(got, jax_outs)
    assert_trees_match(got, rounds.reference_outputs(r), rtol=1e-5, atol=1e-5)
    toml = (app / "pyproject.toml").read_text()
    assert '"iree-base-runtime>=3.13,<3.14"' in toml
    assert "jax" not in toml.split("dependencies = [", 1)[1].split("]", 1)[0]


def test_secure_sums_go_through_secagg_plus_exactly_with_iree_clients(tmp_path):
    scale, *clients = secure.make_args(N)
    module = fcir.capture(secure.secure_mix, scale, *clients)
    rows = [[a[i] for a in clients] for i in range(N)]
    got, jax_outs, _ = _both(module, tmp_path, [scale], rows)  # secagg=true: SecAgg+
    expected = [np.asarray(v) for v in jax.tree.leaves(reference.run(module, scale, *clients))]
    secure.assert_matches(got, expected)
    _assert_same_numbers(got, jax_outs)


def test_a_dp_round_clips_on_the_iree_device_and_noises_at_the_server(tmp_path):
    rng = np.random.default_rng(0)
    w, b = jnp.zeros((4, 2), jnp.float32), jnp.full((2,), 0.1, jnp.float32)
    key = jax.random.key_data(jax.random.key(3))
    x = jnp.asarray(rng.normal(size=(N, 5, 4)), jnp.float32)
    y = jnp.asarray(rng.normal(size=(N, 5, 2)) * 3, jnp.float32)
    module = fcir.capture(programs.private_fedavg(fcir.dp_mean), w, b, key, x, y)
    rows = [[np.asarray(x[i]), np.asarray(y[i])] for i in range(N)]
    got, jax_outs, plan = _both(
        module, tmp_path, [np.asarray(w), np.asarray(b), np.asarray(key)], rows
    )
    assert "fed.dp_mean" in json.dumps(plan["privacy"])
    assert "iree" in _client_steps(plan)[0]["client"]
    _assert_same_numbers(got, jax_outs)
    expected = [np.asarray(v) for v in jax.tree.leaves(reference.run(module, w, b, key, x, y))]
    assert_trees_match(got, expected, rtol=1e-5, atol=1e-5)


def test_a_multi_exchange_round_runs_each_phase_through_iree(tmp_path):
    scale = jnp.float32(2.0)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(N, 5, 4)), jnp.float32)
    module = fcir.capture(programs.mean_then_variance, scale, x)
    got, jax_outs, plan = _both(
        module, tmp_path, [np.asarray(scale)], [[np.asarray(x[i])] for i in range(N)]
    )
    steps = _client_steps(plan)
    assert len(steps) == 2
    assert [sorted(s["client"]["iree"]["modules"].values(), key=str)[0]["file"] for s in steps] == [
        "1.client_work@llvm-cpu",
        "2.client_work@llvm-cpu",
    ]
    _assert_same_numbers(got, jax_outs)
    expected = [np.asarray(v) for v in jax.tree.leaves(reference.run(module, scale, x))]
    assert_trees_match(got, expected, rtol=1e-5, atol=1e-6)


def test_a_phase_iree_gets_wrong_is_an_export_error_naming_it(tmp_path, monkeypatch):
    from fcir.interpreters.production import iree

    iree_faults.wrong_at(monkeypatch, set(iree.OPT_LEVELS))
    scale = jnp.float32(2.0)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(N, 5, 4)), jnp.float32)
    module = fcir.capture(programs.mean_then_variance, scale, x)
    with pytest.raises(
        flower.ExportError, match=r"1\.client_work .*max error.*--device-runtime jax"
    ):
        flower.export(module, tmp_path / "app", inputs=[np.asarray(scale)], device_runtime="iree")
    assert not (tmp_path / "app").exists()


# --- whole training programs (a server loop of rounds) ----------------------------------


def test_a_scan_of_rounds_runs_each_iteration_s_client_work_through_iree(tmp_path, capsys):
    """scan_rounds (three FedAvg rounds in a server lax.scan), exported by the CLI with
    --device-runtime iree: the round's client work is a module verified at export on
    seeded inputs and on each client's inputs of the first iteration; the app writes
    what the jax app and reference.run write."""
    r = rounds.corpus_round("scan_rounds")
    _export_by_cli(r, tmp_path, "iree", capsys)
    plan = rounds.plan_of(tmp_path / "iree")
    assert plan["loop"]["kind"] == "scan" and plan["device_runtime"] == "iree"
    (step,) = _client_steps(plan)
    assert "artifact" not in step["client"]
    assert step["client"]["iree"]["input_sets"] == 2 + N  # seeded + the first iteration's
    arts = json.loads((tmp_path / "iree" / "fcir_app" / "artifacts.json").read_text())
    assert "client_work" not in arts and "client_work@llvm-cpu" in arts
    nodes = _nodes(tmp_path, [r.node_leaves(plan, i) for i in range(N)])
    jax_app = flower.export(r.module, tmp_path / "jax", inputs=r.server_leaves)
    outs = {}
    for name, app in (("iree", tmp_path / "iree"), ("jax", jax_app)):
        grid = inprocess.run(app, nodes, {"output": str(tmp_path / f"{name}.npz")})
        assert len(grid.sent) == 3 * N  # one Flower round per iteration
        outs[name] = files.read_outputs(tmp_path / f"{name}.npz")
    _assert_same_numbers(outs["iree"], outs["jax"])
    assert_trees_match(outs["iree"], rounds.reference_outputs(r), rtol=1e-5, atol=1e-5)


def _loop_case(name):
    rng = np.random.default_rng(2)
    x = jnp.asarray(1.0 + 0.5 * rng.normal(size=(N, 6, 4)), jnp.float32)
    w = jnp.zeros(4, jnp.float32)
    if name == "reverse_scan":
        lrs = jnp.asarray([0.5, 0.25, 0.125], jnp.float32)
        return programs.reverse_scan_two_exchanges, (w, lrs, x), 3 * 2
    x = jnp.asarray(1.0 + 0.1 * rng.normal(size=(N, 5, 4)), jnp.float32)
    return programs.train_until, (w, jnp.float32(0.3), x), None


@pytest.mark.parametrize("name", ["reverse_scan", "while"])
def test_loop_apps_with_iree_clients_equal_the_jax_app_and_the_reference(name, tmp_path):
    program, args, exchanges = _loop_case(name)
    module = fcir.capture(program, *args)
    server = [np.asarray(a) for a in args[:-1]]
    got, jax_outs, plan = _both(
        module, tmp_path, server, [[np.asarray(args[-1][i])] for i in range(N)]
    )
    steps = _client_steps(plan)
    assert steps and all("iree" in s["client"] for s in steps)
    assert steps[0]["client"]["iree"]["input_sets"] == 2 + N
    _assert_same_numbers(got, jax_outs)
    want = rounds.module_reference_outputs(module, args)
    assert_trees_match(got, want, rtol=1e-5, atol=1e-6)
    if name == "while":
        assert 1 < int(want[2]) < 10  # the condition stopped it after a few rounds


def test_the_first_iteration_of_a_reverse_scan_takes_the_last_xs():
    from fcir.interpreters.flower.loops import find_loop, first_round_inputs, split_loop

    program, (w, lrs, x), _ = _loop_case("reverse_scan")
    module = fcir.capture(program, w, lrs, x)
    ls = split_loop(module, find_loop(module))
    w0 = np.arange(4, dtype=np.float32)
    got = first_round_inputs(ls, [w0, np.asarray(lrs)])
    assert [np.asarray(g).tolist() for g in got] == [w0.tolist(), 0, 0.125]  # w, step, lr
    assert first_round_inputs(ls, [w0]) is None  # not pre's inputs: the writer says why


def test_a_loop_round_iree_gets_wrong_is_an_export_error_naming_its_phase(tmp_path, monkeypatch):
    from fcir.interpreters.production import iree

    iree_faults.wrong_at(monkeypatch, set(iree.OPT_LEVELS))
    program, args, _ = _loop_case("reverse_scan")
    module = fcir.capture(program, *args)
    with pytest.raises(flower.ExportError, match=r"1\.client_work .*--device-runtime jax"):
        flower.export(
            module,
            tmp_path / "app",
            inputs=[np.asarray(a) for a in args[:-1]],
            device_runtime="iree",
        )
    assert not (tmp_path / "app").exists()


def test_device_target_without_iree_is_an_export_error(tmp_path):
    r = rounds.corpus_round("fedavg_mlp")
    with pytest.raises(flower.ExportError, match="--device-target goes with --device-runtime iree"):
        flower.export(
            r.module, tmp_path / "app", inputs=r.server_leaves, device_targets=["x86_64-linux"]
        )


# --- a node picks its module --------------------------------------------------------------


def test_a_node_picks_its_module_by_platform_or_node_config(tmp_path):
    from fcir.interpreters.production import iree_runtime as ir

    modules = {
        "llvm-cpu": {"arch": "x86_64"},
        "aarch64-linux-android34": {"arch": "aarch64"},
        "aarch64-apple-ios17": {"arch": "aarch64"},
        "x86_64-linux": {"arch": "x86_64"},
    }
    here = ir.machine_arch()
    if here == "x86_64":
        assert ir.pick_target(modules, "x86_64") == "x86_64-linux"  # native on Linux x86_64
        assert ir.pick_target({"llvm-cpu": {"arch": "x86_64"}}, "x86_64") == "llvm-cpu"
        with pytest.raises(ir.DeviceRuntimeError, match="no module for this device"):
            ir.pick_target({"aarch64-apple-ios17": {"arch": "aarch64"}}, "x86_64")
    assert ir.pick_target(modules, "x86_64", "aarch64-apple-ios17") == "aarch64-apple-ios17"
    with pytest.raises(ir.DeviceRuntimeError, match="--device-target riscv"):
        ir.pick_target(modules, "x86_64", "riscv")


def test_node_config_device_target_selects_the_module_the_client_runs(tmp_path, monkeypatch):
    r = rounds.corpus_round("fedavg_mlp")
    app = flower.export(
        r.module,
        tmp_path / "app",
        inputs=r.server_leaves,
        device_runtime="iree",
        device_targets=["llvm-cpu", "x86_64-linux"],
    )
    plan = rounds.plan_of(app)
    nodes = _nodes(tmp_path, [r.node_leaves(plan, i) for i in range(N)])
    for cfg in nodes.values():
        cfg["device-target"] = "aarch64-apple-ios17"  # not in this app
    with pytest.raises(RuntimeError, match="device-target='aarch64-apple-ios17'"):
        inprocess.run(app, nodes, {"output": str(tmp_path / "o.npz")})
    loaded = []
    for cfg in nodes.values():
        cfg["device-target"] = "llvm-cpu"
    real = inprocess.load_app

    def load_app(appdir):
        ns = real(appdir)
        mod = importlib.import_module(ns.client.__name__.rsplit(".", 1)[0] + ".iree_runtime")
        original = mod.Module

        class Recording(original):
            def __init__(self, vmfb, entry="main"):
                loaded.append(hashlib.sha256(vmfb).hexdigest())
                super().__init__(vmfb, entry)

        monkeypatch.setattr(mod, "Module", Recording)
        return ns

    monkeypatch.setattr(inprocess, "load_app", load_app)
    inprocess.run(app, nodes, {"output": str(tmp_path / "o.npz")})
    arts = json.loads((app / "fcir_app" / "artifacts.json").read_text())
    assert set(loaded) == {arts["client_work@llvm-cpu"]["sha256"]}


# --- no jax on the client -----------------------------------------------------------------

_NO_JAX_CLIENT = r"""
import importlib.abc, importlib.util, pathlib, sys, types
class NoJax(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("jax", "jaxlib", "fcir"):
            raise ImportError(f"this device has no {name}")
sys.meta_path.insert(0, NoJax())
import numpy as np
appdir, values, data, out, step = sys.argv[1:]
pkg = pathlib.Path(appdir) / "fcir_app"
spec = importlib.util.spec_from_file_location("fcir_app", pkg / "__init__.py",
                                              submodule_search_locations=[str(pkg)])
mod = importlib.util.module_from_spec(spec); sys.modules["fcir_app"] = mod
spec.loader.exec_module(mod)
import fcir_app.client_app as client
with np.load(values) as f:
    sent = {k.replace("|", "/"): f[k] for k in f.files}
ctx = types.SimpleNamespace(node_id=7, node_config={"data-path": data, "partition-id": 0}, run_config={})
res = client.compute(int(step), sent, ctx)
np.savez(out, **{k.replace("/", "|"): v for k, v in res.items()})
bad = sorted(m for m in sys.modules if m.split(".")[0] in ("jax", "jaxlib", "fcir"))
assert not bad, bad
print("ok")
"""


def test_the_client_app_runs_in_a_process_that_cannot_import_jax(tmp_path, monkeypatch):
    r = rounds.corpus_round("fedavg_mlp")
    app = flower.export(r.module, tmp_path / "app", inputs=r.server_leaves, device_runtime="iree")
    plan = rounds.plan_of(app)
    nodes = _nodes(tmp_path, [r.node_leaves(plan, i) for i in range(N)])
    seen = []
    real = inprocess.load_app

    def load_app(appdir):
        ns = real(appdir)
        compute = ns.client.compute

        def recording(step_index, values, context, *rest):
            res = compute(step_index, values, context, *rest)
            seen.append((step_index, dict(values), dict(context.node_config), res))
            return res

        monkeypatch.setattr(ns.client, "compute", recording)
        return ns

    monkeypatch.setattr(inprocess, "load_app", load_app)
    inprocess.run(app, nodes, {"output": str(tmp_path / "o.npz")})
    step, values, cfg, res = seen[0]
    np.savez(tmp_path / "sent.npz", **{k.replace("/", "|"): v for k, v in values.items()})
    p = subprocess.run(
        [
            sys.executable,
            "-c",
            _NO_JAX_CLIENT,
            str(app),
            str(tmp_path / "sent.npz"),
            cfg["data-path"],
            str(tmp_path / "res.npz"),
            str(step),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr[-3000:]
    with np.load(tmp_path / "res.npz") as f:
        got = {k.replace("|", "/"): f[k] for k in f.files}
    assert sorted(got) == sorted(res)
    for k in res:
        assert got[k].tobytes() == np.asarray(res[k]).tobytes(), k


# --- real SuperNodes from a venv without jax ----------------------------------------------


def _app_dependencies() -> tuple[str, ...]:
    """What an exported IREE app's pyproject.toml tells a device to install."""
    import tomllib

    from fcir.interpreters.flower.app_writer import _pyproject

    return tuple(tomllib.loads(_pyproject("x", "iree"))["project"]["dependencies"])


NODE_PACKAGES = _app_dependencies()


def _closure(requirements) -> set[str]:
    """The distributions ``requirements`` install (their non-extra requirements, as
    this venv's metadata declares them)."""
    import re
    from importlib import metadata

    seen: set[str] = set()
    todo = list(requirements)
    while todo:
        name = re.split(r"[ ;<>=!~\[(]", todo.pop(), maxsplit=1)[0].lower().replace("_", "-")
        if name in seen:
            continue
        seen.add(name)
        try:
            todo += [r for r in metadata.requires(name) or [] if "extra ==" not in r]
        except metadata.PackageNotFoundError:
            pass
    return seen


def test_a_jax_app_asks_its_nodes_for_flatbuffers_which_jax_export_needs():
    """jax.export.deserialize imports flatbuffers, which neither jax nor flwr requires: a
    node with only the jax app's dependencies failed its first client step (found
    building bench/device_runtime.py's jax node venv). IREE nodes deserialize nothing."""
    import tomllib

    from fcir.interpreters.flower.app_writer import _pyproject

    jax_deps = tomllib.loads(_pyproject("x", "jax"))["project"]["dependencies"]
    assert "flatbuffers" in _closure(jax_deps)
    assert "flatbuffers" not in _closure(["flwr", "jax"])  # why the app must name it


def test_a_jax_app_s_jax_range_holds_the_exporting_jax_and_no_earlier_one():
    """A jax reads jax.export artifacts of its own and earlier versions, not later ones:
    the app's floor is the jax that exported it (it once said ``<0.11`` on every jax)."""
    import tomllib

    import jax
    from fcir.interpreters.flower.app_writer import _pyproject
    from packaging.requirements import Requirement

    deps = tomllib.loads(_pyproject("x", "jax"))["project"]["dependencies"]
    (spec,) = [Requirement(d).specifier for d in deps if Requirement(d).name == "jax"]
    release = ".".join(jax.__version__.split(".")[:3])
    assert spec.contains(release) and not spec.contains("0.10.1")
    assert str(spec) == f"<0.13,>={release}" or str(spec) == f">={release},<0.13"


def node_venv() -> pathlib.Path:
    """A venv with only flwr, numpy and iree-base-runtime (and their dependencies), built
    once per machine under the temp dir, by uv where it is on PATH (pip took 32 CPU s
    here to install what uv installs in 1 to 5); skips the test when it cannot be built."""
    tag = hashlib.sha256(f"{sys.version}{NODE_PACKAGES}".encode()).hexdigest()[:12]
    root = pathlib.Path(tempfile.gettempdir()) / f"fcir-iree-node-venv-{tag}"
    py = root / "bin" / "python"
    if (root / ".complete").is_file():
        return root
    base = getattr(sys, "_base_executable", sys.executable)
    shutil.rmtree(root, ignore_errors=True)  # a half-built one from an interrupted run
    # (a venv hard-codes its path: built in place)
    if uv := shutil.which("uv"):
        steps = [
            [base, "-m", "venv", "--without-pip", str(root)],
            [uv, "pip", "install", "-q", "-p", str(py), *NODE_PACKAGES],
        ]
    else:
        steps = [
            [base, "-m", "venv", str(root)],
            [str(py), "-m", "pip", "install", "-q", *NODE_PACKAGES],
        ]
    for cmd in steps:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        if p.returncode != 0:
            pytest.skip(
                f"cannot build the jax-free node venv ({' '.join(cmd[:4])}): {p.stderr[-500:]}"
            )
    probe = subprocess.run([str(py), "-c", "import jax"], capture_output=True)
    assert probe.returncode != 0, "the node venv must not have jax"
    (root / ".complete").write_text("")
    assert py.exists()
    return root


@pytest.fixture(scope="module")
def jax_free_nodes(tmp_path_factory):
    """A SuperLink (the ServerApp's host: this venv, with jax) and N SuperNodes whose
    Flower (and so ClientApp) runs from ``node_venv()``, started once for the apps run
    on it one after another: node ``i`` reads ``node<i>/<round>.npz`` (its data-path is
    a template). Stopped by PID."""
    from fcir.interpreters.flower.local import Deployment

    venv = node_venv()
    root = tmp_path_factory.mktemp("jax-free-nodes")
    paths = [root / f"node{i}" / "{round}.npz" for i in range(N)]
    dep = Deployment(root / "dep", N, paths)
    dep.root.mkdir(parents=True, exist_ok=True)
    dep.cli_home.mkdir(parents=True, exist_ok=True)
    (dep.cli_home / "config.toml").write_text(
        f'[superlink]\ndefault = "local"\n\n[superlink.local]\naddress = "{dep.address}"\ninsecure = true\n'
    )
    try:
        dep.start_superlink()
        for i in range(N):  # the devices: the jax-free venv's Flower runs the ClientApp
            (root / f"node{i}").mkdir()
            home = dep.root / f"home-node{i}"
            home.mkdir()
            env = {
                k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))
            }
            env.update(
                FLWR_HOME=str(home),
                FLWR_TELEMETRY_ENABLED="0",
                FLWR_DISABLE_UPDATE_CHECK="1",
                PATH=f"{venv / 'bin'}{os.pathsep}/usr/bin:/bin",
            )
            # The SuperNode starts flwr-clientapp by name: the jax-free venv's.
            assert shutil.which("flwr-clientapp", path=env["PATH"]) == str(
                venv / "bin" / "flwr-clientapp"
            )
            log = open(dep.root / f"node{i}.log", "ab")  # noqa: SIM115
            dep.procs[f"node-{i}"] = subprocess.Popen(
                [
                    str(venv / "bin" / "flower-supernode"),
                    "--insecure",
                    "--superlink",
                    dep.address,
                    "--port",
                    str(dep.node_ports[i]),
                    "--node-config",
                    f'partition-id={i} num-partitions={N} data-path="{paths[i]}"',
                ],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=home,
                start_new_session=True,
            )
            log.close()
        yield dep
    finally:
        dep.stop()


@pytest.mark.parametrize("name", ["fedavg_mlp", "scan_rounds"])
def test_real_supernodes_without_jax_run_the_app(name, tmp_path, jax_free_nodes):
    """A round (fedavg_mlp), and a whole training program of three rounds in a server
    lax.scan (scan_rounds), on SuperNodes whose Flower (and so ClientApp) runs from a
    venv with only flwr, numpy and iree-base-runtime."""
    from fcir.interpreters.flower.local import env_for

    dep = jax_free_nodes
    r = rounds.corpus_round(name)
    app = flower.export(r.module, tmp_path / "app", inputs=r.server_leaves, device_runtime="iree")
    plan = rounds.plan_of(app)
    for i in range(N):
        np.savez(dep.root.parent / f"node{i}" / f"{plan['round']}.npz", *r.node_leaves(plan, i))
    out = tmp_path / "out.npz"
    p = subprocess.run(
        dep.run_command(app, f'num-server-rounds=1 output="{out}"'),
        env=env_for(dep.cli_home),
        capture_output=True,
        text=True,
        timeout=400,
    )
    logs = "\n".join(dep.log_tail(f"node{i}", 20) for i in range(N))
    assert out.is_file(), f"{p.stdout[-3000:]}\n{logs}"
    assert "ModuleNotFoundError" not in logs
    if "loop" in plan:
        assert "round 3/3: 3/3 clients replied" in p.stdout + p.stderr
    assert_trees_match(files.read_outputs(out), rounds.reference_outputs(r), rtol=1e-5, atol=1e-5)


def test_cli_exports_a_flower_app_with_iree_modules_per_target(tmp_path, capsys):
    from fcir.cli import main

    r = rounds.corpus_round("fedavg_mlp")
    targets = ["--device-target", "llvm-cpu", "--device-target", "aarch64-linux-android34"]
    src = _export_by_cli(r, tmp_path, "app", capsys, *targets)
    (step,) = _client_steps(rounds.plan_of(tmp_path / "app"))
    assert sorted(step["client"]["iree"]["modules"]) == ["aarch64-linux-android34", "llvm-cpu"]
    with pytest.raises(SystemExit) as e:
        main(["export", "--target", "flower", str(src), "-o", "x", "--device-runtime", "tpu"])
    assert e.value.code == 2
