"""``children.receive`` and ``Child.close``, the one way the lab reads and stops a child it spawned:
a message, a deadline, a crash report, a child that exits without a word."""

from __future__ import annotations

import math
import time

import pytest

from spdl_lab._runners.children import ChildGone, ChildTraceback, receive, spawn

pytestmark = [pytest.mark.timeout(60)]

#: A child that does what its parent's first message says: "echo", "crash" or "exit".
CHILD = """
import sys, traceback
from multiprocessing.connection import Connection
data = Connection(int(sys.argv[-2]), readable=False)
ctrl = Connection(int(sys.argv[-1]), writable=False)
what = ctrl.recv()
if what == "echo":
    data.send(("echo",))
    ctrl.recv()  # ("stop",) from Child.close
elif what == "crash":
    try:
        raise ValueError("bad init")
    except ValueError:
        data.send(("crash", traceback.format_exc()))
sys.exit(3)
"""


def started(what: str):
    child = spawn(["-c", CHILD])
    child.ctrl.send(what)
    return child


def test_a_message_comes_back_and_close_stops_the_child():
    child = started("echo")
    try:
        assert receive(child, time.monotonic() + 30) == ("echo",)
        assert receive(child, time.monotonic() + 0.2) is None  # nothing more by the deadline
    finally:
        child.close(timeout=5.0)
    assert child.proc.returncode == 3 and child.data.closed and child.ctrl.closed


def test_a_crash_report_is_raised_with_the_child_traceback_as_its_cause():
    child = started("crash")
    try:
        with pytest.raises(ChildGone) as info:
            receive(child, math.inf)
        assert isinstance(info.value.__cause__, ChildTraceback)
        assert "ValueError: bad init" in str(info.value.__cause__)
    finally:
        child.close(timeout=5.0)


def test_a_child_that_exits_without_a_word_is_gone_before_the_deadline():
    child = started("exit")
    try:
        t0 = time.monotonic()
        with pytest.raises(ChildGone) as info:
            receive(child, math.inf)
        assert info.value.__cause__ is None and time.monotonic() - t0 < 10
        assert child.proc.wait(5) == 3
    finally:
        child.close(timeout=5.0)
