"""Progress bars show on a terminal or in a notebook, never in a log or a pipe."""

from __future__ import annotations

import io
import sys

from spdl_lab.progress import bar_kind, progress_bar


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_no_bar_in_a_pipe_or_log(monkeypatch):
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert bar_kind(True) is None
    bar = progress_bar(10, True, "step")
    bar.update(5)
    bar.close()
    assert sys.stderr.getvalue() == ""


def test_text_bar_on_a_terminal(monkeypatch):
    monkeypatch.setattr(sys, "stderr", _Tty())
    assert bar_kind(True) == "terminal"
    assert bar_kind(False) is None
    bar = progress_bar(10, True, "step")
    bar.update(10)
    bar.close()
    assert "0/10" in sys.stderr.getvalue()  # drawn (and cleared at the end: leave=False)
