"""Shared test setup: the golden-file fixture and the ``--update-goldens`` flag.

A golden is the canonical text of a corpus program (or of its gradient) under
tests/golden/. A mismatch fails with a short unified diff and the command that
updates goldens; a missing golden fails; CI never updates them. fcir's IR does not
depend on the JAX version; where a JAX traces a program itself to other equations (its
AD rules, its scan residuals), that program's golden for it is tests/golden/jax<X.Y>/
(``--update-goldens`` writes there only what differs from the shared golden).
"""

from __future__ import annotations

import difflib
import os
import pathlib
import re

# The reference interpreter evaluates local ops one at a time, rounding each bf16
# result; XLA would otherwise keep fused bf16 intermediates in f32 ("excess precision")
# under jit. Turning that off makes jit round like op-by-op execution, so the oracle
# comparison holds at 1e-5 for bf16 programs too. Set before jax initializes.
if "--xla_allow_excess_precision" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_allow_excess_precision=false"
    ).strip()

import pytest

GOLDEN_DIR = pathlib.Path(__file__).parent / "golden"


def _jax_dir() -> str:
    from importlib.metadata import version

    major, minor = version("jax").split(".")[:2]
    return f"jax{major}.{minor}"


_JAX_DIR = _jax_dir()
_USED: set[str] = set()


def pytest_addoption(parser):
    parser.addoption(
        "--update-goldens",
        action="store_true",
        default=False,
        help="rewrite tests/golden/*.fcir from the current output instead of comparing",
    )


@pytest.fixture
def golden(request):
    """``golden(name, text)``: compare ``text`` with tests/golden/<name>.fcir."""
    update = request.config.getoption("--update-goldens")

    def compare(name: str, text: str) -> None:
        _USED.add(name)
        path = GOLDEN_DIR / f"{name}.fcir"
        # Where the running JAX itself traces a program differently (other primitives
        # from its AD rules, other scan residuals), its golden is under golden/jax<X.Y>/.
        versioned = GOLDEN_DIR / _JAX_DIR / f"{name}.fcir"
        if versioned.exists() or (update and path.exists() and path.read_text() != text):
            path = versioned
        if update:
            path.parent.mkdir(exist_ok=True)
            path.write_text(text)
            return
        if not path.exists():
            pytest.fail(
                f"missing golden {path.relative_to(GOLDEN_DIR.parent.parent)}; create it with:\n"
                f"    python -m pytest {request.node.nodeid} --update-goldens"
            )
        expected = path.read_text()
        if expected != text:
            diff = list(
                difflib.unified_diff(
                    expected.splitlines(),
                    text.splitlines(),
                    f"golden/{name}.fcir",
                    "actual",
                    lineterm="",
                    n=1,
                )
            )
            shown = "\n".join(diff[:40]) + ("\n..." if len(diff) > 40 else "")
            pytest.fail(
                f"IR of {name} differs from its golden {path.relative_to(GOLDEN_DIR)}:\n{shown}\n"
                f"If the change is intended, update with:\n"
                f"    python -m pytest {request.node.nodeid} --update-goldens"
            )

    return compare


def used_goldens() -> set[str]:
    return set(_USED)


def _full_run(config) -> bool:
    """True when the whole suite ran: no -k/-m filter and no narrower paths."""
    if config.option.keyword or config.option.markexpr:
        return False
    root = pathlib.Path(__file__).parent.resolve()
    return all(pathlib.Path(a.split("::")[0]).resolve() == root for a in config.args) and all(
        "::" not in a for a in config.args
    )


def _xdist_worker(config) -> bool:
    """Whether this process is a pytest-xdist worker (``-n N``): it collects every test
    but runs only those the controller sends it."""
    return hasattr(config, "workerinput")


