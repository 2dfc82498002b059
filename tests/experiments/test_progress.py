"""Progress bars show on a terminal or in a notebook, never in a log or a pipe."""

from __future__ import annotations

import io
import subprocess
import sys

from spdl_lab._progress import bar_kind, progress_bar


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


def test_widget_bar_in_a_kernel():
    # tqdm.auto takes a loaded ipykernel shell for a notebook; a fresh interpreter, so the choice is new.
    script = ("import ipykernel.zmqshell\nfrom spdl_lab._progress import bar_kind, progress_bar\n"
              "print(bar_kind(True), type(progress_bar(1, True, 's')).__mro__[1].__module__)")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[-2:] == ["notebook", "tqdm.auto"]
