"""Atomic publication of a checkpoint directory, and removal of what crashes leave.

A checkpoint is assembled in a temporary sibling directory `<name>.fcir-tmp-<nonce>`
and renamed into place once every byte in it is durable; the rename is the commit. A
directory about to be deleted is first renamed to `<name>.fcir-old-<nonce>`, so a
crash mid-deletion never leaves a half-deleted checkpoint under its real name. Both
kinds of name are never taken for a checkpoint and are removed by the next save.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import pathlib
import secrets
import shutil
import sys
import time

from fcir.errors import CheckpointError

TEMP_MARK = ".fcir-tmp-"
TRASH_MARK = ".fcir-old-"


def is_leftover(name: str) -> bool:
    return TEMP_MARK in name or TRASH_MARK in name


def nonce() -> str:
    return f"{time.time_ns() // 1_000_000:x}-{secrets.token_hex(4)}"


#: Temporary directory -> the descriptor holding its lock, while its save runs.
_locks: dict[pathlib.Path, int] = {}


def temp_dir(final: pathlib.Path) -> pathlib.Path:
    """Creates and returns a fresh temporary directory next to `final`, locked.

    The lock (flock on the directory) says the save is alive: `remove_leftovers` of
    another manager or process leaves a locked directory alone, and the kernel drops
    the lock of a process that dies, so a crashed save's directory is removable.
    """
    path = final.with_name(final.name + TEMP_MARK + nonce())
    path.mkdir()
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a fresh name: nobody else holds it
    _locks[path] = fd
    return path


def release(temp: pathlib.Path | None) -> None:
    """Drops the lock of `temp` (once its save committed or gave up)."""
    fd = _locks.pop(temp, None) if temp is not None else None
    if fd is not None:
        os.close(fd)


def _in_flight(path: str) -> bool:
    """Whether a live save holds the lock of the temporary directory `path`."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # also drops the lock just taken
    return False


def remove_leftovers(parent: pathlib.Path) -> list[str]:
    """Deletes the temporary and to-be-deleted directories crashed saves left in `parent`.

    A temporary directory whose save is still running (another manager's, another
    process's) is locked and left alone.
    """
    removed = []
    try:
        entries = list(os.scandir(parent))
    except FileNotFoundError:
        return removed
    for entry in entries:
        if TEMP_MARK in entry.name and _in_flight(entry.path):
            continue
        if is_leftover(entry.name):
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(entry.name)
    return removed


def fsync_dir(path: pathlib.Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def delete(path: pathlib.Path) -> None:
    """Deletes a checkpoint directory; atomically, as far as readers can tell."""
    trash = path.with_name(path.name + TRASH_MARK + nonce())
    os.rename(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def _exchanger():  # type: ignore[no-untyped-def]
    """renameat2(RENAME_EXCHANGE) where Linux's libc has it, else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    at_fdcwd, rename_exchange = -100, 2

    def exchange(a: pathlib.Path, b: pathlib.Path) -> bool:
        return fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0

    return exchange


_exchange = _exchanger()


def publish(temp: pathlib.Path, final: pathlib.Path, overwrite: bool) -> None:
    """Renames the complete, fsynced `temp` to `final` and makes the rename durable.

    With `overwrite`, an existing `final` is swapped out atomically where the OS
    supports it (Linux renameat2); elsewhere it is moved aside first, so a crash in
    between leaves no checkpoint at `final` (the old one survives under a
    `.fcir-old-` name until the next save removes it).
    """
    fsync_dir(temp)
    if os.path.lexists(final):
        if not overwrite:
            raise CheckpointError(f"{final} already exists; pass overwrite=True to replace it")
        if _exchange is not None and _exchange(temp, final):
            fsync_dir(final.parent)
            shutil.rmtree(temp, ignore_errors=True)  # it now holds the old checkpoint
            return
        trash = final.with_name(final.name + TRASH_MARK + nonce())
        os.rename(final, trash)
        os.rename(temp, final)
        fsync_dir(final.parent)
        shutil.rmtree(trash, ignore_errors=True)
        return
    os.rename(temp, final)
    fsync_dir(final.parent)
