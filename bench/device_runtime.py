"""Client work on IREE vs jax, side by side in one run: what a device installs, how long
a fresh ClientApp process takes to its first reply, the latency of one client step, and
the wall time of a round on a 3-node local Flower deployment.

    python bench/device_runtime.py            # 5 repetitions of each (alternating)
    python bench/device_runtime.py --smoke    # one of each

The round is ``fedavg_mlp`` of tests/corpus (8->16->2 MLP, 3 SGD steps per client)
exported twice with ``fcir export --target flower``: ``--device-runtime jax`` and
``--device-runtime iree``. Measured:

- node install: bytes on disk of the packages a node needs beyond Python, summed over
  the installed files of each distribution and its requirements (flwr's closure is the
  same for both, so it is shown separately): jax + jaxlib + numpy closure vs
  iree-base-runtime + numpy closure. Plus ``du`` of the jax-free test venv when the
  tests built one.
- cold start: a fresh Python process that loads the app's ClientApp code and runs one
  client step on the node's data and a recorded server message, from spawn to the
  result on stdout (what each Flower message costs a node: every message starts a
  fresh ClientApp process). Both sides start the same way: the same child script, the
  same recorded message and data, each in a node venv built the same way from what its
  app's pyproject.toml tells a node to install (flwr, numpy, and jax or
  iree-base-runtime; ml_dtypes below 0.7 on both, as the IREE app asks: 0.7.0 takes
  ~2 s to import on numpy 2.4, a pip resolution that would otherwise be billed to jax).
  Repetitions alternate jax/IREE (and which goes first), after one warm-up pair; the
  load average is recorded with every sample.
- per-call latency: one client step in a warm process, median of 200 calls, jax's
  compiled artifact vs the IREE module, same inputs.
- round wall: ``flwr run APP local --stream`` of each app on one deployment (one
  SuperLink, 3 SuperNodes), alternating, after one warm-up run each.

Goals: node install <= 1/4 of jax's, cold start >= 50x faster, round wall
<= 1.1x jax's. JSON with every sample in bench/results/device_runtime-[smoke-]<time>.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib
import os
import pathlib
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from importlib import metadata

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

import _record  # noqa: E402
import numpy as np  # noqa: E402
from fcir.interpreters import flower  # noqa: E402
from fcir.interpreters.flower.local import Deployment, env_for  # noqa: E402
from flowerlib import inprocess, rounds  # noqa: E402

ROUND_LINE = re.compile(r"\[fcir\] round 1\S*: .*?(\d+\.\d) s")

CHILD = r"""
import time
t0, c0 = time.perf_counter(), time.process_time()
import importlib.util, pathlib, sys, types
import numpy as np
appdir, sent, data, step = sys.argv[1:]
pkg = pathlib.Path(appdir) / "fcir_app"
spec = importlib.util.spec_from_file_location("fcir_app", pkg / "__init__.py",
                                              submodule_search_locations=[str(pkg)])
mod = importlib.util.module_from_spec(spec); sys.modules["fcir_app"] = mod
spec.loader.exec_module(mod)
import fcir_app.client_app as client
with np.load(sent) as f:
    values = {k.replace("|", "/"): f[k] for k in f.files}
ctx = types.SimpleNamespace(node_id=1, node_config={"data-path": data, "partition-id": 0},
                            run_config={})  # the ClientApp reads dataset / data-dir there
