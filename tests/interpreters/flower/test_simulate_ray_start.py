"""``simulate`` starts a run again when Ray's node did not come up in its 30 s (a busy
machine: CI's leg 2 failed on it twice in one run), and only then: any other failure
is the run's and is returned as it is. It leaves no folder of its own behind, runs
the SuperLink where the command was started, and gives its processes the environment
that keeps the run quiet. Flower and Ray are replaced by fakes here; the real runs are
test_flower_simulation.py's and test_flower_user_app.py's."""

from __future__ import annotations

import io

import pytest

pytest.importorskip("ray", reason="simulate needs ray (pip install 'fcir[flower]')")

from fcir.interpreters.flower import simulation  # noqa: E402
from fcir.interpreters.flower.local import RunResult  # noqa: E402

RAY_DID_NOT_START = (
    "Exception: The current node timed out during startup. This could happen because "
    "some of the raylet failed to startup or the GCS has become overloaded.\n"
)


def _failed(log):
    return RunResult(0, log, "1", "finished:failed", "Simulation failed with exception")


OK = RunResult(0, "Final results:\n", "2", "finished:completed", "")


@pytest.fixture
def runs(monkeypatch, tmp_path):
    """Replaces the SuperLink and ``flwr run``: ``runs.results`` are what successive
    runs return; ``runs.homes`` where each SuperLink was started, ``runs.stopped``
    which were stopped."""

    class Runs:
        results: list = []
        homes: list = []
        stopped: list = []

    class Link:
        def __init__(self, root):
            self.root = root
            self.cli_home = root / "cli"

        def start(self):
            Runs.homes.append(self.root)
            (self.root / "home-superlink").mkdir(parents=True)  # as the SuperLink's
            return self

        def stop(self):
            Runs.stopped.append(self.root)

    def flwr_run(cmd, env, federation, *, echo=None, timeout=None):
        return Runs.results.pop(0)

    monkeypatch.setattr(simulation, "SimulationLink", Link)
    monkeypatch.setattr(simulation, "flwr_run", flwr_run)
    monkeypatch.setattr(simulation, "env_for", lambda home: {})
    app = tmp_path / "app"
    app.mkdir()
    (app / "pyproject.toml").write_text("[tool.flwr.app.config]\n")
    Runs.app = app
    return Runs


def test_a_run_whose_ray_did_not_start_is_started_again_on_a_fresh_superlink(runs, tmp_path):
    runs.results = [_failed(RAY_DID_NOT_START), OK]
    echo = io.StringIO()
    result = simulation.simulate(runs.app, 3, root=tmp_path / "sim", echo=echo)
    assert result is OK
    assert runs.homes == [tmp_path / "sim", tmp_path / "sim" / "try2"]
    assert runs.stopped == runs.homes  # every SuperLink stopped, the failed one first
    assert "Ray did not start within its 30 s" in echo.getvalue()
    assert "(2 of 3)" in echo.getvalue()


def test_it_tries_three_times_then_returns_the_failure(runs, tmp_path, capsys):
    runs.results = [_failed(RAY_DID_NOT_START) for _ in range(3)] + [OK]
    result = simulation.simulate(runs.app, 3, root=tmp_path / "sim", echo=None)
    assert not result.ok and simulation.ray_did_not_start(result)
    assert len(runs.homes) == 3 and runs.results == [OK]
    # Without an echo the notices go to stderr: a user still sees why it took longer.
    assert capsys.readouterr().err.count("Ray did not start") == 2


def test_any_other_failure_is_the_runs_own_and_is_not_run_again(runs, tmp_path):
    failed = _failed("ServerApp failed with exception: run config state='0=9'\n")
    runs.results = [failed, OK]
    assert simulation.simulate(runs.app, 3, root=tmp_path / "sim", echo=None) is failed
    assert runs.homes == [tmp_path / "sim"] and runs.results == [OK]
    assert not simulation.ray_did_not_start(failed)
    assert not simulation.ray_did_not_start(OK)


def test_the_run_s_own_folder_is_removed_and_a_folder_given_is_kept(runs, tmp_path, monkeypatch):
    import tempfile

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    runs.results = [_failed(RAY_DID_NOT_START), OK, _failed("ServerApp failed\n")]
    assert simulation.simulate(runs.app, 3, echo=None) is OK
    assert runs.homes[0].parent == tmp and runs.homes[0].name.startswith("fcir-simulate-")
    assert list(tmp.iterdir()) == []  # both tries' folders gone
    assert not simulation.simulate(runs.app, 3, echo=None).ok
    assert list(tmp.iterdir()) == []  # also after a failed run
    runs.results = [OK]
    simulation.simulate(runs.app, 3, root=tmp_path / "kept", echo=None)
    assert (tmp_path / "kept" / "home-superlink").is_dir()


def test_the_superlink_runs_where_the_command_was_started(tmp_path, monkeypatch):
    """So the ServerApp (a process of the SuperLink's) writes a relative path there."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    link = simulation.SimulationLink(tmp_path / "sim")
    assert link.workdir == work.resolve()
    link.root.mkdir()
    link._spawn("pwd", ["pwd"])  # how its processes start, here a plain one
    assert link.procs["pwd"].wait(10) == 0
    assert (link.root / "pwd.log").read_text().strip() == str(work.resolve())


def test_its_processes_lock_the_shared_compilation_cache_and_skip_exec_fork_warnings(tmp_path):
    """JAX writes a cache entry in place and reads it without a lock unless the cache
    has a size limit; with one it locks each read and write, so an actor never reads
    an entry another is writing. JAX's fork warning is off only for forks subprocess
    execs at once (Ray starting its processes)."""
    import warnings

    from jax._src import config, lru_cache

    env = simulation.SimulationLink(tmp_path / "sim").process_env(tmp_path / "home")
    assert env["JAX_COMPILATION_CACHE_DIR"] == str(tmp_path / "sim" / "jax-cache")
    assert config.compilation_cache_max_size.name.upper() in env  # what JAX reads
    cache = lru_cache.LRUCache(
        str(tmp_path / "c"), max_size=int(env["JAX_COMPILATION_CACHE_MAX_SIZE"])
    )
    assert cache.eviction_enabled and cache.lock is not None
    # The filter as Python reads PYTHONWARNINGS (warnings._setoption is what -W and
    # PYTHONWARNINGS go through).
    said = "os.fork() was called. os.fork() is incompatible with multithreaded code"
    for where, shown in [("subprocess", False), ("multiprocessing.popen_fork", True)]:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            for option in env["PYTHONWARNINGS"].split(","):
                warnings._setoption(option)
            warnings.warn_explicit(said, RuntimeWarning, "f.py", 1, module=where)
        assert bool(seen) == shown, where


def test_the_command_says_how_the_run_ended_in_words(runs, tmp_path, monkeypatch, capsys):
    """Flower's status ``finished:completed`` is printed ``finished: completed``, and a
    failure's details follow its status in parentheses."""
    from fcir import cli

    monkeypatch.chdir(tmp_path)
    runs.results = [OK, _failed("ServerApp failed\n")]
    assert cli.main(["flower", "simulate", str(runs.app), "--nodes", "3"]) == 0
    assert capsys.readouterr().out.endswith("[fcir] simulated run 2 finished: completed\n")
    assert cli.main(["flower", "simulate", str(runs.app), "--nodes", "3"]) == 1
    assert "run 1 failed: finished: failed (Simulation failed with exception)\n" in (
        capsys.readouterr().err
    )
