"""The straggler verdict on synthetic ranks: a rank's window from its ticks, and each rule."""

from __future__ import annotations

import math

import numpy as np
import pytest

from spdl_lab._telemetry import live_verdict as s
from spdl_lab._telemetry.frames import FrameChunk
from spdl_lab._telemetry.live_verdict import RankWindow, StageWindow, judge, rank_window


def ticks(*, steps_per_s: float, wait_ms: float, step_ms: float, seconds: float = 12.0, hz: float = 10.0,
          stages: dict[str, tuple[float, float, int]] | None = None) -> FrameChunk:
    """A rank's ticks as its sampler writes them, steady; ``stages``: name -> (qps, busy_frac, concurrency)."""
    times = np.arange(int(seconds * hz)) / hz
    n = len(times)
    columns = {("steps", "step"): np.floor(steps_per_s * times),
               ("data_wait_ms", "step"): np.full(n, wait_ms), ("step_ms", "step"): np.full(n, step_ms)}
    for name, (qps, busy, concurrency) in (stages or {}).items():
        columns[("qps", name)] = np.full(n, qps)
        columns[("busy_frac", name)] = np.full(n, busy)
        columns[("concurrency", name)] = np.full(n, float(concurrency))
    return FrameChunk(n, times, columns)


def window(rank: int, wait_ms: float, step_ms: float, *, state: str = "running", steps: int = 100,
           stages: tuple[StageWindow, ...] = ()) -> RankWindow:
    return RankWindow(rank, state, steps, steps / 10.0, wait_ms, step_ms, wait_ms / (wait_ms + step_ms),
                      stages)


def test_a_ranks_window_reads_its_steps_wait_and_stages():
    chunk = ticks(steps_per_s=20, wait_ms=30, step_ms=20, stages={"fetch": (320, 0.8, 2)})
    w = rank_window(chunk, 1, "running", window_s=10)
    assert w.rank == 1 and w.steps == pytest.approx(200, abs=2)
    assert w.steps_per_s == pytest.approx(20, rel=0.02)
    assert w.data_wait_ms == pytest.approx(30) and w.step_ms == pytest.approx(20)
    assert w.wait_frac == pytest.approx(0.6)
    (fetch,) = w.stages
    assert fetch.name == "fetch" and fetch.concurrency == 2
    assert fetch.items_per_s == pytest.approx(320) and fetch.capacity_per_s == pytest.approx(400)


def test_a_window_with_no_ticks_or_no_steps_has_no_figures():
    assert rank_window(FrameChunk(0, np.empty(0), {}), 0, "running").steps == 0
    w = rank_window(ticks(steps_per_s=0, wait_ms=math.nan, step_ms=math.nan), 0, "running")
    assert w.steps == 0 and math.isnan(w.wait_frac)


def test_shares_stay_within_0_and_1_whatever_the_ticks_say():
    chunk = ticks(steps_per_s=5, wait_ms=1e9, step_ms=0.0)
    w = rank_window(chunk, 0, "running")
    assert 0.0 <= w.wait_frac <= 1.0
    negative = ticks(steps_per_s=5, wait_ms=-3.0, step_ms=-1.0)  # not what a clock writes: no share from it
    assert math.isnan(rank_window(negative, 0, "running").wait_frac)
    falling = ticks(steps_per_s=5, wait_ms=3.0, step_ms=1.0)
    falling.columns[("steps", "step")][:] = falling.columns[("steps", "step")][::-1]  # a counter that falls
    assert rank_window(falling, 0, "running").steps == 0


def test_the_rank_that_waits_for_data_and_holds_the_others_back_is_named():
    slow = window(1, wait_ms=60, step_ms=10, stages=(StageWindow("fetch", 200, 210, 2),))
    fast = window(0, wait_ms=1, step_ms=70, stages=(StageWindow("fetch", 200, 950, 2),))
    verdict = judge([fast, slow], world_size=2)
    assert verdict.kind == "straggler" and verdict.straggler == 1
    assert verdict.text.startswith("rank 1 waits 86% of its loop for data; rank 0 waits for rank 1")
    assert "+600%" in verdict.text and "rank 1's fetch can make 210 items/s against 950 on rank 0" in verdict.text


