"""window_qps leaves out short moments of odd machine speed; point_qps and quiet, slow spells."""

from __future__ import annotations

import random
import re

import pytest

from spdl_lab._diagnose._sweep import SweepSettings, point_qps, quiet, window_qps

MS = 1_000_000


def stream(rates: list[tuple[float, float]], t0: int = 10**12) -> tuple[list[int], int]:
    """Completion times for consecutive (seconds, qps) stretches; and the end time."""
    ends, t = [], t0
    for seconds, qps in rates:
        step = 1e9 / qps
        stop = t + seconds * 1e9
        while t + step < stop:
            t += step
            ends.append(round(t))
        t = stop
    return ends, round(t)


def test_a_steady_stream_reads_its_rate() -> None:
    ends, stop = stream([(0.4, 2000.0)])
    assert window_qps(ends, 10**12, stop) == pytest.approx(2000.0, rel=0.03)


def test_short_fast_moments_are_left_out_where_the_plain_rate_takes_them_in() -> None:
    # 0.4 s at 2000/s with three 40 ms moments at +50%: a quarter of the window runs fast.
    parts = [(0.06, 2000.0), (0.04, 3000.0)] * 3 + [(0.1, 2000.0)]
    ends, stop = stream(parts)
    plain = len(ends) / ((stop - 10**12) / 1e9)
    assert plain > 2100  # what the window's plain rate says
    assert window_qps(ends, 10**12, stop) == pytest.approx(2000.0, rel=0.03)


def test_slow_functions_are_counted_up_to_their_last_completion() -> None:
    ends, stop = stream([(0.4, 50.0)])  # 19 tasks: no slice could hold 40
    assert window_qps(ends, 10**12, stop) == pytest.approx(50.0)


def test_workers_that_start_together_are_not_read_low_for_the_tasks_still_running() -> None:
    # Four workers start a 0.3 s window together on 70 ms tasks: four rounds finish, at
    # 70..280 ms, and the fifth is running at the end. The plain rate reads 16 / 0.3 = 53/s.
    t0 = 10**12
    ends = [t0 + k * 70 * MS + w * 100_000 for k in range(1, 5) for w in range(4)]
    assert window_qps(ends, t0, t0 + 300 * MS) == pytest.approx(4 / 0.070, rel=0.01)


def test_completions_outside_the_window_do_not_count() -> None:
    ends, stop = stream([(0.4, 1000.0)])
    noise = [10**12 - 5 * MS, stop + 5 * MS] * 100
    mixed = sorted(ends + noise)
    assert window_qps(mixed, 10**12, stop) == window_qps(ends, 10**12, stop)


def test_empty_and_degenerate_windows() -> None:
    assert window_qps([], 0, 400 * MS) == 0.0
    assert window_qps([1, 2], 5, 5) != window_qps([1, 2], 5, 5)  # NaN


def test_unordered_completions_from_several_workers() -> None:
    ends, stop = stream([(0.4, 4000.0)])
    random.Random(0).shuffle(ends)
    assert window_qps(ends, 10**12, stop) == pytest.approx(4000.0, rel=0.03)


# -- point_qps and quiet: a point's windows, some taken in the machine's slow spells ---------

def spells(fast: float, slow: float, n: int, slow_share: float, seed: int) -> list[float]:
    """``n`` windows, each in a slow spell (``slow``) with probability ``slow_share``, with +-2% jitter."""
    rng = random.Random(seed)
    return [(slow if rng.random() < slow_share else fast) * rng.uniform(0.98, 1.02) for _ in range(n)]


def test_a_point_reads_the_machine_at_its_own_speed_while_some_windows_are_slow() -> None:
    # Ten windows, 60% of them in spells at 0.6x: the median moves with the share, point_qps does not.
    checked = 0
    for seed in range(20):
        windows = spells(1000.0, 600.0, 10, 0.6, seed)
        if sum(w > 800 for w in windows) < 2:
            continue  # fewer than two fast windows: the next tests
        assert point_qps(windows) == pytest.approx(1000.0, rel=0.03)
        checked += 1
    assert checked >= 15


def test_one_lucky_window_does_not_set_the_number() -> None:
    assert point_qps([1000, 1010, 990, 1600, 1005]) == 1010


def test_with_every_window_slow_the_point_is_low_by_the_machine_factor() -> None:
    # What no rule inside one run can tell: said plainly rather than hidden.
    assert point_qps([600, 610, 590, 605]) == pytest.approx(600, rel=0.02)


def test_point_qps_with_few_or_missing_windows() -> None:
    assert point_qps([]) != point_qps([])  # NaN
    assert point_qps([float("nan"), 500.0]) == 500.0
    assert point_qps([400.0, 600.0]) == 500.0  # two: their median, not the larger


def test_quiet_needs_enough_windows_whose_fastest_agree() -> None:
    assert not quiet([1000, 1001, 999], 0.05, 4)
    assert quiet([1000, 1001, 999, 1020], 0.05, 4)
    # One slow spell: the fastest three agree, so the QPS (second best) is known.
    assert quiet([1000, 990, 1010, 640], 0.05, 4)
    # Three slow windows in a row and one fast: not quiet, so the point keeps going.
    assert not quiet([600, 610, 605, 1000], 0.05, 4)
    # The fast ones disagree: not quiet.
    assert not quiet([1000, 800, 1010, 640], 0.05, 4)
    assert not quiet([1000, 1001, float("nan"), 1000], 0.05, 3)
    assert not quiet([0.0, 0.0, 0.0], 0.05, 3)


@pytest.mark.parametrize("kwargs, says", [
    (dict(min_windows=5, max_windows=4), "min_windows (5) is more than max_windows (4)"),
    (dict(window_s=0), "window_s must be a number of seconds > 0"),
    (dict(max_windows=0), "max_windows must be an int >= 1"),
    (dict(min_windows=2.5), "min_windows must be an int >= 1"),
    (dict(stable_within=1.5), "stable_within must be a share in [0, 1)"),
])
def test_sweep_settings_refuse_what_cannot_be_run(kwargs: dict, says: str) -> None:
    with pytest.raises(ValueError, match=re.escape(says)):
        SweepSettings(**kwargs)

