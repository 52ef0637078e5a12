"""``fcir flower simulate``: an exported app on Flower's Simulation Engine (Ray).

A SuperLink in simulation mode (``flower-superlink --simulation``) on a free port, with
its own ``FLWR_HOME``, runs the app through ``flwr run APP FEDERATION --stream
--federation-config 'num-supernodes=N ...'``: the ServerApp in a ``flwr-simulation``
process, the ClientApps in Ray actors. Virtual node ``i`` has node config
``partition-id=i`` and no ``data-path``, so the run config ``data-dir`` names the folder
its data comes from (``data-dir/node<i>.npz``, or ``data-dir/node<i>/<round>.npz``),
as ``fcir flower up --data`` lays it out. Replies are combined in partition-id order,
so the outputs are bit for bit those of the same app on a deployment.

Sized for a small machine: Ray gets ``actors`` CPUs and each ClientApp one, so at most
``actors`` ClientApps run at once (each a Ray worker process holding jax); Ray's
object store takes 5% of memory instead of 30%, and its memory monitor kills workers
only above 98% host memory (``RAY_memory_usage_threshold``; its default, 95%, is
reached on a shared machine by other people's processes); it starts no idle workers
ahead of the actors. Environment variables of the same names override these.

Ray gives its node 30 s to start (a constant in Ray); on a machine whose CPUs are busy
with other work it can take longer, and the run then fails before any ClientApp exists.
Such a run is started again on a fresh SuperLink, up to ``RAY_START_TRIES`` times in
all, with a line saying so; any other failure is returned as it is.

The SuperLink, and so the ServerApp, runs in the folder the command was started in: a
relative path the ServerApp writes (an exported app's ``final_model.npz``, a user's own
``np.savez("final_model.npz", ...)``) lands there, as in Flower's own local simulation
started from that folder.

``flwr run`` leaves nothing running here: the SuperLink (and the flwr-simulation and
Ray processes under it) is stopped when the run ends, and every process whose
environment names this simulation's ``FLWR_HOME`` is stopped by PID. Nor anything
on disk: the SuperLink's home (``fcir-simulate-*`` in the temporary folder) is
removed, unless ``root`` (``--dir``) names a folder to keep.
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import signal
import sys
import tempfile
import time

from fcir.errors import FcirError

from .local import Deployment, DeploymentError, RunResult, _bin, env_for, flwr_run

FEDERATION = "simulation"

RAY_DEFAULTS = {
    "RAY_memory_usage_threshold": "0.98",
    "RAY_DEFAULT_OBJECT_STORE_MEMORY_PROPORTION": "0.05",
    "RAY_DEDUP_LOGS": "0",
    "RAY_USAGE_STATS_ENABLED": "0",
    # Ray's FutureWarning about a future default for accelerator env vars (no GPU here).
    "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0",
    # Ray starts a Python worker per CPU ahead of the first task; Flower's actors ask for
    # a runtime environment (PYTHONPATH) those workers were not started with, so none is
    # ever used: two processes and ~2 CPU seconds per run for nothing (measured).
    "RAY_enable_worker_prestart": "0",
    "RAY_prestart_worker_first_driver": "0",
}

# Lines of a simulation's log that say nothing to an fcir user: Flower's notes on its
# default federation size (--nodes sets it) with the flwr command that would change
# it, and its shutdown of the actors.
QUIET = (
    re.compile(r"default simulated SuperNodes changed from"),
    re.compile(r"To change federation size, use the following command"),
    re.compile(r"\sflwr federation simulation-config "),
    re.compile(r"Manually terminating ClientAppActor"),
)


class Quiet:
    """``echo`` without the lines QUIET matches."""

    def __init__(self, out):
        self.out = out

    def write(self, line: str) -> None:
        if not any(p.search(line) for p in QUIET):
            self.out.write(line)

    def flush(self) -> None:
        self.out.flush()


# JAX warns at every fork once its runtime runs, and a user's ServerApp module may run
# JAX when it is imported (the template's task.py draws its PRNG key), before the
# Simulation Engine starts Ray, which starts each of its processes by fork and exec with
# a preexec_fn that only blocks SIGINT: nothing of JAX runs in those children. Such
# forks are subprocess's (the warning names that module); a fork that goes on running
# Python (multiprocessing, os.fork) is another module's and still warns.
QUIET_FORKS = "ignore:os.fork() was called:RuntimeWarning:subprocess"


class SimulationLink(Deployment):
    """A SuperLink that runs apps on the Simulation Engine (no SuperNode processes), in
    ``workdir``: the ServerApp's relative paths are taken from there."""

    SUPERLINK_FLAGS = ("--simulation", "--isolation", "subprocess")

    def __init__(self, root, workdir=None):
        super().__init__(root, 0)
        self.workdir = pathlib.Path(workdir or pathlib.Path.cwd()).resolve()

    def process_env(self, home: pathlib.Path) -> dict:
        env = super().process_env(home)
        for k, v in RAY_DEFAULTS.items():
            env[k] = os.environ.get(k, v)
        env["PYTHONWARNINGS"] = ",".join(filter(None, [env.get("PYTHONWARNINGS"), QUIET_FORKS]))
        return env

    def start(self) -> SimulationLink:
        self.root.mkdir(parents=True, exist_ok=True)
        self.cli_home.mkdir(parents=True, exist_ok=True)
        (self.cli_home / "config.toml").write_text(
            f'[superlink]\ndefault = "{FEDERATION}"\n\n'
            f'[superlink.{FEDERATION}]\naddress = "{self.address}"\ninsecure = true\n'
        )
        try:
            self.start_superlink()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self, grace: float = 10) -> None:
        super().stop(grace)
        _stop_stragglers(self.root, grace)


