import math
import random
import time

import numpy as np
import pytest

import spdl_lab as lab
from spdl_lab._telemetry.frames import Ring
from spdl_lab._telemetry.histogram import (
    NUM_BUCKETS,
    bucket_bounds,
    bucket_of,
    new_counts,
    quantile_ns,
)

pytestmark = pytest.mark.usefixtures("no_thread_leak")


def test_every_duration_falls_inside_its_bucket():
    rng = random.Random(1)
    values = list(range(0, 300)) + [rng.randrange(1, 10**13) for _ in range(5000)]
    for v in values:
        i = bucket_of(v)
        assert 0 <= i < NUM_BUCKETS
        low, high = bucket_bounds(i)
        assert low <= v < high, (v, i, low, high)


def test_quantiles_are_within_a_bucket_of_the_truth():
    rng = np.random.default_rng(0)
    data = rng.lognormal(mean=15, sigma=1.0, size=20_000).astype(np.int64)
    counts = new_counts()
    for v in data:
        counts[bucket_of(int(v))] += 1
    for q in (0.5, 0.9, 0.99):
        truth = float(np.quantile(data, q))
        assert abs(quantile_ns(counts, q) - truth) / truth < 0.07
    assert math.isnan(quantile_ns(new_counts(), 0.5))


def napping_stage() -> lab.StageStats:
    p = lab.Pipeline(range(40)).map(lambda x: time.sleep(0.02) or x, concurrency=4, name="nap")
    with lab.Loader(p) as loader:
        assert len(list(loader)) == 40
        return loader.stats().stages["nap"]


def test_sleeping_stage_reports_its_task_time():
    s = napping_stage()
    assert s.tasks == 40 and s.failures == 0
    assert s.p99_ms >= s.p50_ms
    assert s.qps > 0 and s.kind == "map" and s.concurrency == 4


@pytest.mark.measurement
def test_sleeping_stage_task_time_is_its_sleep():
    s = napping_stage()
    assert 19 <= s.p50_ms <= 60
    assert 19 <= s.mean_ms <= 60


@pytest.mark.measurement
def test_task_time_excludes_waiting_for_a_worker():
    # One worker, items queue up; each task is 10 ms, waits are much longer.
    p = lab.Pipeline(range(20)).map(lambda x: time.sleep(0.01) or x, name="one")
    with lab.Loader(p) as loader:
        list(loader)
        s = loader.stats().stages["one"]
    assert s.p99_ms < 30


def test_snapshot_fields_and_queues():
    p = lab.Pipeline(range(100)).map(str, concurrency=2, name="fmt").batch(10).map(len, name="n")
    with lab.Loader(p) as loader:
        assert loader.stats().stages["fmt"].tasks == 0  # before the first run
        out = list(loader)
        snap = loader.stats()
    assert out == [10] * 10
    assert list(snap.stages) == ["fmt", "batch", "n"]
    assert snap.source.tasks == 100
    assert snap.stages["fmt"].tasks == 100
    assert snap.stages["batch"].tasks == 10 and snap.stages["batch"].queue_capacity == 10
    assert snap.stages["n"].tasks == 10
    assert snap.items_out == 10 and not snap.running
    assert snap.stages["fmt"].queue_capacity > 0
    assert set(snap.queues) == {"source→fmt", "fmt→n", "n→output"}
    table = snap.table()
    assert list(table.index) == ["source", "fmt", "batch", "n"]
    assert "qps" in table.columns
    assert "fmt" in snap._repr_html_() and "fmt" in repr(snap)
    # One node (every runner but ray): no per-node counts, and none sent.
    assert snap.stages["fmt"].nodes == {}
    assert all("nodes" not in row for row in snap.to_dict()["stages"])


def test_per_node_counts_travel_and_a_hostile_row_cannot_make_an_impossible_one():
    row = {"name": "work", "kind": "map", "tasks": 5, "nodes": {"10.0.0.1/ab": 3, "10.0.0.2/cd": 2}}
    snap = lab.Snapshot.from_dict({"runner": "ray", "stages": [row]})
    assert snap.stages["work"].nodes == {"10.0.0.1/ab": 3, "10.0.0.2/cd": 2}
    assert lab.Snapshot.from_dict(snap.to_dict()).stages["work"].nodes == snap.stages["work"].nodes
    bad = {**row, "nodes": {"a": -1, "b": True, "c": 1.5, "d": "7", "e": 4}}
    assert lab.Snapshot.from_dict({"stages": [bad]}).stages["work"].nodes == {"e": 4}
    for junk in ([1, 2], "x", None, 3):
        assert lab.Snapshot.from_dict({"stages": [{**row, "nodes": junk}]}).stages["work"].nodes == {}


def test_frames_are_long_format_and_bounded():
    p = lab.Pipeline(range(300)).map(lambda x: time.sleep(0.001) or x, name="s")
    with lab.Loader(p, sample_hz=50, sample_ticks=10) as loader:
        list(loader)
        frames = loader.frames()
    assert list(frames.columns) == ["time_s", "series", "stage", "value"]
    assert frames["time_s"].nunique() <= 10
    assert {"tasks", "qps", "busy_frac", "queue_depth"} <= set(frames["series"])
    tasks = frames[(frames.series == "tasks") & (frames.stage == "s")]
    assert tasks["value"].is_monotonic_increasing
    assert tasks["value"].iloc[-1] == 300


def test_meters_off_still_counts_queues_but_no_task_times():
    p = lab.Pipeline(range(50)).map(str, name="a")
    with lab.Loader(p, meters=False) as loader:
        assert len(list(loader)) == 50
        snap = loader.stats()
    assert math.isnan(snap.stages["a"].p50_ms)
    assert snap.items_out == 50


def test_sampler_off():
    p = lab.Pipeline(range(50)).map(str, name="a")
    with lab.Loader(p, sample_hz=0) as loader:
        list(loader)
        assert loader.frames().empty
        assert loader.stats().stages["a"].tasks == 50


def test_ring_keeps_the_last_ticks_and_adds_columns():
    ring = Ring(3)
    for t in range(5):
        rows = [("x", "a", float(t))] + ([("y", "b", 1.0)] if t == 4 else [])
        ring.append(float(t), rows)
    times, cols = ring.view()
    assert list(times) == [2.0, 3.0, 4.0]
    assert list(cols[("x", "a")]) == [2.0, 3.0, 4.0]
    assert np.isnan(cols[("y", "b")][:2]).all() and cols[("y", "b")][2] == 1.0


def test_fast_bucket_table_matches_bucket_of_from_128ns():
    from spdl_lab._telemetry.histogram import FAST_BUCKETS, FAST_LIMIT_NS, FAST_SHIFT

    for d in list(range(128, 5000)) + list(range(5000, FAST_LIMIT_NS, 997)):
        assert FAST_BUCKETS[d >> FAST_SHIFT] == bucket_of(d), d