def test_with_more_ranks_the_others_are_taken_together():
    ranks = [window(0, 1, 70), window(1, 2, 72), window(2, 60, 10), window(3, 1, 69)]
    verdict = judge(ranks, world_size=4)
    assert verdict.straggler == 2
    assert "the other ranks wait for rank 2 in the all-reduce (their step" in verdict.text


def test_a_stage_as_fast_as_elsewhere_is_not_blamed():
    slow = window(1, 60, 10, stages=(StageWindow("collate", 12, 500, 1),))
    fast = window(0, 1, 70, stages=(StageWindow("collate", 12, 510, 1),))
    assert "collate" not in judge([fast, slow]).text


def test_balanced_ranks_are_said_balanced():
    verdict = judge([window(0, 1, 50), window(1, 1.5, 52)], world_size=2)
    assert verdict.kind == "balanced" and verdict.straggler is None
    assert verdict.text.startswith("balanced: no rank waits long for data (the most: rank 1, 3% of its loop)")


def test_a_rank_that_computes_slowly_is_no_data_straggler():
    # Its step is long, so every rank's is (the others wait for it in the all-reduce); no one waits for data.
    verdict = judge([window(0, 2, 90), window(1, 1, 91)], world_size=2)
    assert verdict.kind == "balanced" and verdict.straggler is None and "not by loading" in verdict.text


def test_every_rank_waiting_for_data_is_input_bound_not_a_straggler():
    verdict = judge([window(0, 40, 50), window(1, 45, 50)], world_size=2)
    assert verdict.kind == "input-bound" and verdict.straggler is None


def test_a_rank_that_waits_but_holds_no_one_back_is_not_named():
    verdict = judge([window(0, 1, 20), window(1, 30, 20)], world_size=2)
    assert verdict.kind == "balanced" and verdict.straggler is None and "holds no rank back" in verdict.text


def test_the_thresholds_are_the_named_constants():
    below = s.WAITS_FOR_DATA - 0.01
    wait = 100 * below / (1 - below)  # a loop of 100 ms of step with that share of wait
    assert judge([window(0, 0.0, 150), window(1, wait, 100)]).straggler is None
    above = s.WAITS_FOR_DATA + 0.01
    wait = 100 * above / (1 - above)
    assert judge([window(0, 0.0, 150), window(1, wait, 100)]).straggler == 1


def test_too_few_steps_or_ranks_waits():
    assert judge([window(0, 1, 50)], world_size=2).text == "waiting for ranks: 1 of 2 published so far"
    verdict = judge([window(0, 1, 50), window(1, 60, 10, steps=s.MIN_STEPS - 1)], world_size=2)
    assert verdict.kind == "waiting" and f"rank 1 has {s.MIN_STEPS - 1} of the {s.MIN_STEPS} needed" in verdict.text


def test_a_rank_that_died_is_named_with_what_became_of_the_others():
    verdict = judge([window(0, 1, 50, state="stopped"), window(1, 60, 10, state="killed")], world_size=2)
    assert verdict.kind == "ended" and verdict.text == "rank 1 died (killed); rank 0 stopped"


def test_a_ranks_first_steps_wait_for_its_loader_to_start_and_are_not_counted():
    chunk = ticks(steps_per_s=10, wait_ms=5, step_ms=45)
    wait = chunk.columns[("data_wait_ms", "step")]
    steps = chunk.columns[("steps", "step")]
    wait[steps <= s.WARMUP_STEPS] = 900.0  # the workers starting: the first batches come late
    w = rank_window(chunk, 0, "running", window_s=30)
    assert w.data_wait_ms == pytest.approx(5) and w.wait_frac == pytest.approx(0.1)
    assert w.steps == pytest.approx(steps[-1] - s.WARMUP_STEPS, abs=1)