def _pids_with_home_under(root: pathlib.Path) -> list[int]:
    """PIDs whose FLWR_HOME lies under ``root``: what this simulation started (Ray's
    processes inherit the environment of the flwr-simulation process that starts Ray)."""
    mark = f"FLWR_HOME={root}".encode()
    pids = []
    for proc in pathlib.Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            env = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(e.startswith(mark) for e in env):
            pids.append(int(proc.name))
    return pids


def _stop_stragglers(root: pathlib.Path, grace: float) -> None:
    """SIGTERM, then SIGKILL, to the processes started under ``root`` that outlived
    the SuperLink (a Ray worker whose raylet died first)."""
    pids = _pids_with_home_under(root)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace
        while pids and time.monotonic() < deadline:
            pids = [p for p in pids if pathlib.Path(f"/proc/{p}").exists() and not _zombie(p)]
            time.sleep(0.2)
        if not pids:
            return


def _zombie(pid: int) -> bool:
    try:
        return pathlib.Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z")
    except (OSError, IndexError):
        return False


# Run config keys whose value is a file or folder the ServerApp reads or writes.
PATH_KEYS = ("output", "inputs", "metrics-file", "checkpoint-dir", "dataset")


def absolute_paths(run_config: str, cwd) -> str:
    """``run_config`` with each relative path of ``PATH_KEYS`` (a quoted value) taken
    from ``cwd``, the folder the command was started in (``output="none"`` stays): the
    ServerApp runs there, but the ClientApps run in Ray's workers, which need not."""

    def fix(m: re.Match) -> str:
        key, value = m.group(2), m.group(3)
        if not value or os.path.isabs(value) or (key == "output" and value == "none"):
            return m.group(0)
        return f'{m.group(1)}{key}="{pathlib.Path(cwd, value)}"'

    keys = "|".join(re.escape(k) for k in PATH_KEYS)
    return re.sub(rf'(^|\s)({keys})\s*=\s*"([^"]*)"', fix, run_config or "")


def data_dir(data, nodes: int) -> pathlib.Path:
    """``data`` as an absolute folder holding node<i>.npz (or node<i>/) for every node."""
    root = pathlib.Path(data).resolve()
    if not root.is_dir():
        raise FcirError(f"--data {data} is not a folder")
    for i in range(nodes):
        if not ((root / f"node{i}").is_dir() or (root / f"node{i}.npz").is_file()):
            raise FcirError(
                f"no data for node {i}: put node{i}.npz (or a node{i}/ folder of "
                f"<round>.npz files) in {root}"
            )
    return root