# The pytest processes of a session (the workers under -n, or the one process without
# it) compile through one JAX persistent compilation cache, in a folder the session
# makes and removes at its end: many tests compile a computation another test already
# compiled (a corpus program's oracle, the same round in another file, the reference
# interpreter's one-primitive computations), which jax.jit's in-memory cache does not
# see across function objects or processes; the second compile is then a read. Set
# through jax.config, so that no process a test starts (a CLI, a Flower node, a
# jax.distributed peer) inherits it. JAX writes an entry in place, so another worker
# could read one half written: here each entry is written to a file of the worker's
# own, then renamed into place (``_atomic_put``), so a reader finds a whole entry or
# none. The key covers the HLO, the compile options, XLA_FLAGS and the devices, so
# nothing compiled differently is shared. A cache the user set
# (JAX_COMPILATION_CACHE_DIR) is used as it is. What it saves, measured: the CI and
# fast-tier sections of docs/contributing.md.
_SESSION_JAX_CACHE: str | None = None  # the folder this process made (and removes)


def _atomic_put(self, key: str, value: bytes) -> None:
    """jax's ``LRUCache.put`` (no eviction: tests set no size limit), writing the entry
    to a temporary file and renaming it into place."""
    from jax._src import lru_cache

    if not key:
        raise ValueError("key cannot be empty")
    path = self.path / f"{key}{lru_cache._CACHE_SUFFIX}"
    if path.exists():
        return
    tmp = self.path / f".{key}.{os.getpid()}.tmp"
    tmp.write_bytes(value)
    os.replace(tmp, path)


def _parent_jax_cache() -> str | None:
    """In an 8-device child, the folder of the session that started it."""
    try:
        from eight_devices import PARENT_JAX_CACHE
    except ImportError:  # a scratch suite with this conftest (test_conftest_goldens.py)
        return None
    return os.environ.get(PARENT_JAX_CACHE)


def _use_session_jax_cache(config) -> None:
    global _SESSION_JAX_CACHE
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return  # the user's cache
    import tempfile

    if _xdist_worker(config):
        folder = config.workerinput.get("fcir_jax_cache")
    elif _parent_jax_cache():
        # An 8-device child: its session's folder, which the session removes. Its
        # entries are keyed by its XLA_FLAGS and 8 devices, so the children share them
        # among themselves only.
        folder = _parent_jax_cache()
    else:
        folder = _SESSION_JAX_CACHE = tempfile.mkdtemp(prefix="fcir-tests-jax-cache-")
        if getattr(config.option, "numprocesses", None):
            return  # an xdist controller: it runs no test, its workers use the folder
    if not folder:
        return
    import jax

    try:
        from jax._src import lru_cache

        lru_cache.LRUCache.put, lru_cache._CACHE_SUFFIX  # noqa: B018 (what _atomic_put needs)
    except (ImportError, AttributeError):
        # A JAX whose cache is laid out otherwise: a folder of this process's own, which
        # no other process reads.
        folder = _SESSION_JAX_CACHE = tempfile.mkdtemp(prefix="fcir-tests-jax-cache-")
    else:
        lru_cache.LRUCache.put = _atomic_put
    jax.config.update("jax_compilation_cache_dir", folder)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pytest_configure(config):
    _use_session_jax_cache(config)
    _use_cpu_log(config)


@pytest.fixture(autouse=True, scope="session")
def _float32_matmuls_on_accelerators():
    """On an accelerator, float32 matrix products at float32 precision, as on a CPU.

    A TPU multiplies float32 matrices in one bfloat16 pass by default (about three
    digits): a result that feeds another product is rounded to bfloat16 there, so two
    programs that compute the same thing in another order (streamed and unstreamed, a
    vmapped batch and a loop, fcir and a plain-JAX oracle) drift apart by far more than
    the float32 tolerances the tests hold them to on CPU. Under
    ``jax_default_matmul_precision="highest"`` a product is exact to float32 again and
    the comparisons mean what they mean on CPU; both sides of a bitwise comparison are
    traced under it alike. Set when the first test runs (the backend is chosen then),
    never on CPU, where it changes nothing."""
    import jax

    if jax.default_backend() == "cpu":
        yield
        return
    previous = jax.config.jax_default_matmul_precision
    jax.config.update("jax_default_matmul_precision", "highest")
    yield
    jax.config.update("jax_default_matmul_precision", previous)


