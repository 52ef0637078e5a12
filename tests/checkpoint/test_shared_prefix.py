"""Several CheckpointManagers on one directory or prefix (a trainer and an evaluator, two
jobs): opening a manager never deletes what another one is still writing."""

from __future__ import annotations

import itertools
import threading

import numpy as np
from ckpt_testing import same_bits, values
from fcir.checkpoint import commit, storage

from fcir import checkpoint

_names = itertools.count()


def _tree(step):
    return {"state": {"w": values((64, 8), seed=step), "step": np.int64(step)}}


def _same(got, want):
    assert same_bits(got["state"]["w"], want["state"]["w"])
    assert got["state"]["step"] == want["state"]["step"]


def test_a_manager_opened_on_s3_while_another_saves_leaves_its_objects_alone(
    s3_endpoint, monkeypatch
):
    from s3_testing import BUCKET

    url = f"s3://{BUCKET}/shared{next(_names)}"
    trainer = checkpoint.CheckpointManager(url)
    trainer.save(1, _tree(1), blocking=True)
    real = storage.ObjectStore.write_many

    def open_another_before_the_commit(self, objects):
        objects = list(objects)
        if any(k == "layout.pb" for k, _ in objects) and self.url.endswith("/2"):
            checkpoint.CheckpointManager(url)  # e.g. an evaluator starting up
        real(self, objects)

    monkeypatch.setattr(storage.ObjectStore, "write_many", open_another_before_the_commit)
    trainer.save(2, _tree(2), blocking=True)
    monkeypatch.undo()
    _same(checkpoint.CheckpointManager(url).restore(2), _tree(2))


def test_a_manager_opened_on_a_directory_while_another_saves_leaves_its_save_alone(
    tmp_path, request
):
    trainer = checkpoint.CheckpointManager(tmp_path)
    trainer.save(1, _tree(1), blocking=True)
    gate = request.getfixturevalue("gate")  # holds the background writes from here on
    trainer.save(2, _tree(2))
    for _ in range(1000):
        if any(commit.TEMP_MARK in p.name for p in tmp_path.iterdir()):
            break
        threading.Event().wait(0.01)
    checkpoint.CheckpointManager(tmp_path)  # e.g. an evaluator starting up
    gate.set()
    trainer.wait_until_finished()
    _same(trainer.restore(2), _tree(2))
