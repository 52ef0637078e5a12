"""Runs I/O tasks on a few threads and re-raises the first failure.

Plain threads rather than concurrent.futures: a background save may still be writing
while the interpreter shuts down, when executors refuse new work.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence

#: Shard reads and writes release the GIL (pread/pwrite/crc32/numpy copies). Twice the
#: cores, so that while one thread waits for the disk or a page fault another checksums;
#: at least 4, to keep a few requests in flight for the disk even on small machines.
THREADS = max(4, min(16, 2 * (os.cpu_count() or 2)))


def run_tasks(tasks: Sequence[Callable[[], None]], threads: int | None = None) -> None:
    """Calls every task, on up to `threads` (default THREADS) threads; stops early and
    raises on failure."""
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

    def worker() -> None:
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

    workers = [threading.Thread(target=worker, name="fcir-ckpt-io") for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    if errors:
        raise errors[0]