@pytest.fixture
def traced_at_default_precision():
    """For a test of IR as JAX traces it by default (a golden, an IR file): the session's
    matmul precision (``_float32_matmuls_on_accelerators``) off for its duration, so that
    captures and ``jax.jit`` record no precision on a ``dot_general``, as the files have
    none; else a program read from one and ``jax.jit`` of its function would multiply at
    different precisions."""
    import jax

    with jax.default_matmul_precision(None):
        yield


# FCIR_TEST_CPU=FILE: each test's CPU seconds (its process's, and those of the processes
# it started and waited for: CLIs, 8-device children, Flower's SuperLinks) and wall
# seconds are appended to FILE, one line per test, by the session's pytest processes (the
# one process, or the xdist workers, which their controller tells). CI sets it for each
# leg and prints tools/test_cpu.py's summary: the machine's two cores are busy for the
# whole run, so CPU seconds, not a test's wall time, are what CI's time is made of. The
# variable leaves the environment: a pytest that a test starts (an 8-device child, a
# scratch suite) must not write lines of its own, since the test's line counts it.
_CPU_LOG: str | None = None


def _use_cpu_log(config) -> None:
    global _CPU_LOG
    if _xdist_worker(config):
        _CPU_LOG = config.workerinput.get("fcir_cpu_log")
    else:
        _CPU_LOG = os.environ.pop("FCIR_TEST_CPU", None)


