"""A Flower deployment on localhost: one SuperLink and N SuperNodes, each its own process
with its own free port and its own FLWR_HOME, stopped by PID.

Used by ``fcir flower up`` and by the tests. ``flwr run APPDIR local`` reaches it with
``FLWR_HOME`` set to ``cli_home`` (whose config.toml names the SuperLink).
"""

from __future__ import annotations

import atexit
import dataclasses
import importlib.util
import json
import os
import pathlib
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

from fcir.errors import FcirError

from .certs import Certificates, make

FEDERATION = "local"


class DeploymentError(FcirError):
    """A SuperLink or SuperNode did not start, or flwr is not installed."""


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    """``sig`` to ``proc``'s session (it and the children it started), if still there."""
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def _terminate(procs: list[subprocess.Popen], grace: float) -> None:
    """SIGTERM to every live process group at once, then SIGKILL whatever is left after
    ``grace`` seconds."""
    live = [p for p in procs if p.poll() is None]
    for proc in live:
        _signal_group(proc, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for proc in live:
        try:
            proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal_group(proc, signal.SIGKILL)
            proc.wait(5)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _bin_dir() -> pathlib.Path:
    """A folder of Flower's commands bound to this Python.

    The SuperLink and SuperNodes start flower-superexec, flwr-serverapp and
    flwr-clientapp by name: whichever comes first on PATH runs the apps. A shim or
    another environment there would run the ServerApp without this fcir (and its
    checkpoints), so every Flower command of the deployment is a wrapper that runs
    its entry point with ``sys.executable``.
    """
    from importlib.metadata import entry_points

    scripts = [e for e in entry_points(group="console_scripts") if e.value.startswith("flwr")]
    if not scripts:
        raise DeploymentError(
            "Flower is not installed beside fcir: pip install -e '.[flower]' in the fcir "
            "checkout (or pip install flwr==1.42.0)"
        )
    folder = pathlib.Path(tempfile.gettempdir()) / f"fcir-flower-bin-{os.getuid()}-{os.getpid()}"
    folder.mkdir(exist_ok=True)
    atexit.register(shutil.rmtree, folder, True)
    for e in scripts:
        module, _, func = e.value.partition(":")
        path = folder / e.name
        # -P: the folder the process runs in (a simulation's: where the user started
        # it) stays off sys.path, so a file there named like a module shadows nothing.
        path.write_text(
            "#!/bin/sh\n"
            f"exec {shlex.quote(sys.executable)} -P -c "
            f"{shlex.quote(f'import sys; from {module} import {func} as f; sys.argv[0] = {e.name!r}; sys.exit(f())')}"
            ' "$@"\n'
        )
        path.chmod(0o755)
    return folder


_BIN: pathlib.Path | None = None


def _bin(name: str) -> str:
    global _BIN
    if _BIN is None:
        _BIN = _bin_dir()
    return str(_BIN / name)


# The shared compilation cache's size limit: what makes JAX lock its entries (env_for);
# far above what a deployment's or simulation's rounds compile.
JAX_CACHE_BYTES = 4 * 2**30


def env_for(home: pathlib.Path, jax_cache: pathlib.Path | None = None) -> dict:
    env = dict(os.environ)
    if jax_cache is not None:
        # Every message starts a fresh ClientApp process that compiles client work
        # again; a persistent compilation cache shared by the local processes makes
        # that a read from disk after the first time.
        env["JAX_COMPILATION_CACHE_DIR"] = str(jax_cache)
        env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
        env["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
        if importlib.util.find_spec("filelock") is not None:
            # Several processes compile the same computation at once (the nodes of a
            # round, a simulation's actors). Without a size limit JAX writes an entry
            # in place and reads it without a lock, so a reader can get one half
            # written ("Error reading persistent compilation cache entry ... Error -5
            # while decompressing data"); with a limit it takes a file lock around
            # each read and write (filelock, which Ray needs: always there for a
            # simulation).
            env["JAX_COMPILATION_CACHE_MAX_SIZE"] = str(JAX_CACHE_BYTES)
    env["FLWR_HOME"] = str(home)
    env["FLWR_TELEMETRY_ENABLED"] = "0"
    env["FLWR_DISABLE_UPDATE_CHECK"] = "1"
    env["PATH"] = f"{pathlib.Path(_bin('flwr')).parent}{os.pathsep}{env.get('PATH', '')}"
    env.setdefault("JAX_PLATFORMS", "cpu")
    return env


class Deployment:
    """``nodes`` SuperNodes; ``data[i]`` (optional) is node i's ``data-path``."""

    SUPERLINK_FLAGS: tuple[str, ...] = ()  # more flags for flower-superlink
    # The folder the processes run in (None: each its own home); the ServerApp runs in
    # its SuperLink's, so a relative path it writes lands there.
    workdir: pathlib.Path | None = None

    def __init__(self, root, nodes: int, data: list | None = None, *, tls: bool = False):
        self.tls = tls
        self.root = pathlib.Path(root).resolve()
        self.nodes = nodes
        self.data = list(data) if data is not None else [None] * nodes
        self.port = free_port()
        self.node_ports = [free_port() for _ in range(nodes)]
        self.procs: dict[str, subprocess.Popen] = {}
        self.cli_home = self.root / "home-cli"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def process_env(self, home: pathlib.Path) -> dict:
        return env_for(home, self.root / "jax-cache")

    def _spawn(self, name: str, cmd: list[str]) -> None:
        home = self.root / f"home-{name}"
        home.mkdir(parents=True, exist_ok=True)
        log = open(self.root / f"{name}.log", "ab")  # noqa: SIM115  (the child owns it)
        try:
            self.procs[name] = subprocess.Popen(
                cmd, env=self.process_env(home), stdout=log, stderr=subprocess.STDOUT,
                cwd=self.workdir or home,
                start_new_session=True,  # Ctrl-C in a terminal reaches only us; we stop them
            )
        finally:
            log.close()

    @property
    def certificates(self):
        """The localhost CA and the SuperLink's certificate (``tls=True``), made once."""
        folder = self.root / "certificates"
        if not (folder / "server.key").is_file():
            return make(folder)
        return Certificates(folder / "ca.pem", folder / "server.pem", folder / "server.key")

    def _security(self, server: bool) -> list[str]:
        if not self.tls:
            return ["--insecure"]
        c = self.certificates
        if server:
            return ["--ssl-ca-certfile", str(c.ca), "--ssl-certfile", str(c.cert),
                    "--ssl-keyfile", str(c.key)]
        return ["--root-certificates", str(c.ca)]

    def _healthy(self) -> bool:
        import ssl

        scheme, context = "http", None
        if self.tls:
            scheme, context = "https", ssl.create_default_context(cafile=str(self.certificates.ca))
        try:
            with urllib.request.urlopen(f"{scheme}://{self.address}/health", timeout=2, context=context):
                return True
        except OSError:
            return False

    def start_superlink(self, timeout: float = 60) -> None:
        self._spawn(
            "superlink",
            [
                _bin("flower-superlink"),
                *self._security(server=True),
                "--disable-runtime-dependency-installation",
                "--host", "127.0.0.1",
                "--port", str(self.port),
                *self.SUPERLINK_FLAGS,
            ],
        )
        deadline = time.monotonic() + timeout
        while True:
            if self._healthy():
                return
            proc = self.procs["superlink"]
            if proc.poll() is not None or time.monotonic() > deadline:
                raise DeploymentError(
                    f"the SuperLink on {self.address} did not come up: {self.log_tail('superlink')}"
                )
            time.sleep(0.3)

    def start_supernode(self, i: int) -> None:
        config = f"partition-id={i} num-partitions={self.nodes}"
        if self.data[i] is not None:
            config += f' data-path="{pathlib.Path(self.data[i]).resolve()}"'
        self._spawn(
            f"supernode-{i}",
            [
                _bin("flower-supernode"),
                *self._security(server=False),
                "--superlink", self.address,
                "--port", str(self.node_ports[i]),
                "--node-config", config,
            ],
        )

    def start(self) -> Deployment:
        self.root.mkdir(parents=True, exist_ok=True)
        self.cli_home.mkdir(parents=True, exist_ok=True)
        (self.cli_home / "config.toml").write_text(
            f'[superlink]\ndefault = "{FEDERATION}"\n\n'
            f'[superlink.{FEDERATION}]\naddress = "{self.address}"\n'
            + (f'root-certificates = "{self.certificates.ca}"\n' if self.tls else "insecure = true\n")
        )
        try:
            self.start_superlink()
            for i in range(self.nodes):
                self.start_supernode(i)
        except BaseException:
            self.stop()
            raise
        return self

    def stop_one(self, name: str, grace: float = 10) -> None:
        """SIGTERM to ``name``'s process (and its children, its session), then SIGKILL."""
        proc = self.procs.pop(name, None)
        if proc is not None:
            _terminate([proc], grace)

    def kill_one(self, name: str) -> None:
        """SIGKILL, as a crash: nothing gets to clean up."""
        proc = self.procs.pop(name)
        _signal_group(proc, signal.SIGKILL)
        proc.wait(5)

    def restart(self) -> None:
        """A SuperLink restarted after a crash, and its SuperNodes. The SuperLink keeps
        its state in memory, so the SuperNodes of flwr 1.42 it forgot keep retrying with
        ids it no longer knows: they are restarted to register afresh."""
        self.stop_one("superlink")
        self.start_superlink()
        for i in range(self.nodes):
            self.stop_one(f"supernode-{i}")
            self.start_supernode(i)

    def stop(self, grace: float = 10) -> None:
        """SIGTERM to every process at once, then SIGKILL whatever is left after
        ``grace`` seconds. Only the processes this deployment started are touched."""
        procs, self.procs = self.procs, {}
        _terminate(list(procs.values()), grace)

    def __enter__(self) -> Deployment:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def log_tail(self, name: str, lines: int = 15) -> str:
        p = self.root / f"{name}.log"
        text = p.read_text(errors="replace") if p.is_file() else ""
        return "\n".join(text.splitlines()[-lines:])

    def run_command(self, appdir, run_config: str = "") -> list[str]:
        cmd = [_bin("flwr"), "run", str(appdir), FEDERATION, "--stream"]
        if run_config:
            cmd += ["--run-config", run_config]
        return cmd

    def run(self, appdir, run_config: str = "", timeout: float = 300) -> subprocess.CompletedProcess:
        """``flwr run APPDIR local --stream``: waits for the run to end, returns its output."""
        return subprocess.run(
            self.run_command(appdir, run_config),
            env=env_for(self.cli_home),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )


@dataclasses.dataclass
class RunResult:
    """A finished ``flwr run``: its exit code and log, and the run's status as the
    SuperLink records it (``flwr run`` exits 0 even when the ServerApp fails)."""

    code: int
    log: str
    run_id: str | None
    status: str  # "finished:completed", "finished:failed", ... ("" when unknown)
    details: str

    @property
    def ok(self) -> bool:
        return self.code == 0 and self.status == "finished:completed"

    @property
    def said(self) -> str:
        """The status in words: ``finished: completed`` (Flower writes ``finished:completed``)."""
        return self.status.replace(":", ": ", 1)

    def failure(self) -> str:
        """Why the run failed, for a message: the SuperLink's status details, else the
        log's last lines."""
        if self.details:
            return f"{self.said} ({self.details})"
        tail = "\n".join(self.log.strip().splitlines()[-10:])
        return f"{self.said or f'flwr run exited {self.code}'}: {tail}"


_RUN_ID = re.compile(r"Successfully started run (\d+)")


def run_status(run_id: str, federation: str, env: dict, timeout: float = 30) -> tuple[str, str]:
    """``(status, details)`` of run ``run_id`` from ``flwr ls``, once it has finished
    (the log stream can end a moment before the SuperLink records the end)."""
    deadline = time.monotonic() + timeout
    status, details = "", ""
    while True:
        ls = subprocess.run(
            [_bin("flwr"), "ls", federation, "--format", "json"],
            env=env, capture_output=True, text=True, timeout=60, check=False,
        )
        try:
            runs = json.loads(ls.stdout).get("runs", [])
        except ValueError:
            runs = []
        for r in runs:
            if str(r.get("run-id")) == str(run_id):
                status, details = r.get("status", ""), r.get("status-details", "")
        if status.startswith("finished") or time.monotonic() > deadline:
            return status, details
        time.sleep(0.5)


def flwr_run(
    command: list[str], env: dict, federation: str, *, echo=None, timeout: float | None = None
) -> RunResult:
    """Runs ``command`` (``flwr run ... --stream``), echoing each line to ``echo`` (a
    file, or None), then asks the SuperLink how the run ended."""
    proc = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    lines = []
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        for line in proc.stdout:
            lines.append(line)
            if echo is not None:
                echo.write(line)
                echo.flush()
            if deadline is not None and time.monotonic() > deadline:
                raise DeploymentError(f"flwr run did not finish in {timeout:g} s")
        code = proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log = "".join(lines)
    m = _RUN_ID.search(log)
    run_id = m.group(1) if m else None
    status, details = run_status(run_id, federation, env) if run_id else ("", "")
    return RunResult(code, log, run_id, status, details)
