"""The process runner: torch's DataLoader with spawned worker processes.

Each DataLoader start costs a second or two per worker (spawn imports torch),
so tests that need workers combine checks; the num_workers=0 tests run in
this process and are cheap.
"""

from __future__ import annotations

import math
import os
import signal
import threading
import time
from collections import Counter

import pytest

import spdl_lab as lab
from spdl_lab._engine.queues import END, TIMEOUT
from spdl_lab._runners.process import ProcessRunner

pytestmark = [
    pytest.mark.usefixtures("no_thread_leak", "no_child_leak"),
    pytest.mark.timeout(90),
]


def runner(pipeline: lab.Pipeline, **options) -> ProcessRunner:
    return ProcessRunner(pipeline, buffer_size=None, max_failures=0, metered=True, **options)


def next_value(r: ProcessRunner, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        record = r.get(0.1)
        if record is END:
            return END
        if record is not TIMEOUT:
            return record[2]
    raise AssertionError(f"no output within {timeout}s")


def drain(r: ProcessRunner) -> list:
    out = []
    while (value := next_value(r)) is not END:
        out.append(value)
    return out


def scaled_pipeline(n: int, size: int) -> lab.Pipeline:
    offset = 7  # captured: the closures travel by value

    def shift(batch):
        return [x + offset for x in batch]

    return (
        lab.Pipeline(range(n))
        .map(lambda x: x * 3, concurrency=4, name="triple")
        .batch(size)
        .map(shift, name="shift")
        .map(sum, name="total")
    )


# -- with worker processes ---------------------------------------------------------
def test_matches_thread_runner_and_meters_count_every_task():
    n, size = 103, 4
    p = scaled_pipeline(n, size)
    with lab.Loader(p, runner="thread") as loader:
        expected = list(loader)
    with lab.Loader(p, runner="process", num_workers=2) as loader:
        out = list(loader)
        snap = loader.stats()
        frames = loader.frames()
    assert Counter(out) == Counter(expected)
    assert out == expected  # chunks go round-robin and torch yields in order
    batches = math.ceil(n / size)
    assert snap.source.tasks == n
    tasks = {name: s.tasks for name, s in snap.stages.items()}
    assert tasks == {"triple": n, "batch": batches, "shift": batches, "total": batches}
    for stage in snap.stages.values():
        assert stage.failures == 0 and stage.concurrency == 2 and stage.in_flight == 0
        assert stage.mean_ms > 0 and stage.p50_ms > 0
    final = frames[(frames.series == "tasks") & (frames.stage == "triple")].value
    assert final.iloc[-1] == n


def test_iterable_source_is_sharded_over_three_workers_without_duplicates():
    def source():  # an iterable source: every worker reads it, each keeps its share
        yield from range(60)

    p = lab.Pipeline(source).map(lambda x: (x, os.getpid()), name="tag")
    with pytest.warns(UserWarning, match="worker"), lab.Loader(p, runner="process", num_workers=3) as loader:
        out = list(loader)
    assert Counter(x for x, _ in out) == Counter(range(60))
    pids = {pid for _, pid in out}
    assert len(pids) == 3 and os.getpid() not in pids
    by_pid = {pid: sorted(x for x, q in out if q == pid) for pid in pids}
    assert sorted(min(xs) for xs in by_pid.values()) == [0, 1, 2]  # worker w takes x % 3 == w


def test_set_concurrency_restarts_workers_and_loses_and_repeats_nothing(wait_until):
    n, size = 400, 4

    def slow(x):
        time.sleep(0.004)
        return x

    p = lab.Pipeline(range(n)).map(slow, name="slow").batch(size)
    r = runner(p, num_workers=2)
    r.start()
    try:
        out = [next_value(r) for _ in range(5)]
        assert wait_until(lambda: len(r.worker_pids()) == 2, 10)
        before = set(r.worker_pids())
        r.set_concurrency("workers", 1)
        assert r.concurrency("workers") == 1 and r.concurrency("slow") == 1
        rest = drain(r)
        after = set(r.worker_pids())
        reading = r.read()
    finally:
        r.close()
    batches = out + rest
    assert batches == [list(range(i, min(i + size, n))) for i in range(0, n, size)]
    assert len(after) == 1 and not after & before
    assert reading.stages[0].concurrency == 1
    # Batches in flight at the restart were made again: work, not output, repeats.
    assert reading.stages[1].tasks >= n // size


def test_loader_set_concurrency_grows_from_in_process_to_two_workers():
    def slow(x):
        time.sleep(0.003)
        return x

    p = lab.Pipeline(range(300)).map(slow, name="slow").batch(4)
    with lab.Loader(p, runner="process", num_workers=0) as loader:
        out = []
        for i, batch in enumerate(loader):
            out.append(batch)
            if i == 5:
                loader.set_concurrency("slow", 2)  # a map stage's name means the pool
        snap = loader.stats()
    assert out == [list(range(i, i + 4)) for i in range(0, 300, 4)]
    assert snap.stages["slow"].concurrency == 2 and snap.source.tasks >= 300
    # The new pool size carries to the next run, and "workers" names it too.
    assert loader.options["num_workers"] == 2


def test_loader_accepts_the_workers_pseudo_stage():
    p = lab.Pipeline(range(40)).map(lambda x: x + 1, name="inc").batch(4)
    with lab.Loader(p, runner="process", num_workers=0) as loader:
        loader.set_concurrency("workers", 1)
        assert loader.options["num_workers"] == 1
        assert sorted(sum(loader, [])) == list(range(1, 41))
        with pytest.raises(lab.PipelineSpecError, match="concurrency"):
            loader.set_concurrency("workers", 0)


def test_stage_failure_in_a_worker_names_stage_and_item():
    def decode(x):
        if x == 13:
            raise ValueError("corrupt record 13")
        return x

    p = lab.Pipeline(range(40)).map(decode, name="decode").batch(5)
    with lab.Loader(p, runner="process", num_workers=1) as loader:
        with pytest.raises(lab.PipelineError) as info:
            list(loader)
    err = info.value
    assert err.stage == "decode" and err.index == 13
    assert "stage 'decode' failed on item 13" in str(err) and "max_failures" in str(err)
    assert isinstance(err.__cause__, ValueError) and "corrupt record 13" in str(err.__cause__)


def kill_a_worker(wait_until) -> float:
    """SIGKILL a worker mid-run; the seconds until its RunnerError came."""

    def slow(x):
        time.sleep(0.01)
        return x

    r = runner(lab.Pipeline(range(10**9)).map(slow, name="slow").batch(2), num_workers=2)
    r.start()
    try:
        next_value(r)
        assert wait_until(lambda: len(r.worker_pids()) == 2, 10)
        victim = r.worker_pids()[0]
        os.kill(victim, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(lab.RunnerError) as info:
            while time.monotonic() - t0 < 10:
                r.get(0.1)
        took = time.monotonic() - t0
    finally:
        r.close()
    assert f"pid {victim}" in str(info.value) and "SIGKILL" in str(info.value)
    r.close()  # twice, after an error, is fine
    return took


# One run checks the error and how soon it came (a timing assert: the measurement set).
@pytest.mark.measurement
def test_killed_worker_gives_runner_error_naming_pid_and_signal_promptly(wait_until):
    assert kill_a_worker(wait_until) < 10


def close_mid_run() -> float:
    """Close a loader while its worker runs; the seconds close() took."""
    p = lab.Pipeline(range(10**9)).map(lambda x: x + 1, name="inc").batch(8)
    loader = lab.Loader(p, runner="process", num_workers=1)
    it = iter(loader)
    for _ in range(20):
        next(it)
    t0 = time.monotonic()
    loader.close()
    took = time.monotonic() - t0
    assert loader.stats().stages["inc"].tasks >= 160
    loader.close()
    return took


@pytest.mark.measurement
def test_close_mid_run_leaves_nothing_and_is_prompt():
    assert close_mid_run() < 4.0


# -- checked before anything starts -------------------------------------------------
def test_unpicklable_stage_fails_at_start_naming_the_stage():
    lock = threading.Lock()
    p = lab.Pipeline(range(10)).map(lambda x: x + 1, name="inc").map(
        lambda x: (lock, x)[1], name="guarded"
    )
    with pytest.raises(lab.PipelineSpecError, match="stage 'guarded'.*cannot be pickled.*lock"):
        lab.Loader(p, runner="process", num_workers=2)


@pytest.mark.parametrize(
    "options, match",
    [
        ({"multiprocessing_context": "fork"}, "'spawn' or 'forkserver'"),
        ({"batch_size": 4}, "'batch_size' is set from the pipeline"),
        ({"num_worker": 2}, "unknown option 'num_worker'"),
        ({"num_workers": -1}, "num_workers must be an int"),
        ({"prefetch_factor": 0}, "prefetch_factor"),
    ],
)
def test_bad_options_fail_when_the_loader_is_made(options, match):
    with pytest.raises(lab.PipelineSpecError, match=match):
        lab.Loader(lab.Pipeline(range(3)), runner="process", **options)


def test_nested_batches_are_refused():
    p = lab.Pipeline(range(8)).batch(2).batch(2)
    with pytest.raises(lab.PipelineSpecError, match="second batch stage"):
        lab.Loader(p, runner="process")


# -- num_workers=0: the same code, in this process ---------------------------------
def test_in_process_matches_thread_runner_and_counts():
    p = scaled_pipeline(50, 6)
    with lab.Loader(p, runner="thread") as loader:
        expected = list(loader)
    with lab.Loader(p, runner="process", num_workers=0) as loader:
        assert list(loader) == expected
        snap = loader.stats()
    assert snap.source.tasks == 50 and snap.stages["total"].tasks == 9


def test_max_failures_drops_and_counts_per_worker():
    bad = {3, 20, 21}

    def decode(x):
        if x in bad:
            raise ValueError(x)
        return x

    p = lab.Pipeline(range(30)).map(decode, name="decode")
    with lab.Loader(p, runner="process", num_workers=0, max_failures=3) as loader:
        assert list(loader) == [x for x in range(30) if x not in bad]
        assert loader.stats().stages["decode"].failures == 3
    with lab.Loader(p, runner="process", num_workers=0, max_failures=2) as loader:
        with pytest.raises(lab.PipelineError, match="already dropped 2.*per worker") as info:
            list(loader)
    assert info.value.index == 21


def test_failure_after_batch_names_the_batch():
    def collate(batch):
        if batch[0] == 20:
            raise RuntimeError("nope")
        return batch

    p = lab.Pipeline(range(100)).batch(10).map(collate, name="collate")
    with lab.Loader(p, runner="process", num_workers=0) as loader, pytest.raises(lab.PipelineError) as info:
        list(loader)
    assert info.value.stage == "collate" and info.value.index == 2


def test_source_failure_is_reported():
    def source():
        yield 1
        raise OSError("disk gone")

    with lab.Loader(lab.Pipeline(source).map(str), runner="process", num_workers=0) as loader:
        with pytest.raises(lab.PipelineError, match="the source failed on item 1: OSError") as info:
            list(loader)
    assert info.value.stage == "source"