def simulate(
    app,
    nodes: int,
    data=None,
    run_config: str = "",
    *,
    actors: int | None = None,
    root=None,
    echo=sys.stdout,
    timeout: float | None = None,
) -> RunResult:
    """Runs ``app`` on ``nodes`` virtual SuperNodes of the Simulation Engine; returns
    how the run ended (``.ok``; ``.failure()`` says why not). Stops everything it
    started before returning."""
    try:
        import ray  # noqa: F401
    except ImportError:
        raise DeploymentError(
            "the Simulation Engine needs Ray: pip install -e '.[flower]' in the fcir "
            "checkout (or pip install 'flwr[simulation]==1.42.0')"
        ) from None
    if nodes < 1:
        raise FcirError("--nodes must be at least 1")
    actors = actors or max(1, min(2, os.cpu_count() or 1))
    app = pathlib.Path(app).resolve()
    if not (app / "pyproject.toml").is_file():
        raise FcirError(f"{app} is not an app directory (no pyproject.toml): export one first")
    config = absolute_paths(run_config, pathlib.Path.cwd())
    if data is not None:
        config = f'data-dir="{data_dir(data, nodes)}" {config}'.strip()
    federation_config = (
        f"num-supernodes={nodes} client-resources-num-cpus=1 init-args-num-cpus={actors}"
    )
    made = root is None  # a folder of this run's own, removed when it ends
    root = pathlib.Path(root or tempfile.mkdtemp(prefix="fcir-simulate-")).resolve()
    try:
        return _run(cmd_for(app, federation_config, config), root, echo, timeout)
    finally:
        if made:
            shutil.rmtree(root, ignore_errors=True)


def cmd_for(app: pathlib.Path, federation_config: str, config: str) -> list[str]:
    """``flwr run APP simulation --stream`` with the federation and run configs."""
    cmd = [
        _bin("flwr"),
        "run",
        str(app),
        FEDERATION,
        "--stream",
        "--federation-config",
        federation_config,
    ]
    if config:
        cmd += ["--run-config", config]
    return cmd


def _run(cmd: list[str], root: pathlib.Path, echo, timeout) -> RunResult:
    """The run on a SuperLink under ``root``, started again while Ray did not start."""
    echo = None if echo is None else Quiet(echo)
    for attempt in range(1, RAY_START_TRIES + 1):
        # Each try on a SuperLink of its own, in a folder of its own under ``root``.
        home = root if attempt == 1 else root / f"try{attempt}"
        link = SimulationLink(home)
        link.start()
        try:
            result = flwr_run(cmd, env_for(link.cli_home), FEDERATION, echo=echo, timeout=timeout)
        finally:
            link.stop()
        if result.ok or not ray_did_not_start(result) or attempt == RAY_START_TRIES:
            return result
        notice = (
            f"fcir: Ray did not start within its 30 s (a busy machine?); no ClientApp "
            f"ran, so the run starts again ({attempt + 1} of {RAY_START_TRIES})\n"
        )
        (echo or sys.stderr).write(notice)


# How often ``simulate`` starts a run whose Ray did not come up (see ray_did_not_start).
RAY_START_TRIES = 3

# What Ray raises when its raylet has not registered within 30 s (a constant in Ray's
# node.py): on a machine whose CPUs are busy with other work, Ray's own start-up is what
# fails, before any ClientApp exists.
_RAY_START_TIMEOUT = "The current node timed out during startup"


def ray_did_not_start(result: RunResult) -> bool:
    """Whether a failed run failed because Ray's node did not start in time: the
    Simulation Engine then stops before it runs any ClientApp, so no round could have
    finished and nothing was released; starting the run again is safe."""
    return not result.ok and _RAY_START_TIMEOUT in result.log