def _cpu_seconds() -> float:
    import resource

    own, waited = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return own.ru_utime + own.ru_stime + waited.ru_utime + waited.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if not _CPU_LOG:
        yield
        return
    import time

    cpu, wall = _cpu_seconds(), time.monotonic()
    yield
    line = f"{_cpu_seconds() - cpu:.2f}\t{time.monotonic() - wall:.2f}\t{item.nodeid}\n"
    # One write of a short line to a file opened for appending: the processes' lines
    # do not interleave.
    fd = os.open(_CPU_LOG, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hooks: absent without it
def pytest_configure_node(node):
    """Tells each xdist worker the distribution mode (a worker's own is "no")."""
    node.workerinput["fcir_dist"] = node.config.getoption("dist")
    node.workerinput["fcir_jax_cache"] = _SESSION_JAX_CACHE
    node.workerinput["fcir_cpu_log"] = _CPU_LOG


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """Under ``-n N`` the controller gathers the goldens each worker compared (sent by
    the worker's ``pytest_sessionfinish``) to decide which no test compared."""
    _USED.update(getattr(node, "workeroutput", {}).get("fcir_used_goldens", ()))


def pytest_sessionfinish(session, exitstatus):
    """A full run fails on golden files no test compared (with --update-goldens it
    removes them). ``--collect-only`` compares nothing, so it never fails on them.
    Under ``-n N`` each worker compared only some goldens: it hands them to the
    controller, which decides with all of them."""
    if session.config.option.collectonly:
        return
    if _xdist_worker(session.config):
        session.config.workeroutput["fcir_used_goldens"] = sorted(_USED)
        return
    if not _full_run(session.config) or not GOLDEN_DIR.exists() or session.testsfailed:
        return
    unused = sorted(p for p in GOLDEN_DIR.glob("*.fcir") if p.stem not in _USED)
    if not unused:
        return
    if session.config.getoption("--update-goldens"):
        for p in unused:
            p.unlink()
        return
    names = ", ".join(p.name for p in unused)
    print(
        f"\nunused golden files (no test compares them): {names}\n"
        "remove them, or run: python -m pytest tests --update-goldens"
    )
    session.exitstatus = 1


# Folders whose tests no JAX version changes: checkpoint I/O, CLI plumbing, Flower and
# Ray deployments (the client work they ship is jax.export's, which the production export
# tests run on every JAX), the benchmark scripts' smoke runs (tests/bench: that a script
# runs and writes its record; what it times is the backends', whose results the backend
# tests pin on every JAX, and a benchmark is recorded on the newest). Every test under
# them is marked ``jax_independent``, and so is any other file that says
# ``pytestmark = pytest.mark.jax_independent``; CI runs them on the newest JAX only
# (.ci/run, docs/contributing.md).
JAX_INDEPENDENT_FOLDERS = ("bench", "checkpoint", "cli", "interpreters/flower")
# Corpus programs that take a minute or more to compile or differentiate on this
# machine's CPU: every test run on one of them (a parameter naming it) is ``slow``.
SLOW_CORPUS_CASES = frozenset({"fedavg_transformer"})
# The fast tier sweeps the corpus on these programs only, one per feature the sweeps
# exercise (the plainest round, nested placements, a secure sum of ints, min/max, a
# scan of rounds, the order statistics); a test run on any other corpus program is
# ``slow``: the full run (CI) sweeps every program.
FAST_CORPUS_CASES = frozenset(
    {
        "fedsgd_linreg",
        "hierarchical_fedavg",
        "secure_histogram",
        "minmax_agg",
        "scan_rounds",
        "robust_agg",
    }
)


# The device tier (docs/contributing.md, "On an accelerator"): the tests whose outcome
# the device can change (XLA's programs and their numbers, streaming and its memory,
# populations, the robust aggregators, checkpoints of arrays in device memory), run on
# an accelerator in one process with ``cd tests && python -m pytest -m device``. Marked
# ``device``: the fast-tier tests of these files, the slow ones in DEVICE_TIER_SLOW
# (what the device's memory decides), and the corpus sweeps
# on DEVICE_CORPUS_CASES; not the 8-device children, which are CPU meshes. With
# ``-m device`` no other test file is collected, so the tier runs where Flower, IREE or
# moto are not installed.
DEVICE_TIER_FILES = frozenset(
    {
        "interpreters/xla/test_xla.py",
        "interpreters/xla/test_xla_call.py",
        "interpreters/xla/test_xla_members.py",
        "interpreters/xla/test_xla_zeros.py",
        "interpreters/xla/test_xla_lstm_bitwise.py",
        "interpreters/xla/test_streaming_numbers.py",
        "interpreters/xla/test_xla_streaming.py",
        "interpreters/xla/test_xla_streaming_grad.py",
        "interpreters/xla/test_simulation.py",
        "interpreters/xla/test_cost_accounting.py",
        "interpreters/xla/test_hlo_flops.py",
        "interpreters/xla/test_memory_budget.py",
        "fed/test_krum_bulyan_geometric_median.py",
        "fed/test_median_and_trimmed_mean.py",
        "checkpoint/test_device_memory.py",
    }
)
DEVICE_TIER_SLOW = frozenset(
    {
        "test_streaming_memory_depends_on_k_not_on_the_cohort",
        "test_auto_budget_fits_the_memory_limit",
        "test_gradient_and_dp_temp_memory_is_flat_in_the_cohort",
    }
)
# The fast tier's corpus programs and the one whose members compute in bfloat16.
DEVICE_CORPUS_CASES = FAST_CORPUS_CASES | {"bf16_client"}


def _device_tier_run(config) -> bool:
    """Whether ``-m`` selects the device tier (``device``, not ``not device``)."""
    return re.search(r"(?<!not )\bdevice\b", config.option.markexpr or "") is not None


def pytest_ignore_collect(collection_path, config):
    """Under ``-m device``, test files outside the tier are not even imported."""
    if not _device_tier_run(config) or collection_path.suffix != ".py":
        return None
    name = collection_path.name
    if not (name.startswith("test_") or name == "conftest.py"):
        return None
    root = pathlib.Path(__file__).parent.resolve()
    try:
        relative = collection_path.resolve().relative_to(root).as_posix()
    except ValueError:
        return None
    return None if name == "conftest.py" or relative in DEVICE_TIER_FILES else True


def _in_device_tier(item, relative: str, named: set[str], explicit_slow: bool) -> bool:
    child = getattr(getattr(item, "module", None), "EIGHT_DEVICES", None)
    if relative not in DEVICE_TIER_FILES:
        return False
    if child is not None and getattr(item, "originalname", None) == child.test:
        return False  # an 8-device CPU child
    if explicit_slow and getattr(item, "originalname", None) not in DEVICE_TIER_SLOW:
        return False
    return named <= DEVICE_CORPUS_CASES


def _corpus_names() -> frozenset[str]:
    try:
        from corpus import CASES
    except ImportError:  # a scratch suite with this conftest (test_eight_devices.py)
        return frozenset()
    return frozenset(c.name for c in CASES)


def pytest_collection_modifyitems(config, items):
    """Marks the tests under ``JAX_INDEPENDENT_FOLDERS`` ``jax_independent``; marks
    ``slow`` the test that waits for a file's 8-device child (eight_devices.py: the child
    compiles for minutes), every test of a ``SLOW_CORPUS_CASES`` program, and every test
    of a corpus program outside ``FAST_CORPUS_CASES``; marks ``device`` the device tier
    (``DEVICE_TIER_FILES``)."""
    root = pathlib.Path(__file__).parent.resolve()
    folders = [tuple(f.split("/")) for f in JAX_INDEPENDENT_FOLDERS]
    corpus = _corpus_names()
    for item in items:
        explicit_slow = item.get_closest_marker("slow") is not None
        named = set()
        child = getattr(getattr(item, "module", None), "EIGHT_DEVICES", None)
        if child is not None and getattr(item, "originalname", None) == child.test:
            item.add_marker("slow")
        spec = getattr(item, "callspec", None)  # ids name cases: "x", "corpus:x", "x-slow"
        if spec is not None:
            tokens = set(re.split(r"[-:\[\]]", spec.id))
            named = corpus & tokens
            # The old IR fixtures' ids: "ir_v1_jax0.10.2/x" or ".../x_grad"; the fast
            # tier keeps every fixture but the SLOW_CORPUS_CASES ones.
            fixtures = {t.rpartition("/")[2].removesuffix("_grad") for t in tokens if "/" in t}
            if (named | fixtures) & SLOW_CORPUS_CASES or (named and not named & FAST_CORPUS_CASES):
                item.add_marker("slow")
        try:
            parts = pathlib.Path(item.path).resolve().relative_to(root).parts
        except ValueError:  # a test outside this folder (a scratch suite's)
            continue
        if any(parts[: len(f)] == f for f in folders):
            item.add_marker("jax_independent")
        if _in_device_tier(item, "/".join(parts), named, explicit_slow):
            item.add_marker("device")


def pytest_collection_finish(session):
    """Starts the 8-device children of the selected files in the background (see
    eight_devices.py): only those whose waiting test was selected, none for
    ``--collect-only``, and none inside a child itself."""
    if session.config.option.collectonly:
        return
    children = []
    for item in session.items:
        child = getattr(getattr(item, "module", None), "EIGHT_DEVICES", None)
        selected = getattr(item, "originalname", None) == getattr(child, "test", None)
        if child is not None and selected and child not in children:
            children.append(child)
    if not children:
        return
    if _xdist_worker(session.config):
        # A worker collects every file but runs only those sent to it; started here,
        # each child would run in every worker. Under --dist loadfile (the README's
        # test command) one worker runs all of a file: its child starts with the first
        # test of the file there, still ahead of the test that waits for it; under
        # other modes that test starts it (Child.result).
        if session.config.workerinput.get("fcir_dist") == "loadfile":
            _ON_FIRST_TEST.update((c.path, c) for c in children)
        return
    from eight_devices import start_in_background

    start_in_background(children)


_ON_FIRST_TEST: dict = {}  # under xdist: file path -> its 8-device child, not yet started


def pytest_runtest_setup(item):
    """Under xdist, starts a file's 8-device child at the first of its tests this worker
    runs (see pytest_collection_finish)."""
    if not _ON_FIRST_TEST:
        return
    child = getattr(getattr(item, "module", None), "EIGHT_DEVICES", None)
    if child is not None and _ON_FIRST_TEST.pop(child.path, None) is not None:
        from eight_devices import start_in_background

        start_in_background([child])


def pytest_unconfigure(config):
    """A session that ends before its 8-device children leaves none running, and no
    compilation cache of its own behind."""
    import sys

    if "eight_devices" in sys.modules:
        sys.modules["eight_devices"].stop_background()
    if _SESSION_JAX_CACHE is not None:
        import shutil

        shutil.rmtree(_SESSION_JAX_CACHE, ignore_errors=True)