t1, c1 = time.perf_counter(), time.process_time()
res = client.compute(int(step), values, ctx)
t2, c2 = time.perf_counter(), time.process_time()
print("reply", len(res), t1 - t0, t2 - t1, c2 - c1, flush=True)
print("jax loaded" if "jax" in sys.modules else "no jax", flush=True)
"""


def _closure(*dists: str) -> set[str]:
    seen: set[str] = set()
    todo = list(dists)
    while todo:
        name = re.split(r"[ ;<>=!~\[(]", todo.pop(), maxsplit=1)[0].lower().replace("_", "-")
        if name in seen:
            continue
        try:
            reqs = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        seen.add(name)
        todo += [r for r in reqs if "extra ==" not in r]
    return seen


def _installed_bytes(names: set[str]) -> int:
    total = 0
    for name in names:
        dist = metadata.distribution(name)
        for f in dist.files or ():
            p = pathlib.Path(dist.locate_file(f))
            if p.is_file():
                total += p.stat().st_size
    return total


def _du(path: pathlib.Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def install_sizes() -> dict:
    flwr = _closure("flwr")
    jax = _closure("jax", "jaxlib", "numpy") - flwr
    iree = _closure("iree-base-runtime", "numpy") - flwr
    out = {
        "flwr_closure_bytes": _installed_bytes(flwr),
        "jax_node_bytes": _installed_bytes(jax),
        "iree_node_bytes": _installed_bytes(iree),
        "jax_node_packages": sorted(jax),
        "iree_node_packages": sorted(iree),
    }
    venv = next(pathlib.Path(tempfile.gettempdir()).glob("fcir-iree-node-venv-*/.complete"), None)
    if venv is not None:
        out["jax_free_test_venv_bytes"] = _du(venv.parent)
    return out


def node_venv(runtime: str) -> pathlib.Path:
    """A venv with only what a ``runtime`` app's pyproject.toml tells a node to install
    (ml_dtypes pinned below 0.7 on both sides, see the module doc), built once under the
    temp dir."""
    import tomllib

    from fcir.interpreters.flower.app_writer import _pyproject

    deps = tomllib.loads(_pyproject("x", runtime))["project"]["dependencies"]
    deps = [d for d in deps if not d.startswith("ml_dtypes")] + ["ml_dtypes>=0.5,<0.7"]
    tag = hashlib.sha256(f"{sys.version}{deps}".encode()).hexdigest()[:12]
    root = pathlib.Path(tempfile.gettempdir()) / f"fcir-device-bench-{runtime}-venv-{tag}"
    if (root / ".complete").is_file():
        return root
    shutil.rmtree(root, ignore_errors=True)
    base = getattr(sys, "_base_executable", sys.executable)
    print(f"building the {runtime} node venv ({', '.join(deps)}) at {root}", flush=True)
    for cmd in (
        [base, "-m", "venv", str(root)],
        [str(root / "bin" / "python"), "-m", "pip", "install", "-q", *deps],
    ):
        subprocess.run(cmd, check=True, capture_output=True, timeout=1800)
    (root / ".complete").write_text("")
    return root


def record_message(app, nodes) -> tuple[int, dict]:
    """The first message's (step, values) the ServerApp sends a node, in process."""
    seen = []
    real = inprocess.load_app

    def load_app(appdir):
        ns = real(appdir)
        compute = ns.client.compute

        def recording(step_index, values, context, *rest):
            seen.append((step_index, dict(values)))
            return compute(step_index, values, context, *rest)

        ns.client.compute = recording
        return ns

    inprocess.load_app = load_app
    try:
        inprocess.run(app, nodes, {"output": ""})
    finally:
        inprocess.load_app = real
    return seen[0]


