"""The live verdict on synthetic frames: each rule, its threshold, and its advice."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from spdl_lab._telemetry import live_verdict as v
from spdl_lab._telemetry.frames import FRAME_COLUMNS, FrameChunk
from spdl_lab._telemetry.live_verdict import WINDOW_S, Verdict, Window, live_verdict

CONTROLS = {"read": 8, "decode": 2, "collate": 1}


def frames(
    *, data_wait: float, gil: float | None = None, queued: float = 0.0, busy: dict[str, float],
    cpu_percent: float = 100.0, seconds: float = 8.0, hz: float = 10.0, steps_per_s: float = 5.0,
) -> pd.DataFrame:
    """Long-format frames as a sampler writes them, steady at the given values."""
    rows = []
    for i in range(int(seconds * hz)):
        t = i / hz
        rows.append((t, "steps", "step", steps_per_s * t))
        rows.append((t, "data_wait_frac", "step", data_wait))
        rows.append((t, "cpu_percent", "total", cpu_percent))
        rows.append((t, "gil_wait_frac", "gil", 0.45))  # the probe reads high anyway: ignored
        if gil is not None:
            rows.append((t, "gil_wait_frac", "train", gil))
            rows.append((t, "runqueue_wait_frac", "train", queued))
        for stage, b in busy.items():
            rows.append((t, "busy_frac", stage, b))
    return pd.DataFrame(rows, columns=FRAME_COLUMNS)


def verdict_from_frames(frames: pd.DataFrame, *, runner: str, controls: dict[str, int] | None = None,
                        cpu_cores: int = 1) -> Verdict:
    """The live verdict for long-format frames, through a Window as the dashboard keeps one."""
    window = Window(WINDOW_S, max_ticks=max(2, frames["time_s"].nunique()))
    if not frames.empty:
        wide = frames.pivot_table(index="time_s", columns=["series", "stage"], values="value",
                                  aggfunc="last")
        times = wide.index.to_numpy(dtype=float)
        columns = {key: wide[key].to_numpy(dtype=float) for key in wide.columns}
        window.add(FrameChunk(len(times), times, columns))
    return live_verdict(window.means(), runner=runner, controls=controls, cpu_cores=cpu_cores)


def test_starved_names_the_slowest_stage_and_suggests_more_concurrency():
    f = frames(data_wait=0.63, gil=0.02, busy={"source": 1.0, "read": 0.2, "decode": 1.0, "collate": 0.1})
    verdict = verdict_from_frames(f, runner="thread", controls=CONTROLS, cpu_cores=2)
    assert verdict.kind == "data-starved"
    assert verdict.text == (
        "data-starved: 63% of step time waiting for data; slowest stage: decode at 100% busy"
        " — raise decode's concurrency (now 2)"
    )


def test_starved_with_the_gil_taken_from_the_training_thread_says_subprocess_threads():
    f = frames(data_wait=0.63, gil=0.41, busy={"read": 0.2, "decode": 1.0})
    verdict = verdict_from_frames(f, runner="thread", controls=CONTROLS, cpu_cores=2)
    assert verdict.kind == "data-starved"
    assert verdict.text == (
        "data-starved: 63% of step time waiting for data; slowest stage: decode at 100% busy; "
        "GIL wait 41% on the training thread — try subprocess-threads"
    )


def test_starved_on_full_cores_does_not_ask_for_more_concurrency():
    f = frames(data_wait=0.5, gil=0.0, busy={"decode": 0.97}, cpu_percent=195.0)
    verdict = verdict_from_frames(f, runner="subprocess-threads", controls=CONTROLS, cpu_cores=2)
    assert verdict.kind == "data-starved"
    assert "CPU cores are full (98%)" in verdict.text and "raise" not in verdict.text


def test_balanced():
    f = frames(data_wait=0.08, gil=0.03, busy={"read": 0.3, "decode": 0.7})
    verdict = verdict_from_frames(f, runner="subprocess-threads", controls=CONTROLS, cpu_cores=2)
    assert verdict.kind == "balanced"
    assert verdict.text == "balanced: data wait 8% of step time; slowest stage: decode at 70% busy"


def test_step_bound_when_loading_keeps_up():
    f = frames(data_wait=0.01, gil=0.02, busy={"decode": 0.4})
    verdict = verdict_from_frames(f, runner="cache", controls=CONTROLS, cpu_cores=2)
    assert verdict.kind == "step-bound"
    assert verdict.text.startswith("step-bound: data wait 1% of step time; loading keeps up")


def test_gil_bound_training_thread_while_loading_keeps_up():
    f = frames(data_wait=0.0, gil=0.36, busy={"decode": 0.35})
    verdict = verdict_from_frames(f, runner="thread", controls=CONTROLS, cpu_cores=2)
    assert verdict.kind == "gil-bound"
    assert verdict.text == (
        "training thread GIL-bound (36% GIL wait) while loading keeps up (data wait 0%); "
        "slowest stage: decode at 35% busy — try subprocess-threads"
    )
    other = verdict_from_frames(f, runner="process", controls={"workers": 2}, cpu_cores=2)
    assert other.kind == "gil-bound" and "subprocess-threads" not in other.text


def test_gil_threshold_is_the_named_constant():
    below = frames(data_wait=0.0, gil=v.GIL_BOUND_TRAIN - 0.01, busy={"decode": 0.3})
    at = frames(data_wait=0.0, gil=v.GIL_BOUND_TRAIN, busy={"decode": 0.3})
    assert verdict_from_frames(below, runner="thread").kind == "step-bound"
    assert verdict_from_frames(at, runner="thread").kind == "gil-bound"


def test_cpu_contended_training_thread():
    f = frames(data_wait=0.0, gil=0.02, queued=0.3, busy={"decode": 0.5})
    verdict = verdict_from_frames(f, runner="process", controls={"workers": 4}, cpu_cores=2)
    assert verdict.kind == "cpu-contended"
    assert "30% run-queue wait" in verdict.text


def test_gil_probe_alone_never_blames_the_loader():
    # Without a SimulatedDevice there is no training-thread reading; the probe's
    # high reading is the training thread's own GIL use, so it is not blamed.
    f = frames(data_wait=0.0, gil=None, busy={"decode": 0.3})
    assert verdict_from_frames(f, runner="thread").kind == "step-bound"


def test_warming_up_before_any_step():
    f = frames(data_wait=0.0, busy={"decode": 0.3}, steps_per_s=0.0)
    assert verdict_from_frames(f, runner="thread").kind == "warming-up"
    assert verdict_from_frames(pd.DataFrame(columns=FRAME_COLUMNS), runner="thread").kind == "warming-up"


def test_only_the_recent_window_counts():
    # Starved for the first 20 s, fed for the last 6 s: the verdict is about now.
    old = frames(data_wait=0.7, gil=0.0, busy={"decode": 1.0}, seconds=20)
    new = frames(data_wait=0.01, gil=0.0, busy={"decode": 0.3}, seconds=6)
    new["time_s"] += 20.0
    new.loc[new["series"] == "steps", "value"] += 100
    both = pd.concat([old, new], ignore_index=True)
    assert verdict_from_frames(both, runner="thread").kind == "step-bound"


def test_window_keeps_fixed_memory_and_new_series():
    window = Window(seconds=5.0, max_ticks=50)
    for i in range(100):
        times = np.arange(3) * 0.1 + i * 0.3
        columns = {("qps", "decode"): np.full(3, float(i))}
        if i >= 90:
            columns[("qps", "late")] = np.full(3, 1.0)
        window.add(FrameChunk(3 * (i + 1), times, columns))
    assert window._data.shape[1] <= 50
    means = window.means(1.0)
    assert 97.0 <= means[("qps", "decode")] <= 99.0  # the last second: chunks 96-99
    assert means[("qps", "late")] == 1.0
    assert window.latest(("qps", "decode")) == 99.0
    assert math.isnan(window.latest(("qps", "missing")))


def test_a_window_rate_counts_steps_over_their_wall_time_not_a_mean_of_tick_rates():
    # Ticks late and early: 10 steps in a 0.5 s tick, then 10 in each of five 0.1 s ticks.
    times = np.array([0.0, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0])
    steps = np.array([0.0, 10, 20, 30, 40, 50, 60])
    window = Window(seconds=10.0)
    window.add(FrameChunk(len(times), times, {("steps", "step"): steps}))
    assert window.rate(("steps", "step")) == pytest.approx(60.0)  # 60 steps in 1.0 s
    tick_rates = np.diff(steps) / np.diff(times)
    assert tick_rates.mean() == pytest.approx(86.67, abs=0.01)  # what a mean of ticks would say
    assert window.rate(("steps", "step"), 0.25) == pytest.approx(100.0)  # the last 0.25 s
    assert math.isnan(window.rate(("steps", "missing")))
    window.add(FrameChunk(8, np.array([1.1]), {("steps", "step"): np.array([0.0])}))  # a reset counter
    assert window.rate(("steps", "step"), 0.15) == 0.0  # never a negative rate
