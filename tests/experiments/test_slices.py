"""window_qps: the median slice rate leaves out short moments of odd machine speed."""

from __future__ import annotations

import random

import pytest

from spdl_lab.experiments._slices import window_qps

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


def test_slow_functions_fall_back_to_the_plain_rate() -> None:
    ends, stop = stream([(0.4, 50.0)])  # 20 tasks: no slice could hold 40
    assert window_qps(ends, 10**12, stop) == len(ends) / 0.4


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
