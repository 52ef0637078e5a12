"""Running a test file's mesh tests in a fresh pytest process with 8 simulated CPU devices.

JAX fixes the number of CPU devices when it starts, so a file whose tests need a mesh of
8 has one test in this process that runs the file again in a child process started with
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` and an environment flag the file
reads (``inside(flag)``) to tell which process it is in.

The file declares its child and its waiting test at module level::

    EIGHT_DEVICES = Child(__file__, FLAG)
    on_8_devices = EIGHT_DEVICES.on_8_devices  # the mark of the tests that run there
    test_on_8_simulated_devices = EIGHT_DEVICES.waiting_test()

(the waiting test calls ``EIGHT_DEVICES.result()`` in the main process and skips in the
child; a file that checks more of the child's output writes its own, marked
``EIGHT_DEVICES.in_main_process``). Declared at import, the children of the selected files are
started by conftest.py as soon as collection ends (``start_in_background``): a child
spends its minutes compiling, mostly on one core, while this process runs the rest of the
suite on the other; its test then only collects the outcome. They run one at a time (each
holds the compiled programs of 8 devices), at this process's priority: below it, on a
machine loaded by others, a child waited for by its test got next to no CPU. Under
pytest-xdist (``-n N --dist loadfile``) a worker starts a child when it runs the first
test of the child's file instead (conftest.py), so up to N children run at once, one
per worker.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import threading

import cheap_compile
import pytest

TIMEOUT = 900  # seconds a test waits for its child
PARENT_JAX_CACHE = "FCIR_TEST_SESSION_JAX_CACHE"  # conftest.py reads it in a child
_REPO = pathlib.Path(__file__).resolve().parent.parent  # where the children run


def _session_jax_cache() -> str | None:
    """The compilation cache folder this process's session set (conftest.py), if any."""
    if "jax" not in sys.modules:
        return None
    return sys.modules["jax"].config.jax_compilation_cache_dir or None


def inside(flag: str) -> bool:
    """Whether this is the 8-device child process of a file using ``flag``."""
    return os.environ.get(flag) == "1"


class Child:
    """The 8-device child of ``test_file``: pytest on that file with ``flag`` set and
    ``pytest_args``; ``test`` is the name of the file's test that waits for it. The
    child compiles with LLVM at -O0 (see ``_run``)."""

    def __init__(
        self,
        test_file: str | os.PathLike,
        flag: str,
        *pytest_args: str,
        test: str = "test_on_8_simulated_devices",
    ):
        self.path = pathlib.Path(test_file).resolve()
        self.flag = flag
        self.test = test
        self.cmd = [sys.executable, "-m", "pytest", str(self.path), "-q", "-p", "no:cacheprovider"]
        self.cmd += pytest_args
        self.inside = inside(flag)
        self._queued = False
        self._done = threading.Event()
        self._proc: subprocess.Popen | None = None
        self._outcome: tuple[int, str, str] | None = None  # returncode, stdout, stderr
        self._error: str | None = None

    def _run(self) -> None:
        env = dict(os.environ, **{self.flag: "1"})
        flags = [env.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8"]
        # Cheaper CPU codegen (LLVM at -O0, as test_drjax.py's mesh run): a child
        # compiles some sixty programs, and what its tests compare (fcir's program
        # and jax.jit's, or the reference's, on the same mesh, compiled alike; the
        # HLO, its partitioning and its flops) does not depend on how LLVM optimizes
        # the kernels. Measured: test_xla_mesh.py's child 78 -> 61 s of CPU (jax
        # 0.10.2), the same outcomes. On jaxlib 0.10 also the older fusion emitters
        # (cheap_compile.py).
        flags += cheap_compile.flags()
        env["XLA_FLAGS"] = " ".join(flags).strip()
        # Simulated CPU devices, whatever else the machine has: on an accelerator the
        # parent holds the device, which one process at a time may open.
        env["JAX_PLATFORMS"] = "cpu"
        # The session's compilation cache (conftest.py), so that a program another
        # child compiled is read, not compiled again (the mesh files' children share
        # dozens). Measured, three children after test_xla_mesh.py's: 51.2 -> 44.9 CPU s.
        cache = _session_jax_cache()
        if cache:
            env[PARENT_JAX_CACHE] = cache
        try:
            self._proc = subprocess.Popen(
                self.cmd, env=env, cwd=_REPO, text=True,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            )  # fmt: skip
            if _STOPPING.is_set():  # the session ended while this one started
                self._proc.kill()
            out, err = self._proc.communicate()  # result() bounds the wait
            self._outcome = (self._proc.returncode, out, err)
        except Exception as e:  # noqa: BLE001  (reported by result(), in the test)
            self._error = f"{type(e).__name__}: {e}"
        finally:
            self._done.set()

    @property
    def on_8_devices(self) -> pytest.MarkDecorator:
        """The mark of a test that runs in the child only (skipped in the main process)."""
        return pytest.mark.skipif(not self.inside, reason=f"runs in {self.test}")

    @property
    def in_main_process(self) -> pytest.MarkDecorator:
        """The mark of a test that runs in the main process only (skipped in the child)."""
        return pytest.mark.skipif(self.inside, reason="runs in the main test process")

    def waiting_test(self):
        """The main-process test that waits for the child and fails with its output
        unless every test there passed; bind it to the name ``self.test``."""

        def test():
            if self.inside:
                pytest.skip("this is the 8-device process")
            self.result()

        test.__name__ = test.__qualname__ = self.test
        test.__doc__ = f"Runs {self.path.name}'s 8-device tests in a child process."
        return test

    @property
    def started(self) -> bool:
        """Whether the child was started (or queued to start in the background)."""
        return self._queued or self._done.is_set() or self._proc is not None

    def stop(self) -> None:
        """Kills the child if it is still running."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.kill()

    def result(self) -> str:
        """Waits for the child (starting it, if no one did); fails with the ends of its
        output unless every selected test passed. Returns its stdout."""
        assert not self.inside, "the 8-device process waits for no child of its own"
        if not self._queued:
            start_in_background([self])
        # Counted from here: in the background a child may wait for CPU the main
        # process is using, which says nothing about the child.
        if not self._done.wait(TIMEOUT):
            self._error = f"did not finish within {TIMEOUT} s of its test waiting for it"
            self.stop()
            self._done.wait()
        cmd = " ".join(self.cmd)
        assert self._error is None and self._outcome is not None, (
            f"8-device tests ({cmd}): {self._error}\n"
            + ("" if self._outcome is None else self._outcome[1][-6000:])
        )
        code, out, err = self._outcome
        assert code == 0, f"8-device tests failed ({cmd}):\n{out[-6000:]}\n{err[-2000:]}"
        return out


_STARTED: list[Child] = []
_STOPPING = threading.Event()


def start_in_background(children: list[Child]) -> None:
    """Runs ``children`` one after another in a thread, so the test of each only waits
    for what is left of it."""
    children = [c for c in children if not c.inside and not c._queued and not c._done.is_set()]
    if not children:
        return
    for c in children:
        c._queued = True
    _STARTED.extend(children)

    def run_all() -> None:
        for c in children:
            if _STOPPING.is_set():
                c._error = "the session ended before it started"
                c._done.set()
            else:
                c._run()

    threading.Thread(target=run_all, name="eight-devices", daemon=True).start()


def stop_background() -> None:
    """Kills the background child still running and starts no more (the session is
    ending, before their tests if -x stopped it or Ctrl-C)."""
    _STOPPING.set()
    for c in _STARTED:
        c.stop()
