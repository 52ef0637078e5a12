"""fcir.gcpause: ``tenured()`` moves what was made in the block into the oldest
generation on every supported Python (3.12 starts with objects of its own in the
permanent generation, which made it skip the move), and leaves objects that someone
froze after importing fcir frozen."""

from __future__ import annotations

import gc

from fcir import gcpause


class _Obj:
    pass


def _in_generation(obj, generation: int) -> bool:
    return any(o is obj for o in gc.get_objects(generation=generation))


def test_tenured_moves_objects_made_in_the_block_to_the_oldest_generation():
    with gcpause.tenured():
        made = [_Obj() for _ in range(100)]
    assert _in_generation(made, 2)
    assert not _in_generation(made, 0)
    assert gc.isenabled()


def test_tenured_leaves_objects_frozen_after_import_frozen():
    before = gc.get_freeze_count()
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        assert frozen > before
        with gcpause.tenured():
            made = [_Obj() for _ in range(100)]
        assert gc.get_freeze_count() == frozen
        assert not _in_generation(made, 2)
    finally:
        gc.unfreeze()
