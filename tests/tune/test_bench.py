"""The tuner's bench: what a runner made under an earlier setting is not counted as the new one's speed."""

from __future__ import annotations

import time

import pytest

import spdl_lab as lab
from spdl_lab._engine.engine import reorder_window
from spdl_lab._experiments.compare import Contender
from spdl_lab._runners.process import WORKERS
from spdl_lab._tune.bench import Bench, unseen_batches
from spdl_lab._tune.space import Config, batch_items

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("no_child_leak", "no_thread_leak")]


def fetch(x):
    time.sleep(0.01)  # I/O: 10 ms an item
    return x


def pipeline() -> lab.Pipeline:
    return lab.Pipeline(range(10**6)).map(fetch, concurrency=1, name="fetch").batch(4)


def test_unseen_batches_counts_reorder_windows_workers_and_prefetch():
    p = lab.Pipeline(range(10)).map(abs, name="a").map(abs, name="b", ordered=False).batch(4)
    items = batch_items(p)
    assert unseen_batches(p, {"a": 8, "b": 3}, items) == -(-(reorder_window(8) + 3) // 4)
    assert unseen_batches(p, {WORKERS: 3}, items) == 6  # two prefetched batches a worker
    assert unseen_batches(p, {WORKERS: 3}, items, prefetch_factor=4) == 12  # or prefetch_factor
    assert unseen_batches(p, {}, items) == 0


def test_drain_ready_takes_what_was_made_while_idle_and_stops_at_the_first_wait():
    contender = Contender(pipeline(), "thread", lambda batch: None, {"buffer_size": 4}, None, time.perf_counter())
    try:
        contender.loader.set_concurrency("fetch", 16)
        contender.drain_ready(1, timeout=30)  # starts the loader
        time.sleep(1.0)  # idle: 16 workers fill the queues and the reorder window
        before = contender.clock.steps
        contender.drain_ready(10_000, timeout=30)
        taken = contender.clock.steps - before
        last = contender.clock.last()
        # A batch takes 40 ms to make at one worker a batch: the ready ones were used up, then one waited.
        assert 2 <= taken < 200, taken
        assert last is not None and last.data_wait_s > 0.0005
    finally:
        contender.loader.close()


@pytest.mark.measurement
def test_a_slow_setting_after_a_fast_one_is_measured_at_its_own_speed():
    # fetch=1 makes 25 batches/s; fetch=16 runs ahead of the 10 ms step and fills every buffer,
    # and the first window of fetch=1 after it must not count those at up to 100 batches/s.
    bench = Bench(pipeline(), lambda batch: time.sleep(0.01), window_s=0.3, probes=False)
    try:
        slow, fast = Config.of("thread", {"fetch": 1}), Config.of("thread", {"fetch": 16})
        bench.measure(slow, 30)
        bench.measure(fast, 30)
        rate = bench.rate_once(slow, 30).batches_per_s
        assert rate < 50, rate  # 25 batches/s at most, whatever the machine's noise
    finally:
        bench.close()
