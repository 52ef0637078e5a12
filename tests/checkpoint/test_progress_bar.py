"""Progress bars for long saves and restores: drawn on a terminal, silent otherwise."""

from __future__ import annotations

import io
import sys

import numpy as np
import pytest
from fcir.checkpoint import progress_bar

from fcir import checkpoint


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def no_delay(monkeypatch):
    monkeypatch.setattr(progress_bar, "DELAY_S", 0.0)
    monkeypatch.setattr(progress_bar, "_REDRAW_S", 0.0)


def test_the_bar_draws_on_a_terminal(no_delay):
    term = FakeTerminal()
    bar = progress_bar.Progress("saving x", 4 * 2**20, stream=term)
    bar.advance(2**20)
    bar.advance(3 * 2**20)
    bar.close()
    text = term.getvalue()
    assert "\rsaving x [#######" in text and " 25% 1/4 MiB" in text
    assert "100% 4/4 MiB" in text and text.endswith("\n")


def test_the_bar_is_silent_when_output_is_not_a_terminal(no_delay):
    pipe = io.StringIO()
    bar = progress_bar.Progress("saving x", 100, stream=pipe)
    bar.advance(100)
    bar.close()
    assert pipe.getvalue() == ""


def test_short_operations_draw_nothing():
    term = FakeTerminal()
    bar = progress_bar.Progress("saving x", 100, stream=term)
    bar.advance(100)
    bar.close()
    assert term.getvalue() == ""


def test_save_and_restore_draw_on_a_terminal_by_default(tmp_path, monkeypatch, no_delay):
    term = FakeTerminal()
    monkeypatch.setattr(sys, "stderr", term)
    checkpoint.save(tmp_path / "c", {"x": np.ones(2**20)})
    checkpoint.restore(tmp_path / "c")
    text = term.getvalue()
    assert "saving c [" in text and "restoring c [" in text and "100%" in text


def test_save_and_restore_are_silent_in_logs(tmp_path, capsys, no_delay):
    checkpoint.save(tmp_path / "c", {"x": np.ones(2**20)})
    checkpoint.restore(tmp_path / "c")
    assert capsys.readouterr().err == ""


def test_async_saves_draw_only_when_asked(tmp_path, monkeypatch, no_delay):
    term = FakeTerminal()
    monkeypatch.setattr(sys, "stderr", term)
    checkpoint.save(tmp_path / "a", {"x": np.ones(2**20)}, blocking=False).wait()
    assert term.getvalue() == ""
    checkpoint.save(tmp_path / "b", {"x": np.ones(2**20)}, blocking=False, progress=True).wait()
    assert "saving b [" in term.getvalue()
