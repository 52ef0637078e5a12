"""CheckpointManager: numbered steps, retention, intervals, background errors."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
from ckpt_testing import same_bits
from fcir.checkpoint import commit

from fcir import checkpoint
from fcir.errors import CheckpointError


def state(step: int) -> dict:
    return {"params": {"w": np.full((4, 4), float(step))}, "step": step}


def disk_full(fd, data, offset):
    raise OSError(28, "disk full")


def test_save_latest_all_and_restore(tmp_path):
    with checkpoint.CheckpointManager(tmp_path / "run", max_to_keep=3) as mgr:
        assert mgr.latest_step() is None and mgr.all_steps() == []
        for step in range(5):
            assert mgr.save(step, state(step))
        mgr.wait_until_finished()
        assert mgr.all_steps() == [2, 3, 4] and mgr.latest_step() == 4
        out = mgr.restore()
        assert out["step"] == 4 and same_bits(out["params"]["w"], state(4)["params"]["w"])
        assert mgr.restore(2, {"params": {"w": np.zeros((4, 4))}})["params"]["w"][0, 0] == 2.0
        with pytest.raises(CheckpointError, match="step 1 is not a committed checkpoint"):
            mgr.restore(1)


def test_save_interval_steps_and_force(tmp_path):
    mgr = checkpoint.CheckpointManager(tmp_path, save_interval_steps=10)
    saved = [s for s in range(25) if mgr.save(s, state(s), blocking=True)]
    assert saved == [0, 10, 20]
    assert mgr.save(23, state(23), force=True, blocking=True)
    assert mgr.all_steps() == [0, 10, 20, 23]


def test_a_step_cannot_be_saved_twice(tmp_path):
    mgr = checkpoint.CheckpointManager(tmp_path)
    mgr.save(1, state(1), blocking=True)
    with pytest.raises(CheckpointError, match="step 1 is already saved"):
        mgr.save(1, state(1))


def test_restore_waits_for_the_save_in_flight(tmp_path):
    mgr = checkpoint.CheckpointManager(tmp_path)
    mgr.save(7, state(7))
    assert mgr.restore()["step"] == 7


def test_the_checkpoint_being_written_is_never_deleted(tmp_path, monkeypatch):
    """With max_to_keep=1, the old step survives until the new one is committed."""
    mgr = checkpoint.CheckpointManager(tmp_path, max_to_keep=1)
    mgr.save(1, state(1), blocking=True)
    gate = threading.Event()
    real = os.pwrite

    def slow(fd, data, offset):
        assert gate.wait(30)
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", slow)
    mgr.save(2, state(2))
    try:
        while not any(commit.TEMP_MARK in p.name for p in tmp_path.iterdir()):
            threading.Event().wait(0.01)  # step 2 is being written
        assert mgr.all_steps() == [1] and mgr.latest_step() == 1
    finally:
        gate.set()
    mgr.wait_until_finished()
    assert mgr.all_steps() == [2]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["2"]


def test_background_errors_are_raised_by_the_next_call(tmp_path, monkeypatch):
    mgr = checkpoint.CheckpointManager(tmp_path)
    monkeypatch.setattr(os, "pwrite", disk_full)
    mgr.save(1, state(1))
    while not mgr._handle.done():
        threading.Event().wait(0.01)
    monkeypatch.undo()
    with pytest.raises(CheckpointError, match="disk full"):
        mgr.save(2, state(2))
    assert mgr.all_steps() == []  # raised once
    assert mgr.save(2, state(2), blocking=True) and mgr.all_steps() == [2]


def test_background_errors_are_raised_by_latest_step_once_known(tmp_path, monkeypatch):
    mgr = checkpoint.CheckpointManager(tmp_path)
    monkeypatch.setattr(os, "pwrite", disk_full)
    mgr.save(1, state(1))
    while not mgr._handle.done():
        threading.Event().wait(0.01)
    monkeypatch.undo()
    with pytest.raises(CheckpointError, match="disk full"):
        mgr.latest_step()
    assert mgr.latest_step() is None


def test_construction_removes_leftovers_and_ignores_foreign_entries(tmp_path):
    (tmp_path / ("3" + commit.TEMP_MARK + "x")).mkdir()
    (tmp_path / ("1" + commit.TRASH_MARK + "x")).mkdir()
    (tmp_path / "4").mkdir()  # no layout: not a checkpoint
    (tmp_path / "007").mkdir()
    (tmp_path / "notes.txt").write_text("hi")
    mgr = checkpoint.CheckpointManager(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["007", "4", "notes.txt"]
    assert mgr.all_steps() == [] and mgr.latest_step() is None
    with pytest.raises(CheckpointError, match="no committed checkpoint"):
        mgr.restore()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"max_to_keep": 0}, "max_to_keep"), ({"save_interval_steps": 0}, "save_interval_steps")],
)
def test_bad_arguments(tmp_path, kwargs, message):
    with pytest.raises(CheckpointError, match=message):
        checkpoint.CheckpointManager(tmp_path, **kwargs)


def test_bad_step(tmp_path):
    with pytest.raises(CheckpointError, match="non-negative int"):
        checkpoint.CheckpointManager(tmp_path).save(-1, state(0))
