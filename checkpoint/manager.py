"""`CheckpointManager`: numbered checkpoints in one directory, the newest N kept."""

from __future__ import annotations

import os
import pathlib
from collections.abc import Iterable, Mapping
from typing import Any, Self

import jax
from fcir.checkpoint import commit, orbax, storage
from fcir.checkpoint.layout import LAYOUT_FILE
from fcir.checkpoint.restoring import restore as _restore
from fcir.checkpoint.saving import SaveHandle
from fcir.checkpoint.saving import save as _save

from fcir.errors import CheckpointError


def _is_step(name: str) -> bool:
    return name.isdigit() and str(int(name)) == name


def _committed_steps(directory: storage.Location) -> list[int]:
    if isinstance(directory, storage.ObjectStore):
        return sorted(
            {  # a step fcir saved in Orbax's format has both markers
                int(step)
                for step, _, rest in (k.partition("/") for k in directory.list())
                if rest in (LAYOUT_FILE, orbax.COMMIT_SUCCESS) and _is_step(step)
            }
        )
    steps = []
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return []
    for entry in entries:
        name = entry.name
        if not _is_step(name):
            continue
        # An fcir step has its layout; a finished Orbax step (Orbax writes into a
        # `<step>.orbax-checkpoint-tmp-*` directory and renames it) its metadata.
        path = pathlib.Path(entry.path)
        if (path / LAYOUT_FILE).is_file() or (path / orbax.CHECKPOINT_METADATA).is_file():
            steps.append(int(name))
    return sorted(steps)


def _remove_uncommitted(directory: storage.ObjectStore) -> None:
    """Deletes the objects of fcir steps that crashed saves left without a layout.

    Only steps holding nothing but fcir's own objects (data and part layouts): anything
    else under a step number (an Orbax step being written, a user's file) is left alone.
    And only steps older than the newest committed one: an object store cannot tell a
    crashed save from one that another manager (an evaluator's, a second job's) is
    still writing, and such a save is of a step newer than every committed one;
    deleting its objects under it would let it commit a layout naming deleted data.
    """
    newest = max(_committed_steps(directory), default=-1)
    by_step: dict[str, list[str]] = {}
    for k in directory.list():
        step, _, rest = k.partition("/")
        if rest and _is_step(step):
            by_step.setdefault(step, []).append(rest)
    for step, rests in sorted(by_step.items()):
        if int(step) >= newest:
            continue
        ours = all(
            "/" not in r
            and (r.startswith("data-") and r.endswith(".bin") or r.startswith("layout.part-"))
            for r in rests
        )
        if ours:
            directory.delete_under(step + "/")


def _delete_step(directory: storage.Location, step: int) -> None:
    if isinstance(directory, storage.ObjectStore):
        path = directory / str(step)
        path.delete([LAYOUT_FILE])  # uncommitted first: no reader takes the rest for a step
        directory.delete_under(f"{step}/")
    else:
        commit.delete(directory / str(step))


class CheckpointManager:
    """Saves step `s` to `directory/s` and keeps the newest `max_to_keep` of them.

    `save` is asynchronous by default: it returns once the arrays are on the host. A
    failure of that background save is raised by the manager's next call (or by
    `wait_until_finished`). Only committed checkpoints count: a directory is a step
    when its name is the step number and it holds a layout, which the atomic commit
    guarantees is complete. Old checkpoints are deleted only after a newer one is
    committed. Leftovers of crashed saves are removed on construction and by every save.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        max_to_keep: int | None = None,
        save_interval_steps: int = 1,
        *,
        progress: bool | None = None,
        format: str = "fcir",  # noqa: A002 - as in fcir.checkpoint.save
    ) -> None:
        if max_to_keep is not None and max_to_keep < 1:
            raise CheckpointError(f"max_to_keep must be at least 1 or None, got {max_to_keep}")
        if save_interval_steps < 1:
            raise CheckpointError(
                f"save_interval_steps must be at least 1, got {save_interval_steps}"
            )
        self.directory = storage.locate(directory)
        self.max_to_keep = max_to_keep
        self.save_interval_steps = save_interval_steps
        self.progress = progress
        self.format = format
        self._handle: SaveHandle | None = None
        if jax.process_index() == 0:
            if isinstance(self.directory, storage.ObjectStore):
                _remove_uncommitted(self.directory)
            else:
                self.directory.mkdir(parents=True, exist_ok=True)
                commit.remove_leftovers(self.directory)

    def _settle(self, wait: bool) -> None:
        """Raises the error of the last background save once; waits for it if asked."""
        handle = self._handle
        if handle is None or not (wait or handle.done()):
            return
        self._handle = None
        handle.wait()

    def all_steps(self) -> list[int]:
        """The committed steps, oldest first."""
        self._settle(wait=False)
        return _committed_steps(self.directory)

    def latest_step(self) -> int | None:
        """The newest committed step, or None when there is none."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def should_save(self, step: int) -> bool:
        return step % self.save_interval_steps == 0

    def save(
        self, step: int, tree: Mapping[str, Any], *, blocking: bool = False, force: bool = False
    ) -> bool:
        """Saves `tree` as `step` if the interval says so (or `force`); returns whether it did."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise CheckpointError(f"step must be a non-negative int, got {step!r}")
        self._settle(wait=True)
        if not force and not self.should_save(step):
            return False
        if step in self.all_steps():
            raise CheckpointError(f"step {step} is already saved in {self.directory}")
        self._handle = _save(
            self.directory / str(step),
            tree,
            blocking=blocking,
            progress=self.progress,
            format=self.format,
            _after_commit=self._prune,
            # Orbax's CheckpointManager reads every item from its own subfolder.
            _item_folders=self.format == "orbax",
        )
        if blocking:
            self._handle = None
        return True

    def _prune(self) -> None:
        # Runs on process 0 right after a commit, so the new step is already listed.
        if self.max_to_keep is None:
            return
        steps = _committed_steps(self.directory)
        for step in steps[: -self.max_to_keep]:
            _delete_step(self.directory, step)

    def restore(
        self,
        step: int | None = None,
        target: Mapping[str, Any] | None = None,
        *,
        items: Iterable[str] | None = None,
        progress: bool | None = None,
        cast: bool = False,
    ) -> dict[str, Any]:
        """Restores `step` (default: the latest); see `fcir.checkpoint.restore`."""
        self._settle(wait=True)
        if step is None:
            step = self.latest_step()
            if step is None:
                raise CheckpointError(f"no committed checkpoint in {self.directory}")
        elif step not in self.all_steps():
            raise CheckpointError(f"step {step} is not a committed checkpoint in {self.directory}")
        return _restore(
            self.directory / str(step), target, items=items, progress=progress, cast=cast
        )

    def wait_until_finished(self) -> None:
        """Blocks until the last save is committed; raises its error if it failed."""
        self._settle(wait=True)

    def close(self) -> None:
        self.wait_until_finished()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
