"""The diagnosis's time budget and window lengths: what a point may still take, and for how long."""

from __future__ import annotations

import contextlib
import time

import pytest

import spdl_lab as lab
from spdl_lab._diagnose._sweep import (
    BUDGET_FLOOR,
    MAX_WINDOW_S,
    StageFeed,
    Sweep,
    SweepSettings,
    budget_cut,
    window_for,
)

pytestmark = pytest.mark.usefixtures("no_thread_leak", "no_child_leak")


def test_a_window_holds_a_few_tasks_per_worker() -> None:
    assert window_for(0.3, 1, 1000.0) == 0.3  # fast: the settings' window
    assert window_for(0.3, 16, 70.0) == pytest.approx(4 * 16 / 70.0)  # 16 workers on 70 tasks/s: ~0.9 s
    assert window_for(0.3, 1, 0.5) == MAX_WINDOW_S  # 2 s tasks: capped


def test_budget_cut_spares_required_windows_until_the_deadline_has_passed() -> None:
    now = time.monotonic()
    later, passed = now + 60.0, now - 1.0
    assert not budget_cut(4, 0.3, later, min_windows=4)  # time left: extra windows go on
    assert budget_cut(4, 0.3, now + 0.1, min_windows=4)  # an extra window would end past it
    assert not budget_cut(3, 0.3, now + 0.1, min_windows=4)  # a required one still runs...
    assert budget_cut(3, 0.3, passed, min_windows=4)  # ...until the deadline has passed
    assert not budget_cut(BUDGET_FLOOR - 1, 0.3, passed, min_windows=4)  # the floor always runs


def wavers(x):
    """Sleeps 1 ms or 3 ms, by the quarter second: 0.1 s windows disagree by up to 3x."""
    time.sleep(0.001 if time.monotonic() % 0.5 < 0.25 else 0.003)
    return x


def _diagnose(budget: float) -> lab.Diagnosis:
    settings = SweepSettings(warmup_s=0.05, window_s=0.1, min_windows=3, max_windows=8,
                             stage_budget_s=budget)
    p = lab.Pipeline(range(40)).map(wavers, name="wavers")
    # Measured here, so that the windows never agreeing (below) holds.
    return lab.diagnose(p, (1, 2), num_items=20, processes=False, settings=settings, progress=False,
                        isolated=False)


@pytest.mark.timeout(60)
def test_points_whose_windows_disagree_stop_at_the_budget_not_at_max_windows(monkeypatch) -> None:
    from spdl_lab._diagnose import _sweep

    monkeypatch.setattr(_sweep, "quiet", lambda windows, within, at_least: False)
    free = _diagnose(budget=60.0).stages["wavers"].points
    assert [p.repeats for p in free] == [8, 8], "the windows should disagree, so each point runs to the cap"
    spent = _diagnose(budget=0.001).stages["wavers"]
    assert [(p.repeats, p.status) for p in spent.points] == [(BUDGET_FLOOR, "unstable")] * 2
    # A verdict, though unsettled; unless other processes took the cores (the unit set runs in parallel).
    assert spent.verdict is not None or spent.evidence.startswith("unstable: the machine was busy")


@pytest.mark.timeout(60)
def test_process_points_stop_at_the_budget_too() -> None:
    plan = SweepSettings(warmup_s=0.05, window_s=0.1, min_windows=3, max_windows=8)
    with contextlib.closing(Sweep(plan)) as sweeper:
        sweeper.add(StageFeed("wavers", wavers, list(range(8))), "process", (1,), deadline=time.monotonic())
        while not sweeper.done():
            sweeper.round()
    sweep = sweeper.results("process")["wavers"]
    assert [(p.repeats, p.status) for p in sweep.points] == [(BUDGET_FLOOR, "unstable")]
