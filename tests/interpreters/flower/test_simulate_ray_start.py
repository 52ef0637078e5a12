"""``simulate`` starts a run again when Ray's node did not come up in its 30 s (a busy
machine: CI's leg 2 failed on it twice in one run), and only then: any other failure
is the run's and is returned as it is. Flower and Ray are replaced by fakes here; the
real runs are test_flower_simulation.py's."""

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
