"""Runs I/O tasks on a few threads and re-raises the first failure.

The threads are pooled: started when more are needed than are idle, then kept (as
daemon threads) for the next save or restore. Starting a thread makes the starter
wait until the new thread runs, and a new thread's stack is fresh memory; on this
project's VMs, after a second of idle, the five or so thread starts of a save cost
tens of milliseconds before its first byte was written. The calling thread works
on its own tasks too, so nested calls cannot starve for threads.

Plain threads rather than concurrent.futures: a background save may still be writing
while the interpreter shuts down, when executors refuse new work (saving.py waits for
that save in threading's shutdown hook, before daemon threads stop).
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable, Sequence

#: Shard reads and writes release the GIL (pread/pwrite/crc32/numpy copies). Twice the
#: cores, so that while one thread waits for the disk or a page fault another checksums;
#: at least 4, to keep a few requests in flight for the disk even on small machines.
THREADS = max(4, min(16, 2 * (os.cpu_count() or 2)))

_lock = threading.Lock()
_jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
_idle = 0  # pooled threads waiting for a job and not yet promised one


def _worker(first: list[Callable[[], None]]) -> None:
    global _idle
    # A job holds what its task reads into or writes from (a restore's buffers): it is
    # let go as soon as it is done, so that the pool never keeps those alive. Hence the
    # first job comes in a list emptied here: the Thread object keeps its args while
    # its target runs, which for a pooled thread is forever.
    job = first.pop()
    while True:
        job()  # jobs handle their own errors
        del job
        with _lock:
            _idle += 1
        job = _jobs.get()


def submit(job: Callable[[], None]) -> bool:
    """Runs `job()` on a pooled thread (an idle one, else a new one); False where no
    thread can be started (Python 3.12 refuses once the interpreter shuts down). `job`
    must not raise: it reports its own outcome."""
    global _idle
    with _lock:
        if _idle > 0:
            _idle -= 1
            _jobs.put(job)
            return True
    try:
        threading.Thread(target=_worker, args=([job],), name="fcir-ckpt-io", daemon=True).start()
    except RuntimeError:  # "can't create new thread at interpreter shutdown"
        return False
    return True


class Job:
    """`fn()` running on a pooled thread; `join()` waits for it and re-raises its error."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self._error: BaseException | None = None

    def join(self) -> None:
        self._done.wait()
        if self._error is not None:
            raise self._error


def start(fn: Callable[[], None]) -> Job | None:
    """`fn()` on a pooled thread, or None where no thread can be started."""
    job = Job()

    def run() -> None:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - re-raised by join()
            job._error = e
        finally:
            job._done.set()

    return job if submit(run) else None


def _after_fork_in_child() -> None:
    global _jobs, _idle, _lock
    _lock = threading.Lock()
    _jobs = queue.SimpleQueue()  # the parent's pooled threads do not exist here
    _idle = 0


os.register_at_fork(after_in_child=_after_fork_in_child)


def run_tasks(tasks: Sequence[Callable[[], None]], threads: int | None = None) -> None:
    """Calls every task, on up to `threads` (default THREADS) threads, the caller's
    among them; stops early and raises on failure."""
    if not tasks:
        return
    threads = max(1, min(THREADS if threads is None else threads, len(tasks)))
    if threads == 1:
        for task in tasks:
            task()
        return
    lock = threading.Lock()
    next_index = 0
    errors: list[BaseException] = []

    def drain() -> None:
        nonlocal next_index
        while True:
            with lock:
                if errors or next_index >= len(tasks):
                    return
                task = tasks[next_index]
                next_index += 1
            try:
                task()
            except BaseException as e:  # noqa: BLE001 - handed to the caller below
                with lock:
                    errors.append(e)
                return

    # Fewer helpers where threads cannot start (at exit): the caller does the rest.
    helpers = [h for h in (start(drain) for _ in range(threads - 1)) if h is not None]
    try:
        drain()
    finally:
        for h in helpers:
            h.join()
    if errors:
        raise errors[0]
