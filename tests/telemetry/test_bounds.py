"""No series shows what cannot be: CPU within 0..100 x cores, shares within 0..1, rates >= 0.

The probes are pushed where they used to overshoot: ticks a millisecond apart,
children that exit mid-tick, both cores busy with other processes, a
GIL-holding pipeline beside the sampler, many threads blocked on one queue.
"""

from __future__ import annotations

import math
import random
import subprocess
import sys
import time

import psutil
import pytest

import spdl_lab as lab
from spdl_lab._telemetry.probes import CpuProbe
from spdl_lab._telemetry.sampler import Sampler, bounded, limits

pytestmark = pytest.mark.usefixtures("no_thread_leak", "no_child_leak")

CORES = psutil.cpu_count() or 1
BURN = [sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 30: pass"]


def impossible(frame) -> list[tuple]:
    """Rows of a frames() DataFrame outside their limits (NaN is allowed: no value that tick)."""
    bad = []
    for series, stage, value in frame[["series", "stage", "value"]].itertuples(index=False):
        lo, hi = limits(series, CORES)
        if not math.isnan(value) and not lo <= value <= hi:
            bad.append((series, stage, value))
    return bad


def test_bounded_brings_every_value_within_its_limits():
    rows = [("cpu_percent", "total", 409.0 * CORES), ("cpu_percent", "main", -1e-12),
            ("put_blocked_frac", "a→b", 24.0), ("device_util", "", 1.2), ("qps", "decode", -3.0),
            ("gil_wait_ms", "gil", math.inf), ("busy_frac", "x", math.nan), ("qps", "ok", 12.5)]
    out, clamped = bounded(rows, CORES)
    values = {(s, st): v for s, st, v in out}
    assert values[("cpu_percent", "total")] == 100.0 * CORES and values[("cpu_percent", "main")] == 0.0
    assert values[("put_blocked_frac", "a→b")] == 1.0 and values[("device_util", "")] == 1.0
    assert values[("qps", "decode")] == 0.0 and math.isnan(values[("gil_wait_ms", "gil")])
    assert math.isnan(values[("busy_frac", "x")]) and values[("qps", "ok")] == 12.5
    assert clamped == 6


def test_the_sampler_never_stores_an_impossible_value_and_counts_what_it_clamped():
    sampler = Sampler([lambda dt: [("cpu_percent", "total", 700.0 * CORES), ("busy_frac", "s", 3.0)]])
    sampler.tick()
    frame = sampler.frames()
    assert impossible(frame) == []
    assert frame.loc[frame["series"] == "clamped", "value"].sum() == 2


@pytest.mark.timeout(60)
def test_cpu_probe_within_bounds_with_short_ticks_dying_children_and_busy_cores():
    probe = CpuProbe()
    burners = [subprocess.Popen(BURN) for _ in range(CORES)]  # both cores busy
    short_lived: list[subprocess.Popen] = []
    rng = random.Random(0)
    rows = []
    try:
        deadline = time.monotonic() + 4.0
        while time.monotonic() < deadline:
            if len(short_lived) < 6 and rng.random() < 0.3:  # children that exit mid-tick
                short_lived.append(subprocess.Popen(
                    [sys.executable, "-c", f"import time\nt=time.time()\nwhile time.time()-t<{rng.uniform(0.05, 0.6)}: pass"]))
            short_lived = [p for p in short_lived if p.poll() is None]
            rows += probe(0.0)
            rows += probe(0.0)  # a tick a moment after the last one
            time.sleep(rng.choice((0.0, 0.001, 0.02, 0.06, 0.1, 0.15)))
    finally:
        for p in burners + short_lived:
            p.kill()
        for p in burners + short_lived:
            p.wait(10)
    cpu = [(stage, v) for series, stage, v in rows if series == "cpu_percent"]
    assert cpu, "the probe never reported CPU"
    over = [(stage, v) for stage, v in cpu if not 0.0 <= v <= 100.0 * CORES]
    assert over == [], f"CPU outside 0..{100 * CORES}%: {over[:5]}"


@pytest.mark.timeout(90)
def test_a_gil_holding_session_on_a_loaded_machine_stays_within_bounds():
    burners = [subprocess.Popen(BURN) for _ in range(CORES)]
    try:
        pipeline, device = lab.workloads.noisy_neighbour(items=10**6)
        session = lab.run(pipeline, step=device, runner="thread", duration=4, sample_hz=20)
        assert session.wait(timeout=60)
        frame = session.frames()
    finally:
        for p in burners:
            p.kill()
            p.wait(10)
    assert impossible(frame) == []
    assert (frame["series"] == "cpu_percent").any()


@pytest.mark.timeout(60)
def test_many_threads_blocked_on_one_queue_read_as_a_share_of_at_most_one():
    def fast(x):
        return x

    def slow(x):
        time.sleep(0.02)
        return x

    p = lab.Pipeline(range(10**6)).map(fast, concurrency=16, name="fast").map(slow, concurrency=1, name="slow")
    with lab.Loader(p, sample_hz=20) as loader:
        it = iter(loader)
        for _ in range(60):
            next(it)
        frame = loader.frames()
    blocked = frame[(frame["series"] == "put_blocked_frac") & (frame["stage"] == "fast→slow")]["value"]
    assert len(blocked) and 0.0 < blocked.max() <= 1.0  # sixteen producers, one slow consumer
