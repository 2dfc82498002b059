"""From windows to the table's spread and the warnings, on synthetic windows (no timing)."""

from __future__ import annotations

import math

import pytest

from spdl_lab._experiments.compare import Window
from spdl_lab._experiments.comparison import coverage, ratios, runner_row, warnings_for
from spdl_lab._training.clock import StepRecord


def window(runner: str, round_: int, rate: float, *, step_ms: float = 50.0, others: float = 0.0,
           steps: int = 10) -> Window:
    """``steps`` steps at ``rate`` batches/s: each step ``step_ms``, the rest data wait."""
    loop_s = 1.0 / rate
    step_s = min(step_ms / 1e3, loop_s)
    records = tuple(StepRecord(i, 0.0, loop_s - step_s, step_s, math.nan) for i in range(steps))
    return Window(runner, round_, float(round_), records, 100.0, others, 0.1, 0.0, math.nan, math.nan)


def table(rates: dict[str, list[float]], **kw) -> tuple[dict, dict]:
    windows = {r: [window(r, i, v, **kw) for i, v in enumerate(vs)] for r, vs in rates.items()}
    rows = {r: runner_row(ws) for r, ws in windows.items()}
    for r, row in rows.items():
        row["vs_cache"], row["vs_cache_lo"], row["vs_cache_hi"] = (
            ratios(windows[r], windows["cache"]) if "cache" in windows else (math.nan,) * 3)
    return rows, windows


def test_median_and_its_range():
    rows, _ = table({"thread": [9.0, 10.0, 12.0, 10.5, 9.5]})
    row = rows["thread"]
    assert row["batches_per_s"] == pytest.approx(10.0)
    assert (row["batches_per_s_lo"], row["batches_per_s_hi"]) == pytest.approx((9.0, 12.0))
    assert row["steps"] == 50
    assert coverage(5) == pytest.approx(0.9375) and coverage(1) == 0.0


def test_ratios_pair_rounds_so_a_slow_spell_cancels():
    # Round 2 was slow for everybody: paired ratios stay at 0.5.
    rows, _ = table({"thread": [5.0, 5.0, 2.5, 5.0, 5.0], "cache": [10.0, 10.0, 5.0, 10.0, 10.0]})
    assert rows["thread"]["vs_cache"] == pytest.approx(0.5)
    assert (rows["thread"]["vs_cache_lo"], rows["thread"]["vs_cache_hi"]) == pytest.approx((0.5, 0.5))


def test_a_runner_beating_the_headspace_is_not_trustworthy_and_says_why():
    rows, _ = table({"thread": [12.0, 12.5, 12.2, 12.4, 12.1], "cache": [10.0, 10.1, 10.0, 9.9, 10.2]},
                    others=90.0)
    warnings = warnings_for(rows, rounds=5, cores=2)
    beat = [w for w in warnings if "beat the headspace" in w]
    assert len(beat) == 1 and beat[0].startswith("thread ")
    assert "not trustworthy" in beat[0] and "other processes used 90%" in beat[0]


def test_a_runner_at_the_headspace_within_noise_is_not_flagged():
    rows, _ = table({"thread": [10.1, 9.9, 10.2, 9.8, 10.0], "cache": [10.0, 10.0, 10.1, 9.9, 10.0]})
    assert not any("beat the headspace" in w for w in warnings_for(rows, rounds=5, cores=2))


def test_within_noise_and_wide_spread_and_busy_machine_and_few_rounds():
    rows, _ = table({"thread": [10.0, 10.5], "process": [10.2, 10.9], "subprocess-threads": [20.0, 30.0]},
                    others=120.0)
    warnings = warnings_for(rows, rounds=2, cores=2)
    text = "\n".join(warnings)
    assert "thread and process are within noise of each other" in text
    assert "subprocess-threads's rounds ranged from 20 to 30" in text
    assert "Other processes used up to 120% of a core" in text
    assert "Only 2 round(s)" in text
    assert "thread and subprocess-threads are within noise" not in text


def test_a_quiet_clear_comparison_has_no_warnings():
    rows, _ = table({"thread": [5.0, 5.1, 5.0], "process": [8.0, 8.1, 8.2], "cache": [10.0, 10.1, 10.0]})
    assert warnings_for(rows, rounds=3, cores=2) == []
