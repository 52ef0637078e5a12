"""A failing disk surfaces from the save (or handle.wait()) and leaves nothing committed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from ckpt_testing import child_env
from fcir.checkpoint import commit

from fcir import checkpoint
from fcir.errors import CheckpointError


def fail(errno_, message):
    def broken(*args, **kwargs):
        raise OSError(errno_, message)

    return broken


@pytest.mark.parametrize(
    ("call", "errno_", "message"),
    [
        ("pwrite", 28, "No space left on device"),
        ("write", 28, "No space left on device"),  # the layout file
        ("fsync", 5, "Input/output error"),
        ("rename", 5, "Input/output error"),
    ],
)
@pytest.mark.parametrize("blocking", [True, False])
def test_injected_write_errors_surface_and_leave_nothing(
    tmp_path, monkeypatch, call, errno_, message, blocking
):
    checkpoint.save(tmp_path / "old", {"x": np.ones(4)})
    monkeypatch.setattr(os, call, fail(errno_, message))
    with pytest.raises(CheckpointError, match=message):
        checkpoint.save(tmp_path / "new", {"x": np.zeros(2**20)}, blocking=blocking).wait()
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old"]
    assert checkpoint.restore(tmp_path / "old")["x"].tolist() == [1, 1, 1, 1]


def test_a_full_disk_for_real_surfaces_from_wait(tmp_path):
    """RLIMIT_FSIZE makes the kernel refuse writes past 1 MiB (EFBIG), as a full disk would."""
    script = textwrap.dedent(
        f"""
        import json, os, resource, signal
        import numpy as np
        from fcir import checkpoint
        from fcir.errors import CheckpointError
        checkpoint.save({str(tmp_path / "small")!r}, {{"x": np.ones(16)}})
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (2**20, 2**20))
        handle = checkpoint.save({str(tmp_path / "big")!r}, {{"x": np.ones(2**20)}},
                                 blocking=False)
        try:
            handle.wait()
            print(json.dumps({{"error": None}}))
        except CheckpointError as e:
            print(json.dumps({{"error": str(e)}}))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        env=child_env(1),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    error = json.loads(done.stdout.strip().splitlines()[-1])["error"]
    assert error is not None and "File too large" in error
    assert sorted(p.name for p in tmp_path.iterdir()) == ["small"]


def test_leftover_temporaries_are_removed_by_the_next_save(tmp_path):
    (tmp_path / ("a" + commit.TEMP_MARK + "dead")).mkdir()
    (tmp_path / ("a" + commit.TEMP_MARK + "dead") / "layout.pb").write_bytes(b"x")
    (tmp_path / ("b" + commit.TRASH_MARK + "dead")).mkdir()
    checkpoint.save(tmp_path / "c", {"x": np.ones(1)})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]
