"""Checkpoint benchmark: fcir.checkpoint against orbax-checkpoint and against `dd`
(through the page cache, as the goal is stated, and with `oflag=direct`, the device's
own speed, since fcir writes large shards with direct I/O).

    python bench/checkpoint.py            # ~1 GiB over 8 CPU devices, warm-up + 5 repetitions
    python bench/checkpoint.py --quick    # tiny sizes, one repetition (the CI smoke run)

Every figure is a ratio measured side by side in one run: each repetition runs the
contenders back to back (rotating their order, with a rest before each write, since
cloud disks throttle a writer that follows another), and a figure is the ratio of the
medians. Every timed call starts on a quiet disk: an untimed os.sync() before it (its
duration is reported; near zero means nothing was left to flush) and another after it,
so no contender pays for the writeback another left behind (orbax's save returns before
its pages are written back; fcir's after its fsyncs). fcir's blocking save is split
into phases (before the first write, pwrites, data fsync, the rest of the commit) for
every repetition. An asynchronous save's blocking part is measured twice: after the rest
every write gets (the goal's row) and right after a busy numpy step, as in a training
loop. Prints a table with every goal of docs/design checkpoint.md and writes every
raw sample, the versions and the core count to bench/results/checkpoint-*.json.

Restores onto the saved sharding are also compared with the restore *limit*: the same
stored bytes read with plain `os.pread`, 1 MiB at a time on as many threads as fcir
uses, into one buffer per device block allocated as fcir's reader allocates its destinations (`reader.aligned_empty`: 2 MiB aligned from 2 MiB up), then `jax.device_put`
onto the devices of the same sharding; no checksums, no planning. Each restore runs warm (from the page cache: the
checkpoints' files are read once first, untimed, since fcir's saves write past the page
cache with direct I/O; `--restore-repeats` times per repetition, interleaved, median
kept) and cold: before a cold one the checkpoint's files are dropped
from the page cache with posix_fadvise(POSIX_FADV_DONTNEED) per file (clean pages: the
saves were synced), which needs no privilege and touches no one else's cache. Whether
the drop worked is checked with RWF_NOWAIT reads and reported.
"""

from __future__ import annotations

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import argparse
import contextlib
import dataclasses
import datetime
import gc
import json
import math
import pathlib
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import _record  # bench/, the script's own folder
import jax
import jaxlib
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

REPO = pathlib.Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from fcir.checkpoint import parallel
from fcir.checkpoint.layout import read_layout
from fcir.checkpoint.reader import aligned_empty

from fcir import checkpoint

RESULTS = REPO / "bench" / "results"
N_BIG = 4  # large float32 leaves, sharded over all devices
N_SMALL = 4  # small replicated leaves


