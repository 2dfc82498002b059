"""A sweep point's stop rule and progress count, alike for thread and process workers."""

from __future__ import annotations

import math
import time
from types import SimpleNamespace

from spdl_lab._diagnose._sweep import SweepSettings, _Point

SETTINGS = SweepSettings(min_windows=3, max_windows=6, stable_within=0.10)


def _point():
    counted: list[int] = []
    workers = SimpleNamespace(kind="thread")  # the rule reads no worker
    return _Point("stage", workers, 1, SETTINGS, counted.append, math.inf, None), counted


def test_a_point_whose_fast_windows_agree_settles_and_the_bar_gets_all_its_windows():
    point, counted = _point()
    for qps in (1000, 640, 990, 1010):  # one slow spell: the fastest three agree at the fourth
        assert point.wants_window(0.3, math.inf) and not point.done
        point.add(qps)
    assert point.done and point.status == "ok"
    assert point.value == 1000 and point.spread == (1010 - 640) / 1000
    assert sum(counted) == SETTINGS.max_windows  # 4 measured + 2 not needed


def test_a_point_whose_windows_disagree_runs_to_the_cap_unstable():
    point, counted = _point()
    for qps in (1000, 800, 600, 1000, 800, 600):
        assert not point.done
        point.add(qps)
    assert point.done and point.status == "unstable" and len(point.qps) == SETTINGS.max_windows
    assert sum(counted) == SETTINGS.max_windows
    assert not point.wants_window(0.3, math.inf)


def test_the_budget_ends_a_point_that_has_its_required_windows():
    point, counted = _point()
    for qps in (1000, 800, 600):
        point.add(qps)
    assert not point.wants_window(0.3, time.monotonic())  # another window would end past it
    assert point.done and point.status == "unstable" and sum(counted) == SETTINGS.max_windows


def test_a_failed_point_counts_its_windows_once():
    point, counted = _point()
    point.add(1000)
    point.end("timeout")
    point.end("timeout")
    assert point.status == "timeout" and sum(counted) == SETTINGS.max_windows
    empty, _ = _point()
    empty.end("timeout")
    assert empty.value == 0.0 and math.isnan(empty.spread)
    never, _ = _point()
    assert math.isnan(never.value)
