"""Pausing Python's cyclic garbage collector around work that builds large, acyclic,
long-lived structures: printing, parsing and capturing a module, lowering a program.

CPython runs a collection every few hundred net allocations and, now and then, a full
one that scans every tracked object. Building a module of 1e4-1e5 ops (or tracing and
lowering its jaxpr) makes millions of objects and no garbage cycles, so those passes
find nothing and made the work superlinear: at FAX scale (a 24-layer transformer
unrolled into ~7,000 ops) they were a third of capture's own time. Reference counting
still frees everything acyclic meanwhile; cycles made inside wait for the next
collection after the pause.
"""

from __future__ import annotations

import contextlib
import gc

__all__ = ["paused", "tenured"]

# Objects already in the permanent generation when fcir is imported. CPython 3.11
# starts with none; 3.12 starts with a few hundred of its own (375 on 3.12.1), so
# "nobody froze anything" is this count, not zero. Someone who freezes later (a
# pre-fork server: import, gc.freeze(), fork) raises it, and then tenured() leaves the
# permanent generation alone.
_FROZEN_AT_IMPORT = gc.get_freeze_count()


@contextlib.contextmanager
def paused():
    """The collector off for the block (as it was before, after)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


@contextlib.contextmanager
def tenured():
    """The collector off for the block, then the objects made meanwhile (and any other
    young ones) moved straight into the oldest generation.

    A module is 5-6 long-lived objects per op. Left young, the first allocation after
    the block triggers a collection that scans all of them, and they would be scanned
    again as middle-aged. gc.freeze() + gc.unfreeze() tenures them without a scan. That
    would also release objects someone else froze (e.g. a pre-fork server), so then it
    is skipped; the interpreter's own frozen objects (Python 3.12) count as nobody's."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if gc.get_freeze_count() <= _FROZEN_AT_IMPORT:
            gc.freeze()
            gc.unfreeze()
        if was_enabled:
            gc.enable()