def big_shape(total_mib: float) -> tuple[int, int]:
    """Shape of each large leaf so that N_BIG of them hold about `total_mib` MiB."""
    elems = max(64, int(total_mib * 2**20 / 4 / N_BIG))
    cols = 1 << max(3, int(math.log2(math.isqrt(elems))))
    rows = max(8, elems // cols // 8 * 8)
    return rows, cols


def meshes() -> dict[str, jax.sharding.Mesh]:
    devices = jax.devices()[:8]
    return {
        "saved": jax.make_mesh((8,), ("x",), devices=devices),
        "other": jax.make_mesh((4, 2), ("a", "b"), devices=devices),
    }


def shardings(kind: str) -> dict[str, NamedSharding]:
    """How the big and small leaves are laid out: as saved, or two other layouts."""
    m = meshes()
    if kind == "saved":  # rows over 8 devices
        return {"big": NamedSharding(m["saved"], P("x")), "small": NamedSharding(m["saved"], P())}
    if kind == "other":  # another mesh shape and spec: rows over 4, columns over 2
        return {
            "big": NamedSharding(m["other"], P("a", "b")),
            "small": NamedSharding(m["other"], P()),
        }
    if kind == "columns":  # every device needs a slice of every stored row block
        return {
            "big": NamedSharding(m["saved"], P(None, "x")),
            "small": NamedSharding(m["saved"], P("x")),
        }
    raise ValueError(kind)


def abstract_tree(shape: tuple[int, int], kind: str) -> dict[str, Any]:
    s = shardings(kind)
    return {
        "params": {
            **{
                f"w{i}": jax.ShapeDtypeStruct(shape, np.float32, sharding=s["big"])
                for i in range(N_BIG)
            },
            **{
                f"b{i}": jax.ShapeDtypeStruct((shape[1],), np.float32, sharding=s["small"])
                for i in range(N_SMALL)
            },
        }
    }


def make_tree(shape: tuple[int, int]) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    out = {}
    for name, sds in abstract_tree(shape, "saved")["params"].items():
        host = rng.random(sds.shape, dtype=np.float32)
        out[name] = jax.device_put(host, sds.sharding)
        del host
    jax.block_until_ready(out)
    return {"params": out}


def prefault(nbytes: int) -> tuple[int, float]:
    """Touches and frees `nbytes` of memory (at most half of what is available).

    On a VM, the first touch of a guest page the host never backed costs ~10x a
    later one; whichever contender met fresh pages first would pay for the machine.
    """
    with open("/proc/meminfo") as f:
        avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable"))
    nbytes = min(nbytes, avail // 2)
    start = time.perf_counter()
    blocks = [np.ones(min(2**28, nbytes - i), np.uint8) for i in range(0, nbytes, 2**28)]
    del blocks
    return nbytes, time.perf_counter() - start


def tree_bytes(tree: dict[str, Any]) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(tree))


#: Seconds each untimed os.sync() before a timed call took (near 0: the disk was quiet).
PRESYNC: list[float] = []


def timed(fn: Callable[[], Any]) -> float:
    """Seconds `fn` takes, started on a quiet disk: before it (untimed) os.sync() flushes
    whatever anyone left dirty, so no contender pays for another's writeback; afterwards
    (untimed) it flushes what `fn` left dirty (orbax returns before the page cache is
    written back), so the next one starts quiet too."""
    start = time.perf_counter()
    os.sync()
    PRESYNC.append(time.perf_counter() - start)
    start = time.perf_counter()
    fn()
    elapsed = time.perf_counter() - start
    os.sync()
    return elapsed


@contextlib.contextmanager
def save_phases(into: dict[str, float]):  # type: ignore[no-untyped-def]
    """Records where a blocking fcir save's time goes: `before_write` (from the call to
    the start of the data file's writes: checks, host snapshot, temporary directory,
    opening the file), `write` (pwrites and checksums of the data file, on its writer
    threads), `fsync` (the data file's fsync, which overlaps the layout's write) and
    `after_write` (from the last pwrite to the commit's end: the shard records, waiting
    for that fsync, the layout, the directory fsyncs and the rename)."""
    from fcir.checkpoint import writer

    real_run, real_fsync = writer.parallel.run_tasks, os.fsync
    marks: dict[str, float] = {}

    def run_tasks(tasks, threads=None):  # type: ignore[no-untyped-def]
        t = time.perf_counter()
        marks.setdefault("write_start", t)
        real_run(tasks, threads)
        marks["write_end"] = time.perf_counter()
        into["write"] = into.get("write", 0.0) + marks["write_end"] - t

    def fsync(fd: int) -> None:
        t = time.perf_counter()
        real_fsync(fd)
        if os.path.basename(os.readlink(f"/proc/self/fd/{fd}")).startswith("data-"):
            into["fsync"] = into.get("fsync", 0.0) + time.perf_counter() - t

    writer.parallel.run_tasks, os.fsync = run_tasks, fsync  # type: ignore[assignment]
    try:
        yield marks
    finally:
        writer.parallel.run_tasks, os.fsync = real_run, real_fsync  # type: ignore[assignment]


def rm(path: pathlib.Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
    if path.is_file():
        path.unlink()


# --- contenders ------------------------------------------------------------------------


def fcir_save(path: pathlib.Path, tree: dict[str, Any]) -> dict[str, float]:
    phases: dict[str, float] = {}

    def run() -> None:
        with save_phases(phases) as marks:
            start = time.perf_counter()
            checkpoint.save(path, tree)
            marks["end"] = time.perf_counter()
        phases["before_write"] = marks["write_start"] - start
        phases["after_write"] = marks["end"] - marks["write_end"]

    total = timed(run)
    return {"fcir_save": total, **{f"fcir_save_{k}": v for k, v in phases.items()}}


def busy_step(seconds: float = 0.3) -> None:
    """What a training loop does between saves: numpy work on the CPUs for `seconds`."""
    a = np.random.default_rng(0).random((384, 384), dtype=np.float32)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        a = np.tanh(a @ a.T / 384)


def fcir_async(path: pathlib.Path, tree: dict[str, Any], busy: bool = False) -> tuple[float, float]:
    """The blocking part and the whole of an asynchronous save. With `busy`, it starts
    right after a busy_step() (as a save in a training loop does), not after the rest
    every write gets: on a VM, the first code a process runs after a second or more of
    idle is many times slower (cold pages), which the after-idle figure includes."""
    if busy:
        busy_step()
    start = time.perf_counter()
    os.sync()  # untimed, as in timed(): start on a quiet disk
    PRESYNC.append(time.perf_counter() - start)
    start = time.perf_counter()
    handle = checkpoint.save(path, tree, blocking=False)
    blocking = time.perf_counter() - start
    handle.wait()
    total = time.perf_counter() - start
    os.sync()
    return blocking, total


def orbax_checkpointer():  # type: ignore[no-untyped-def]
    import orbax.checkpoint as ocp

    return ocp.StandardCheckpointer()


def orbax_save(ckptr: Any, path: pathlib.Path, tree: dict[str, Any]) -> float:
    def run() -> None:
        ckptr.save(path, tree)
        ckptr.wait_until_finished()

    return timed(run)


def dd(path: pathlib.Path, nbytes: int, direct: bool = False) -> float:
    """`dd conv=fdatasync` of `nbytes` (rounded up to MiB) through the page cache, or with
    `oflag=direct` (the device's own speed, which fcir's direct writes are held to)."""
    count = -(-nbytes // 2**20)
    cmd = ["dd", "if=/dev/zero", f"of={path}", "bs=1M", f"count={count}", "conv=fdatasync"]
    if direct:
        cmd[3:5] = ["bs=4M", f"count={-(-count // 4)}", "oflag=direct"]
    return timed(lambda: subprocess.run(cmd, check=True, capture_output=True))


def fcir_restore(path: pathlib.Path, target: dict[str, Any]) -> float:
    def run() -> None:
        jax.block_until_ready(checkpoint.restore(path, target))

    t = timed(run)
    gc.collect()
    return t


def orbax_restore(ckptr: Any, path: pathlib.Path, target: dict[str, Any]) -> float:
    def run() -> None:
        jax.block_until_ready(ckptr.restore(path, target))

    t = timed(run)
    gc.collect()
    return t


def _pread_all(fd: int, view: memoryview, offset: int) -> None:
    while view:
        n = os.preadv(fd, [view], offset)
        if n <= 0:
            raise OSError(f"short read at byte {offset}")
        view, offset = view[n:], offset + n


#: The limit's read size: of 256 KiB to 32 MiB, 1 MiB read fastest here; one read per
#: 32 MiB stored shard was erratic and up to 7x slower, which would flatter fcir.
LIMIT_READ_BYTES = 2**20


def limit_restore(path: pathlib.Path, target: dict[str, Any]) -> dict[str, Any]:
    """The restore limit: for each device block of the target sharding, the stored shard
    with the same index range read with plain preads into an aligned buffer of its own;
    then jax.device_put of the blocks onto their devices, assembled into the sharding.

    Only the layout (a few KiB) is read through fcir, for the shards' offsets; the
    target must be the saved sharding. One buffer per block, not per array: in this
    benchmark's process, reads into one 256 MiB buffer per array were erratic (1.1-9.4 s
    for 1 GiB where per-block buffers took 0.6-0.8 s), which would flatter fcir.
    """
    from concurrent.futures import ThreadPoolExecutor

    layout = read_layout(path)
    fds = [os.open(path / f.name, os.O_RDONLY) for f in layout.files]
    try:
        reads, puts = [], []
        for item in layout.items:
            records = {r.path[-1].name: r for r in item.arrays.arrays}
            for name, leaf in target.get(item.name, {}).items():
                record = records[name]
                shape, dtype = tuple(record.shape), np.dtype(record.dtype)
                stored = {tuple((r.start, r.stop) for r in s.index): s for s in record.shards}
                blocks: dict[tuple, list] = {}
                for device, index in leaf.sharding.addressable_devices_indices_map(shape).items():
                    box = tuple(sl.indices(n)[:2] for sl, n in zip(index, shape))
                    blocks.setdefault(box, []).append(device)
                hosts, devices = [], []
                for box, devs in blocks.items():
                    shard = stored[box]  # KeyError: not the saved sharding
                    buf = aligned_empty((shard.length,), np.dtype(np.uint8))
                    for o in range(0, shard.length, LIMIT_READ_BYTES):
                        view = memoryview(buf)[o : o + LIMIT_READ_BYTES]
                        reads.append((fds[shard.file], view, shard.offset + o))
                    host = buf.view(dtype).reshape([b - a for a, b in box])
                    hosts += [host] * len(devs)
                    devices += devs
                puts.append((item.name, name, shape, leaf.sharding, hosts, devices))
        with ThreadPoolExecutor(parallel.THREADS) as pool:
            list(pool.map(lambda r: _pread_all(*r), reads))
        out: dict[str, Any] = {}
        for item_name, name, shape, sharding, hosts, devices in puts:
            singles = jax.device_put(hosts, devices)
            out.setdefault(item_name, {})[name] = jax.make_array_from_single_device_arrays(
                shape, sharding, singles
            )
        return out
    finally:
        for fd in fds:
            os.close(fd)


def check_limit(path: pathlib.Path, tree: dict[str, Any], target: dict[str, Any]) -> None:
    got = limit_restore(path, target)
    for name, want in tree["params"].items():
        have = got["params"][name]
        if have.sharding != want.sharding or not np.array_equal(have, want):
            raise AssertionError(f"the restore limit read {name} wrong")


def timed_limit(path: pathlib.Path, target: dict[str, Any]) -> float:
    def run() -> None:
        jax.block_until_ready(limit_restore(path, target))

    t = timed(run)
    gc.collect()
    return t


def _files(directory: pathlib.Path) -> list[str]:
    return [os.path.join(root, f) for root, _, names in os.walk(directory) for f in names]


def drop_page_cache(directory: pathlib.Path) -> None:
    """Evicts the files under `directory` from the page cache (they must be clean)."""
    for name in _files(directory):
        fd = os.open(name, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def warm_page_cache(directory: pathlib.Path) -> None:
    """Reads every file under `directory` once (untimed), so that the warm restores read
    from the page cache: fcir's saves write past it (direct I/O), orbax's through it."""
    buf = bytearray(16 << 20)
    for name in _files(directory):
        with open(name, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


def cached_fraction(directory: pathlib.Path) -> float | None:
    """Share of the files' pages in the page cache, from mincore(2) on a mapping of each
    (which, unlike a probing read, starts no readahead). None where it cannot be asked."""
    import ctypes
    import mmap

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_long,
        ]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    except (OSError, AttributeError):
        return None
    page = mmap.PAGESIZE
    resident = total = 0
    for name in _files(directory):
        fd = os.open(name, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            if size == 0:
                continue
            addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr in (None, ctypes.c_void_p(-1).value):
                return None
            try:
                pages = -(-size // page)
                vec = ctypes.create_string_buffer(pages)
                if libc.mincore(addr, size, vec) != 0:
                    return None
                resident += sum(b & 1 for b in vec.raw)
                total += pages
            finally:
                libc.munmap(addr, size)
        finally:
            os.close(fd)
    return resident / total if total else 0.0


def cold(directory: pathlib.Path, restore: Callable[[], float], left: list[float]) -> float:
    """`restore()` after dropping `directory` from the page cache (untimed); records in
    `left` the share still cached after the drop."""
    drop_page_cache(directory)
    share = cached_fraction(directory)
    if share is not None:
        left.append(share)
    return restore()


# --- peak memory of a restore, in a fresh process -------------------------------------------


def rss_bytes(field: str = "VmRSS") -> int:
    """Resident memory now (VmRSS) or at its peak (VmHWM) of this process, from /proc.

    Not ru_maxrss: Linux keeps that across exec, so a child would report its parent's peak.
    """
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def measure_memory_child(library: str, path: str, rows: int, cols: int, kind: str) -> None:
    shape = (rows, cols)
    target = abstract_tree(shape, kind)
    jax.block_until_ready(jax.device_put(np.zeros(8), shardings("saved")["small"]))
    if library == "orbax":
        ckptr = orbax_checkpointer()
    gc.collect()
    before = rss_bytes()
    if library == "orbax":
        out = ckptr.restore(path, target)
    else:
        out = checkpoint.restore(path, target)
    jax.block_until_ready(out)
    peak = rss_bytes("VmHWM")
    print(json.dumps({"before": before, "peak": peak, "restored": tree_bytes(out)}))


def measure_memory(
    library: str, path: pathlib.Path, shape: tuple[int, int], kind: str = "saved"
) -> dict[str, int]:
    """Peak resident memory of a restore onto the `kind` sharding in a fresh process
    (VmHWM: file pages mapped during the restore count too)."""
    done = subprocess.run(
        [sys.executable, __file__, "--memory-child", library, str(path), *map(str, shape), kind],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


# --- the run ----------------------------------------------------------------------------


def rotated(items: list, k: int) -> list:
    """`items` starting at position k: over len(items) repetitions each contender runs
    after each other one once (the machine's state after a run favours or hurts the next)."""
    k %= len(items)
    return items[k:] + items[:k]


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def per_rep_ratios(num: list[float], den: list[float]) -> list[float]:
    """The ratio within each repetition (the two ran side by side there), so a goal can
    be checked in every run, not only for the medians."""
    return [x / y for x, y in zip(num, den)]


GOALS = [
    # (figure, numerator sample, denominator sample, goal, "<=" or ">=")
    ("save until committed: orbax / fcir", "orbax_save", "fcir_save", 2.5, ">="),
    ("save until committed: fcir / dd of the same bytes", "fcir_save", "dd", 1.3, "<="),
    ("save until committed: fcir / dd oflag=direct", "fcir_save", "dd_direct", 1.3, "<="),
    (  # the goal's row: the save starts after `--settle` s of idle, as every write does
        "async save: blocking part / whole save",
        "fcir_async_blocking",
        "fcir_async_total",
        0.05,
        "<=",
    ),
    (
        "async save right after a busy step: blocking / whole",
        "fcir_async_busy_blocking",
        "fcir_async_busy_total",
        0.05,
        "<=",
    ),
    (
        "restore onto the saved sharding: orbax / fcir",
        "orbax_restore",
        "fcir_restore_saved",
        2.0,
        ">=",
    ),
    (
        "restore onto the saved sharding: fcir / limit",
        "fcir_restore_saved",
        "limit_restore",
        1.2,
        "<=",
    ),
    (
        "cold restore onto the saved sharding: orbax / fcir",
        "orbax_restore_cold",
        "fcir_restore_saved_cold",
        2.0,
        ">=",
    ),
    (
        "cold restore onto the saved sharding: fcir / limit",
        "fcir_restore_saved_cold",
        "limit_restore_cold",
        1.2,
        "<=",
    ),
    (
        "restore onto mesh (4,2) P('a','b') / onto saved",
        "fcir_restore_other",
        "fcir_restore_saved",
        1.2,
        "<=",
    ),
    (
        "restore onto P(None,'x') (columns) / onto saved",
        "fcir_restore_columns",
        "fcir_restore_saved",
        1.2,
        "<=",
    ),
]


@dataclasses.dataclass
class Bench:
    """What the warm-up and every repetition work on, and what they collect."""

    args: argparse.Namespace
    shape: tuple[int, int]
    reps: int
    repeats: int  # runs of each warm restore per repetition
    warmup: int
    work: pathlib.Path
    tree: dict[str, Any]
    nbytes: int
    targets: dict[str, dict[str, Any]]  # "saved", "other", "columns" -> abstract tree
    ckptr: Any
    samples: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    still_cached: list[float] = dataclasses.field(default_factory=list)  # after each drop
    warm_cached: list[float] = dataclasses.field(default_factory=list)  # before warm restores

    @property
    def fcir_path(self) -> pathlib.Path:
        return self.work / "fcir"

    @property
    def orbax_path(self) -> pathlib.Path:
        return self.work / "orbax"

    @property
    def dd_path(self) -> pathlib.Path:
        return self.work / "dd.bin"

    @property
    def async_path(self) -> pathlib.Path:
        return self.work / "async"

    @property
    def busy_path(self) -> pathlib.Path:
        return self.work / "async-busy"


def set_up(args: argparse.Namespace) -> Bench:
    """The tree on the devices, the restore targets and orbax's checkpointer, after
    touching the memory the run will use; prints what will be measured."""
    shape = big_shape(args.size_mib)
    work = pathlib.Path(args.dir or tempfile.mkdtemp(prefix="fcir-ckpt-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    tree = make_tree(shape)
    nbytes = tree_bytes(tree)
    touched, touch_s = prefault(6 * nbytes)
    bench = Bench(
        args=args,
        shape=shape,
        reps=1 if args.quick else args.reps,
        repeats=1 if args.quick else args.restore_repeats,
        warmup=0 if args.quick else 1,
        work=work,
        tree=tree,
        nbytes=nbytes,
        targets={kind: abstract_tree(shape, kind) for kind in ("saved", "other", "columns")},
        ckptr=orbax_checkpointer(),
    )
    print(
        f"tree: {N_BIG} x f32{list(shape)} over 8 devices + {N_SMALL} replicated f32[{shape[1]}]"
        f" = {nbytes / 2**20:.1f} MiB; {bench.warmup} warm-up + {bench.reps} repetition(s);"
        f" dir {work}; touched {touched / 2**30:.1f} GiB of memory first ({touch_s:.1f} s)",
        flush=True,
    )
    return bench


def timed_writes(bench: Bench, rep: int) -> dict[str, float]:
    """Every save and dd, in an order rotated each repetition, each after a rest."""
    tree, nbytes, d_path = bench.tree, bench.nbytes, bench.dd_path
    writes = [
        lambda: fcir_save(bench.fcir_path, tree),
        lambda: {"orbax_save": orbax_save(bench.ckptr, bench.orbax_path, tree)},
        lambda: {"dd": dd(d_path, nbytes)},
        lambda: {"dd_direct": dd(d_path.with_suffix(".direct"), nbytes, direct=True)},
        lambda: dict(
            zip(("fcir_async_blocking", "fcir_async_total"), fcir_async(bench.async_path, tree))
        ),
        lambda: dict(
            zip(
                ("fcir_async_busy_blocking", "fcir_async_busy_total"),
                fcir_async(bench.busy_path, tree, busy=True),
            )
        ),
    ]
    got: dict[str, float] = {}
    for write in rotated(writes, rep):
        time.sleep(bench.args.settle)  # the disk may throttle a writer right after another
        got.update(write())
    return got


def warm_restores(bench: Bench, rep: int, record: bool) -> dict[str, float]:
    """fcir's restores onto each sharding and the limit's, from the page cache.

    Each runs `repeats` times, interleaved with the others, the order rotated every
    round, and its sample for this repetition is the median: one 256 MiB restore takes
    ~0.1 s here, and a single one moved 0.5-5x with the machine's load and 2-3x with its
    place (whichever ran first after the writes paid it), which decided the rows onto
    another sharding. With `record`, every run is kept in `<name>_runs`."""
    f_path, saved, targets = bench.fcir_path, bench.targets["saved"], bench.targets
    restores = [
        ("fcir_restore_saved", lambda: fcir_restore(f_path, saved)),
        ("limit_restore", lambda: timed_limit(f_path, saved)),
        ("fcir_restore_other", lambda: fcir_restore(f_path, targets["other"])),
        ("fcir_restore_columns", lambda: fcir_restore(f_path, targets["columns"])),
    ]
    if bench.args.quick and rep == 0:  # the limit must read the right bytes (untimed)
        check_limit(f_path, bench.tree, saved)
    warm_page_cache(f_path)
    warm_page_cache(bench.orbax_path)
    share = cached_fraction(f_path)
    if share is not None:
        bench.warm_cached.append(share)
    runs: dict[str, list[float]] = {}
    for i in range(bench.repeats):
        for name, restore in rotated(restores, rep * bench.repeats + i):
            runs.setdefault(name, []).append(restore())
    got: dict[str, float] = {}
    for name, times in runs.items():
        got[name] = median(times)
        if record:
            bench.samples.setdefault(f"{name}_runs", []).extend(times)
    return got


def cold_restores(bench: Bench, rep: int) -> dict[str, float]:
    """fcir's and the limit's restores onto the saved sharding, each after dropping the
    checkpoint from the page cache, in an order rotated each repetition."""
    f_path, saved = bench.fcir_path, bench.targets["saved"]
    colds = [
        ("fcir_restore_saved_cold", lambda: fcir_restore(f_path, saved)),
        ("limit_restore_cold", lambda: timed_limit(f_path, saved)),
    ]
    return {
        name: cold(f_path, restore, bench.still_cached) for name, restore in rotated(colds, rep)
    }


def orbax_restores(bench: Bench) -> dict[str, float]:
    """orbax's restore onto the saved sharding, warm then cold.

    They run after every other restore: on this machine the restore that follows an
    orbax restore in the same process was 5-10x slower (fcir 0.6 s -> 5-7 s, even after
    6 s idle), whoever it was; rotating orbax among the others made the limit, which
    always came next, look 7x slower than fcir."""
    o_path, saved = bench.orbax_path, bench.targets["saved"]
    return {
        "orbax_restore": orbax_restore(bench.ckptr, o_path, saved),
        "orbax_restore_cold": cold(
            o_path, lambda: orbax_restore(bench.ckptr, o_path, saved), bench.still_cached
        ),
    }


def measure(bench: Bench) -> tuple[dict, dict | None]:
    """The warm-up and the repetitions, each writing and restoring every contender's
    checkpoint and printing its samples; the repetitions' go into `bench.samples`. Returns
    what is measured once, in fresh processes, on the last repetition's checkpoints: the
    restores' peak memory, and with --quick the first-restore runs."""
    memory: dict = {}
    first_runs = None
    last = bench.warmup + bench.reps - 1
    for rep in range(bench.warmup + bench.reps):
        record = rep >= bench.warmup
        got = timed_writes(bench, rep)
        # Warm restores first (the files are cached since the saves), then cold ones.
        got.update(warm_restores(bench, rep, record))
        got.update(cold_restores(bench, rep))
        got.update(orbax_restores(bench))
        if rep == last:
            memory = {
                "fcir": measure_memory("fcir", bench.fcir_path, bench.shape),
                "fcir_other": measure_memory("fcir", bench.fcir_path, bench.shape, "other"),
                **(
                    {}
                    if bench.args.quick
                    else {"orbax": measure_memory("orbax", bench.orbax_path, bench.shape)}
                ),
            }
            if bench.args.quick:  # keeps --first-restore from rotting
                first_runs = first_restore_runs(bench.fcir_path, bench.shape, ("fcir",), 1, 2)
        d_path = bench.dd_path
        for path in (bench.fcir_path, bench.orbax_path, d_path, d_path.with_suffix(".direct"),
                     bench.async_path, bench.busy_path):  # fmt: skip
            rm(path)
        print(
            ("rep" if record else "warm-up")
            + " "
            + " ".join(f"{k}={v:.3f}" for k, v in got.items()),
            flush=True,
        )
        if record:
            for k, v in got.items():
                bench.samples.setdefault(k, []).append(v)
    return memory, first_runs


def figures(samples: dict[str, list[float]], memory: dict) -> tuple[list[tuple], dict]:
    """The rows of the table, (figure, A, B, A/B, goal, met): the GOALS' time ratios of
    the medians, then the restores' peak extra memory over the restored bytes; and for
    each time ratio, its value in every repetition."""
    rows = []
    spreads: dict[str, list[float]] = {}
    for figure, num, den, goal, op in GOALS:
        ratio = median(samples[num]) / median(samples[den])
        ok = ratio >= goal if op == ">=" else ratio <= goal
        rows.append((figure, median(samples[num]), median(samples[den]), ratio, f"{op} {goal}", ok))
        spreads[figure] = per_rep_ratios(samples[num], samples[den])
    for key, figure in (
        ("fcir", "peak extra host memory of a restore / restored bytes"),
        ("fcir_other", "peak extra host memory onto mesh (4,2) / restored"),
    ):
        mem = memory[key]
        mem_ratio = (mem["peak"] - mem["before"]) / mem["restored"]
        rows.append(
            (
                figure,
                (mem["peak"] - mem["before"]) / 2**20,
                mem["restored"] / 2**20,
                mem_ratio,
                "<= 1.2",
                mem_ratio <= 1.2,
            )
        )
    return rows, spreads


def print_figures(rows: list[tuple], spreads: dict[str, list[float]]) -> None:
    print()
    print(
        f"{'figure':<52} {'A':>9} {'B':>9} {'A/B':>7}  {'goal':<7} ok   "
        "A/B of each repetition: median (min..max), goal met in"
    )
    for figure, a, b, ratio, goal, ok in rows:
        unit = "MiB" if "memory" in figure else "s"
        line = (
            f"{figure:<52} {a:>7.3f}{unit[0]:>2} {b:>7.3f}{unit[0]:>2} {ratio:>7.3f}  {goal:<7} "
            f"{'yes' if ok else 'NO ':<4}"
        )
        if figure in spreads:
            per = spreads[figure]
            op, value = goal.split()
            met = sum(r >= float(value) if op == ">=" else r <= float(value) for r in per)
            line += f" {median(per):.2f} ({min(per):.2f}..{max(per):.2f}), {met}/{len(per)}"
        print(line)


def print_save_phases_and_syncs(samples: dict[str, list[float]]) -> None:
    phases = [
        k
        for k in (
            "fcir_save_before_write",
            "fcir_save_write",
            "fcir_save_fsync",
            "fcir_save_after_write",
        )
        if k in samples
    ]
    print(
        "fcir save phases, s per repetition: "
        + "; ".join(f"{k[10:]} " + " ".join(f"{v:.3f}" for v in samples[k]) for k in phases)
        + " (total "
        + " ".join(f"{v:.3f}" for v in samples["fcir_save"])
        + ")"
    )
    print(
        f"untimed os.sync() before each timed call: median {median(PRESYNC):.3f} s, "
        f"max {max(PRESYNC):.3f} s over {len(PRESYNC)} calls"
    )


def print_conditions(bench: Bench, memory: dict) -> None:
    """The machine's load, how cached the warm and cold restores' files were, and
    orbax's restore memory (not a goal's row)."""
    print(f"load average (1, 5, 15 min) at the end: {os.getloadavg()}")
    if bench.warm_cached:
        print(
            f"(warm restores: {min(bench.warm_cached):.0%} at least of fcir's checkpoint was in "
            "the page cache before them)"
        )
    if bench.still_cached:
        print(
            f"(cold restores: after each drop, {max(bench.still_cached):.0%} at most of the "
            "checkpoint's pages were still cached)"
        )
    else:
        print("(cold restores: could not check that the page cache was dropped)")
    if "orbax" in memory:
        om = memory["orbax"]
        print(
            f"(orbax restore's peak extra memory: {(om['peak'] - om['before']) / 2**20:.0f} MiB, "
            f"{(om['peak'] - om['before']) / om['restored']:.2f}x the restored bytes)"
        )


def write_record(
    bench: Bench,
    memory: dict,
    rows: list[tuple],
    spreads: dict[str, list[float]],
    first: dict | None,
) -> None:
    result = {
        "benchmark": "checkpoint",
        "quick": bench.args.quick,
        "when": datetime.datetime.now(datetime.UTC).isoformat(),
        "config": {
            "big_shape": bench.shape,
            "n_big": N_BIG,
            "n_small": N_SMALL,
            "bytes": bench.nbytes,
            "devices": jax.device_count(),
            "repetitions": bench.reps,
            "warmup": bench.warmup,
        },
        "versions": {
            "python": platform.python_version(),
            "jax": jax.__version__,
            "jaxlib": jaxlib.__version__,
            "numpy": np.__version__,
            "orbax-checkpoint": _version("orbax-checkpoint"),
        },
        "cpu_count": os.cpu_count(),
        "samples_s": bench.samples,
        "memory_bytes": memory,
        "cached_after_drop": bench.still_cached,
        "cached_before_warm": bench.warm_cached,
        "presync_s": PRESYNC,
        "figures": [
            {
                "figure": f,
                "a": a,
                "b": b,
                "ratio": r,
                "goal": g,
                "ok": ok,
                **({"per_repetition": spreads[f]} if f in spreads else {}),
            }
            for f, a, b, r, g, ok in rows
        ],
        "first_restore": first,
        "load_average_at_end": os.getloadavg(),
    }
    _record.write(bench.args.results, "checkpoint", result, "quick" if bench.args.quick else None)


def run(args: argparse.Namespace) -> int:
    bench = set_up(args)
    memory, first_runs = measure(bench)
    if args.dir is None:
        shutil.rmtree(bench.work, ignore_errors=True)
    rows, spreads = figures(bench.samples, memory)
    print_figures(rows, spreads)
    print_save_phases_and_syncs(bench.samples)
    first = first_restore_summary(first_runs) if args.quick else None
    print_conditions(bench, memory)
    write_record(bench, memory, rows, spreads, first)
    return 0


# --- the first restore in a process, against later ones -------------------------------------

#: What a fresh process restores, each `--restores` times in a row: fcir as it is;
#: fcir with every block read into fresh host memory (no block mapped from the data
#: file: reader.MAP_ARRAY_BYTES out of reach), as before the mapping; the limit.
FIRST_KINDS = ("fcir", "fcir-read", "limit")


def first_restore_child(kind: str, path: str, rows: int, cols: int, restores: int) -> None:
    """Restores `path` onto the saved sharding `restores` times in this (fresh) process,
    dropping each result before the next, and prints each one's wall-clock, CPU times
    and minor page faults as JSON."""
    import resource

    from fcir.checkpoint import reader

    if kind == "fcir-read":
        reader.MAP_ARRAY_BYTES = 1 << 62
    target = abstract_tree((rows, cols), "saved")
    jax.block_until_ready(jax.device_put(np.zeros(8), shardings("saved")["small"]))
    out = []
    for _ in range(restores):
        before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        if kind == "limit":
            got = limit_restore(pathlib.Path(path), target)
        else:
            got = checkpoint.restore(path, target)
        jax.block_until_ready(got)
        wall, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF)
        del got
        gc.collect()
        out.append(
            {
                "wall": wall,
                "user": after.ru_utime - before.ru_utime,
                "sys": after.ru_stime - before.ru_stime,
                "minflt": after.ru_minflt - before.ru_minflt,
                "rss_after": rss_bytes(),
            }
        )
    print(json.dumps(out))


def first_restore_runs(
    path: pathlib.Path,
    shape: tuple[int, int],
    kinds: tuple[str, ...],
    processes: int,
    restores: int,
) -> dict[str, list[list[dict[str, float]]]]:
    """For each kind, `processes` fresh processes (the kinds' order rotated each round),
    each restoring checkpoint `path` `restores` times from a warm page cache."""
    runs: dict[str, list[list[dict[str, float]]]] = {k: [] for k in kinds}
    for p in range(processes):
        for kind in rotated(list(kinds), p):
            warm_page_cache(path)
            done = subprocess.run(
                [sys.executable, __file__, "--first-child", kind, str(path), *map(str, shape)]
                + [str(restores)],
                capture_output=True,
                text=True,
                check=True,
            )
            got = json.loads(done.stdout.strip().splitlines()[-1])
            runs[kind].append(got)
            print(f"{kind:<10} " + " ".join(f"{r['wall']:.3f}" for r in got), flush=True)
    return runs


def first_restore_summary(
    runs: dict[str, list[list[dict[str, float]]]],
) -> dict[str, dict[str, list[float]]]:
    """Prints and returns per kind the first restore's seconds, the later ones' (each
    process's median) and their ratio, one value per process."""

    def spread(xs: list[float]) -> str:
        return f"{median(xs):.3f} [{min(xs):.3f}, {max(xs):.3f}]"

    print(
        f"\n{'kind':<10} {'first restore, s':<24} {'later ones, s':<24} "
        f"{'first / later':<24} {'system s, first / later'}"
    )
    summary = {}
    for kind, procs in runs.items():
        first = [r[0]["wall"] for r in procs]
        later = [median([x["wall"] for x in r[1:]]) for r in procs]
        ratio = [a / b for a, b in zip(first, later)]
        sys_first = [r[0]["sys"] for r in procs]
        sys_later = [median([x["sys"] for x in r[1:]]) for r in procs]
        summary[kind] = {"first_s": first, "later_s": later, "first_over_later": ratio}
        print(
            f"{kind:<10} {spread(first):<24} {spread(later):<24} {spread(ratio):<24} "
            f"{median(sys_first):.3f} / {median(sys_later):.3f}"
        )
    print(
        "(each: median [min, max] over the processes; later: each process's median of "
        "its restores after the first)"
    )
    return summary


def run_first_restore(args: argparse.Namespace) -> int:
    """The first restore in a fresh process against the later ones in it, for each kind
    of FIRST_KINDS (`--processes` processes each, `--restores` restores per process).
    (`--quick` runs it as part of the main benchmark's smoke run instead.)"""
    shape = big_shape(args.size_mib)
    work = pathlib.Path(args.dir or tempfile.mkdtemp(prefix="fcir-ckpt-first-"))
    work.mkdir(parents=True, exist_ok=True)
    path = work / "fcir"
    rm(path)
    tree = make_tree(shape)
    nbytes = tree_bytes(tree)
    checkpoint.save(path, tree)
    del tree
    print(
        f"tree: {nbytes / 2**20:.1f} MiB over 8 devices; {args.processes} fresh process(es) "
        f"per kind x {args.restores} restores onto the saved sharding; load {os.getloadavg()}",
        flush=True,
    )
    runs = first_restore_runs(path, shape, FIRST_KINDS, args.processes, args.restores)
    if args.dir is None:
        shutil.rmtree(work, ignore_errors=True)
    summary = first_restore_summary(runs)
    print(f"load average at the end: {os.getloadavg()}")
    result = {
        "benchmark": "checkpoint-first-restore",
        "when": datetime.datetime.now(datetime.UTC).isoformat(),
        "config": {"big_shape": shape, "bytes": nbytes, "processes": args.processes},
        "versions": {
            "python": platform.python_version(),
            "jax": jax.__version__,
            "jaxlib": jaxlib.__version__,
            "numpy": np.__version__,
        },
        "cpu_count": os.cpu_count(),
        "runs": runs,
        "summary": summary,
        "load_average_at_end": os.getloadavg(),
    }
    _record.write(args.results, "checkpoint-first", result)
    return 0


def run_s3(args: argparse.Namespace) -> int:
    """fcir save/restore at an s3:// URL against the limit: the same bytes PUT and GET as
    64 MiB objects with plain boto3 calls, as many at a time as fcir keeps in flight.

    Without --s3-url, a local moto_server (moto[server]) is started for the run; its
    speed, not the network's, is then what both sides measure.
    """
    import concurrent.futures
    import contextlib

    import boto3
    from fcir.checkpoint import reader, storage, writer

    sys.path.insert(0, str(REPO / "tests" / "checkpoint"))
    with contextlib.ExitStack() as stack:
        if args.s3_url:
            url = args.s3_url.rstrip("/")
            endpoint = os.environ.get("AWS_ENDPOINT_URL")
        else:
            from s3_testing import BUCKET, moto_server, s3_env

            endpoint = stack.enter_context(moto_server())
            os.environ.update(s3_env(endpoint))
            url = f"s3://{BUCKET}/bench"
        bucket, _, prefix = url.removeprefix("s3://").partition("/")
        s3 = boto3.client("s3", endpoint_url=endpoint)
        if not args.s3_url:
            s3.create_bucket(Bucket=bucket)
        shape = big_shape(args.size_mib)
        tree = make_tree(shape)
        target = abstract_tree(shape, "saved")
        nbytes = sum(a.nbytes for a in tree["params"].values())
        blob = np.random.default_rng(1).random(nbytes // 4, dtype=np.float32).tobytes()
        pieces = [
            blob[i : i + writer.OBJECT_BYTES] for i in range(0, len(blob), writer.OBJECT_BYTES)
        ]
        pool = concurrent.futures.ThreadPoolExecutor(writer.OBJECT_THREADS)
        samples: dict[str, list[float]] = {
            k: []
            for k in ("fcir_save", "limit_put", "fcir_restore", "limit_get", "limit_get_ranged")
        }
        for rep in range(args.reps):
            where = f"{url}/r{rep}"
            t = time.perf_counter()
            checkpoint.save(where, tree)
            samples["fcir_save"].append(time.perf_counter() - t)
            keys = [f"{prefix}/limit{rep}/{k}" for k in range(len(pieces))]
            t = time.perf_counter()
            list(
                pool.map(
                    lambda kv: s3.put_object(Bucket=bucket, Key=kv[0], Body=kv[1]),
                    zip(keys, pieces),
                )
            )
            samples["limit_put"].append(time.perf_counter() - t)
            t = time.perf_counter()
            jax.block_until_ready(checkpoint.restore(where, target))
            samples["fcir_restore"].append(time.perf_counter() - t)
            t = time.perf_counter()
            list(pool.map(lambda k: s3.get_object(Bucket=bucket, Key=k)["Body"].read(), keys))
            samples["limit_get"].append(time.perf_counter() - t)
            # The requests a restore onto the saved sharding makes: each stored shard's
            # bytes in pieces of reader.PIECE_BYTES, as plain ranged GETs.
            lay = read_layout(where)
            ranges = [
                (f"{prefix}/r{rep}/{lay.files[sh.file].name}", sh.offset + a,
                 sh.offset + min(a + reader.PIECE_BYTES, sh.length) - 1)
                for item in lay.items for rec in item.arrays.arrays for sh in rec.shards
                for a in range(0, max(sh.length, 1), reader.PIECE_BYTES)
            ]  # fmt: skip

            def ranged(r: tuple[str, int, int]) -> bytes:
                return s3.get_object(Bucket=bucket, Key=r[0], Range=f"bytes={r[1]}-{r[2]}")[
                    "Body"
                ].read()

            t = time.perf_counter()
            list(pool.map(ranged, ranges))
            samples["limit_get_ranged"].append(time.perf_counter() - t)
            # Untimed: this repetition's objects go, so a local server's memory holds
            # one repetition's bytes at a time.
            storage.locate(where).delete_under("")
            s3.delete_objects(Bucket=bucket, Delete={"Objects": [{"Key": k} for k in keys]})
        pool.shutdown()
    mib = nbytes / 2**20
    print(
        f"\n{mib:.0f} MiB over {jax.device_count()} devices to {url} ({args.reps} reps; "
        f"{'local moto_server' if not args.s3_url else endpoint or 'AWS'})"
    )
    print(f"{'':<17} {'median s':>9} {'min..max s':>15} {'MiB/s':>8}")
    for k, v in samples.items():
        print(f"{k:<17} {median(v):>9.3f} {min(v):>7.3f}..{max(v):<7.3f} {mib / median(v):>8.1f}")
    print(
        f"save fcir/limit {median(samples['fcir_save']) / median(samples['limit_put']):.2f}x the "
        f"time, restore fcir/limit {median(samples['fcir_restore']) / median(samples['limit_get']):.2f}x"
        f" (whole objects), "
        f"{median(samples['fcir_restore']) / median(samples['limit_get_ranged']):.2f}x"
        " (the same ranged GETs)"
    )
    return 0


def _version(dist: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one repetition")
    parser.add_argument("--reps", type=int, default=5, help="measured repetitions (default 5)")
    parser.add_argument("--size-mib", type=float, default=None, help="bytes of the large leaves")
    parser.add_argument(
        "--settle", type=float, default=None, help="seconds of rest before each write (default 3)"
    )
    parser.add_argument("--dir", help="where to write checkpoints (default: a temporary dir)")
    parser.add_argument("--results", default=str(RESULTS), help="where to write the JSON")
    parser.add_argument(
        "--restore-repeats",
        type=int,
        default=3,
        help="runs of each warm restore per repetition, median taken (default 3)",
    )
    parser.add_argument("--memory-child", nargs=5, help=argparse.SUPPRESS)
    parser.add_argument(
        "--first-restore",
        action="store_true",
        help="only the first restore in fresh processes against the later ones (256 MiB;"
        " --quick runs one such process in the main benchmark's smoke run)",
    )
    parser.add_argument("--processes", type=int, default=6, help="fresh processes per kind")
    parser.add_argument("--restores", type=int, default=5, help="restores per fresh process")
    parser.add_argument("--first-child", nargs=5, help=argparse.SUPPRESS)
    parser.add_argument(
        "--s3",
        action="store_true",
        help="only the S3 figures (a local moto_server unless --s3-url)",
    )
    parser.add_argument("--s3-url", help="s3://BUCKET/PREFIX to measure against (AWS_* env)")
    args = parser.parse_args(argv)
    if args.memory_child:
        library, path, rows, cols, kind = args.memory_child
        measure_memory_child(library, path, int(rows), int(cols), kind)
        return 0
    if args.first_child:
        kind, path, rows, cols, restores = args.first_child
        first_restore_child(kind, path, int(rows), int(cols), int(restores))
        return 0
    if args.size_mib is None:
        args.size_mib = 1 if args.quick else 256 if args.first_restore else 1024
    if args.first_restore and not args.quick:
        return run_first_restore(args)
    if args.settle is None:
        args.settle = 0.0 if args.quick else 3.0
    if args.s3 or args.s3_url:
        return run_s3(args)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