def cold_start(python: str, app, sent, data, step) -> tuple[float, float, float, float]:
    """(spawn to reply, the child's import of the ClientApp code with flwr, its first
    client step: the device runtime's import, compile or load, and the call; and that
    step's CPU time, all its threads: under a shared machine's load the wall time
    is mostly waiting for a core)."""
    start = time.perf_counter()
    proc = subprocess.Popen(
        [python, "-c", CHILD, str(app), str(sent), str(data), str(step)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    line = proc.stdout.readline()
    elapsed = time.perf_counter() - start
    rest, err = proc.communicate(timeout=300)
    if not line.startswith("reply"):
        raise RuntimeError(f"client process failed: {line}{rest}{err[-2000:]}")
    _, _, imports, first, cpu = line.split()
    return elapsed, float(imports), float(first), float(cpu)


def per_call(apps, step, values, data_leaves, n: int) -> dict:
    out = {}
    for runtime, app in apps.items():
        ns = inprocess.load_app(app)
        plan = ns.client.runtime.plan()
        part = plan["steps"][step]["client"]
        env = {("arg", str(s["leaf"])): x for s, x in zip(plan["client_inputs"], data_leaves)}
        for k, x in values.items():
            g, _, name = k.partition("/")
            env[(g, name)] = x
        args = [env[tuple(p)] for p in part["params"]]
        if runtime == "iree":
            pkg = ns.client.__name__.rsplit(".", 1)[0]
            rt = importlib.import_module(pkg + ".runtime")
            ir = importlib.import_module(pkg + ".iree_runtime")
            entry = part["iree"]
            key = entry["modules"][ir.pick_target(entry["modules"], entry["host_arch"])]["file"]
            module = ir.Module(rt.artifact_bytes(key))
            call = lambda: module(*args)
        else:
            fn = ns.client.runtime.compiled(part["artifact"])
            call = lambda: [np.asarray(y) for y in fn(*args)]
        for _ in range(20):
            call()
        times = []
        for _ in range(n):
            t = time.perf_counter()
            call()
            times.append(time.perf_counter() - t)
        out[runtime] = times
    return out


def run_round(dep, app, out) -> tuple[float, float | None]:
    start = time.perf_counter()
    proc = subprocess.run(
        dep.run_command(app, f'num-server-rounds=1 output="{out}"'),
        env=env_for(dep.cli_home),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    wall = time.perf_counter() - start
    text = proc.stdout + proc.stderr
    if not pathlib.Path(out).is_file():
        raise RuntimeError(f"flwr run {app} failed:\n{text[-3000:]}")
    m = ROUND_LINE.search(text)
    return wall, float(m.group(1)) if m else None


def _spread(xs, scale=1.0, unit="") -> str:
    return (
        f"median {statistics.median(xs) * scale:.3g}{unit} "
        f"(min {min(xs) * scale:.3g}, max {max(xs) * scale:.3g}, n={len(xs)})"
    )


RUNTIMES = ("jax", "iree")


def alternating(k: int) -> tuple[str, str]:
    """The runtimes in repetition ``k``'s order: which goes first alternates."""
    return RUNTIMES if k % 2 == 0 else RUNTIMES[::-1]


@dataclasses.dataclass
class Setup:
    """The round exported for each runtime, its nodes' data and the first message the
    ServerApp sends a node, recorded once to replay in every cold start."""

    round: rounds.Round
    plan: dict
    apps: dict[str, pathlib.Path]  # runtime -> app folder
    nodes: dict[int, dict]  # node id -> node config (partition, data path)
    data: list[pathlib.Path]  # each node's data path, as the deployment is given it
    step: int
    values: dict
    sent: pathlib.Path  # ``values``, saved for the child process


def set_up(work: pathlib.Path) -> Setup:
    r = rounds.corpus_round("fedavg_mlp")
    apps = {
        rt: flower.export(r.module, work / rt, inputs=r.server_leaves, device_runtime=rt)
        for rt in RUNTIMES
    }
    plan = rounds.plan_of(apps["iree"])
    nodes, data = {}, []
    for i in range(rounds.NODES):
        (work / f"node{i}").mkdir()
        p = work / f"node{i}" / "fedavg_mlp.npz"
        np.savez(p, *r.node_leaves(plan, i))
        data.append(work / f"node{i}" / "{round}.npz")
        nodes[100 + i] = {"partition-id": i, "data-path": str(p)}
    step, values = record_message(apps["iree"], nodes)
    sent = work / "sent.npz"
    np.savez(sent, **{k.replace("/", "|"): v for k, v in values.items()})
    return Setup(r, plan, apps, nodes, data, step, values, sent)


def node_pythons(sizes: dict) -> dict[str, str]:
    """Each runtime's node venv's Python (built if need be, checked to have jax or not);
    adds the venvs' sizes on disk to ``sizes``."""
    venvs = {rt: node_venv(rt) for rt in RUNTIMES}
    pythons = {rt: str(v / "bin" / "python") for rt, v in venvs.items()}
    for rt, py in pythons.items():
        has_jax = subprocess.run([py, "-c", "import jax"], capture_output=True).returncode == 0
        assert has_jax == (rt == "jax"), (rt, py)
        sizes[f"{rt}_node_venv_bytes"] = _du(venvs[rt])
    return pythons


def per_runtime() -> dict[str, list]:
    return {rt: [] for rt in RUNTIMES}


@dataclasses.dataclass
class ColdStarts:
    """Seconds per runtime of every measured cold start (see cold_start), and the
    1-minute load average after each."""

    total: dict[str, list] = dataclasses.field(default_factory=per_runtime)
    imports: dict[str, list] = dataclasses.field(default_factory=per_runtime)
    first: dict[str, list] = dataclasses.field(default_factory=per_runtime)
    first_cpu: dict[str, list] = dataclasses.field(default_factory=per_runtime)
    load: list[float] = dataclasses.field(default_factory=list)


def measure_cold_starts(
    setup: Setup, pythons: dict[str, str], reps: int, smoke: bool
) -> ColdStarts:
    out = ColdStarts()
    for k in range(reps if smoke else reps + 1):  # rep 0 warms the page cache
        for rt in alternating(k):
            t, imp, f, cpu = cold_start(
                pythons[rt], setup.apps[rt], setup.sent, setup.nodes[100]["data-path"], setup.step
            )
            if smoke or k > 0:
                out.first_cpu[rt].append(cpu)
                out.total[rt].append(t)
                out.imports[rt].append(imp)
                out.first[rt].append(f)
                out.load.append(os.getloadavg()[0])
    return out


def measure_rounds(
    work: pathlib.Path, setup: Setup, reps: int, smoke: bool
) -> tuple[dict, dict, float]:
    """Each app's round on one local deployment, alternating: the wall times, the
    ServerApp's own round times, and the largest difference between the two apps'
    outputs."""
    walls, rounds_s = per_runtime(), per_runtime()
    with Deployment(work / "deployment", rounds.NODES, setup.data) as dep:
        if not smoke:
            for rt in RUNTIMES:
                run_round(dep, setup.apps[rt], work / f"warm-{rt}.npz")
        for k in range(reps):
            for rt in alternating(k):
                wall, rnd = run_round(dep, setup.apps[rt], work / f"{rt}-{k}.npz")
                walls[rt].append(wall)
                if rnd is not None:
                    rounds_s[rt].append(rnd)
                print(f"rep {k}: {rt} round wall {wall:.1f} s (ServerApp: {rnd} s)", flush=True)
    with np.load(work / "jax-0.npz") as j, np.load(work / "iree-0.npz") as i:
        max_diff = max(float(np.max(np.abs(j[k] - i[k]))) for k in j.files)
    return walls, rounds_s, max_diff


def print_sizes(sizes: dict) -> None:
    mib = 2**20
    print(
        f"node install (beyond flwr's {sizes['flwr_closure_bytes'] / mib:.0f} MiB, same for both):"
    )
    print(
        f"  jax  {sizes['jax_node_bytes'] / mib:8.1f} MiB  {', '.join(sizes['jax_node_packages'])}"
    )
    print(
        f"  iree {sizes['iree_node_bytes'] / mib:8.1f} MiB  {', '.join(sizes['iree_node_packages'])}"
    )
    ratio = sizes["iree_node_bytes"] / sizes["jax_node_bytes"]
    print(f"  iree/jax {ratio:.3f} (goal <= 0.25)")
    if "jax_free_test_venv_bytes" in sizes:
        print(
            f"  the jax-free test venv (flwr, numpy, iree-base-runtime, pip): "
            f"{sizes['jax_free_test_venv_bytes'] / mib:.0f} MiB on disk"
        )
    print(
        f"  the node venvs on disk (flwr, pip and python included): jax "
        f"{sizes['jax_node_venv_bytes'] / mib:.0f} MiB, iree "
        f"{sizes['iree_node_venv_bytes'] / mib:.0f} MiB"
    )


def print_cold_starts(cold: ColdStarts, pythons: dict[str, str]) -> None:
    print(
        f"cold start, spawn to first reply (a fresh ClientApp process; 1-min load "
        f"{min(cold.load):.1f}-{max(cold.load):.1f} over the samples):"
    )
    for rt in RUNTIMES:
        print(f"  {rt:<4} {_spread(cold.total[rt], 1e3, ' ms')}  [{pythons[rt]}]")
    ratios = [j / i for j, i in zip(cold.total["jax"], cold.total["iree"])]
    print(f"  jax/iree {_spread(ratios)}")
    print("  of which importing the ClientApp code (flwr, numpy):")
    for rt in RUNTIMES:
        print(f"    {rt:<4} {_spread(cold.imports[rt], 1e3, ' ms')}")
    print("  of which the first client step (runtime import, compile or load, call):")
    for rt in RUNTIMES:
        print(f"    {rt:<4} {_spread(cold.first[rt], 1e3, ' ms')}")
    fr = [j / i for j, i in zip(cold.first["jax"], cold.first["iree"])]
    print(f"    jax/iree {_spread(fr)} (goal >= 50)")
    print("  the first client step's CPU time (all threads; robust to the machine's load):")
    for rt in RUNTIMES:
        print(f"    {rt:<4} {_spread(cold.first_cpu[rt], 1e3, ' ms')}")
    cr = [j / i for j, i in zip(cold.first_cpu["jax"], cold.first_cpu["iree"])]
    print(f"    jax/iree {_spread(cr)}")


def print_calls_and_rounds(calls: dict, walls: dict, max_diff: float) -> None:
    print("per-call latency of one client step (warm process):")
    for rt in RUNTIMES:
        print(f"  {rt:<4} {_spread(calls[rt], 1e6, ' us')}")
    print("round wall (flwr run, 3 SuperNodes):")
    for rt in RUNTIMES:
        print(f"  {rt:<4} {_spread(walls[rt], 1, ' s')}")
    wr = [i / j for i, j in zip(walls["iree"], walls["jax"])]
    print(f"  iree/jax {_spread(wr)} (goal <= 1.1)")
    print(f"max |iree - jax| over the round's outputs: {max_diff:.2e}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="one repetition of each, no warm-up")
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    reps = 1 if a.smoke else a.reps
    work = pathlib.Path(tempfile.mkdtemp(prefix="fcir-device-bench-"))
    try:
        setup = set_up(work)
        sizes = install_sizes()
        pythons = node_pythons(sizes)
        cold = measure_cold_starts(setup, pythons, reps, a.smoke)
        leaves = setup.round.node_leaves(setup.plan, 0)
        calls = per_call(setup.apps, setup.step, setup.values, leaves, 20 if a.smoke else 200)
        walls, rounds_s, max_diff = measure_rounds(work, setup, reps, a.smoke)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    print()
    print_sizes(sizes)
    print_cold_starts(cold, pythons)
    print_calls_and_rounds(calls, walls, max_diff)
    print(f"load: {os.getloadavg()}")
    _record.write(
        ROOT / "bench" / "results",
        "device_runtime",
        {
            "sizes": sizes,
            "cold_start_s": cold.total,
            "cold_imports_s": cold.imports,
            "cold_first_step_s": cold.first,
            "cold_loadavg_1min": cold.load,
            "cold_first_step_cpu_s": cold.first_cpu,
            "pythons": pythons,
            "per_call_s": calls,
            "round_wall_s": walls,
            "round_server_s": rounds_s,
            "max_abs_diff": max_diff,
            "versions": _record.versions("flwr", "iree-base-runtime", "iree-base-compiler"),
            "machine": _record.machine(),
            "loadavg": os.getloadavg(),
        },
        tag="smoke" if a.smoke else None,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
