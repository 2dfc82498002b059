"""The thread engine through lab.Loader(runner="thread")."""

from __future__ import annotations

import gc
import random
import threading
import time
from collections import Counter

import pytest

import spdl_lab as lab

pytestmark = pytest.mark.usefixtures("no_thread_leak")


def jitter(x):
    # Uneven task times so that completion order differs from input order.
    if x % 7 == 0:
        time.sleep(0.0005)
    return x


def test_ordered_output_keeps_input_order():
    p = lab.Pipeline(range(5000)).map(jitter, concurrency=8).map(lambda x: x * 2, concurrency=3)
    with lab.Loader(p) as loader:
        assert list(loader) == [x * 2 for x in range(5000)]


def test_unordered_output_is_a_permutation_in_completion_order():
    def slow_first(x):
        if x == 0:
            time.sleep(0.2)
        return x

    p = lab.Pipeline(range(200)).map(slow_first, concurrency=4, ordered=False)
    with lab.Loader(p) as loader:
        out = list(loader)
    assert sorted(out) == list(range(200))
    assert out[0] != 0  # the slow item did not hold the others back


def test_batches_and_per_batch_maps():
    p = lab.Pipeline(range(10)).map(lambda x: x + 1, concurrency=2).batch(4).map(sum, name="total")
    with lab.Loader(p) as loader:
        assert list(loader) == [1 + 2 + 3 + 4, 5 + 6 + 7 + 8, 9 + 10]
    p = lab.Pipeline(range(10)).batch(4, drop_last=True)
    with lab.Loader(p) as loader:
        assert list(loader) == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_nested_batches():
    p = lab.Pipeline(range(8)).batch(2).batch(2)
    with lab.Loader(p) as loader:
        assert list(loader) == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]


def test_empty_source_and_callable_source():
    with lab.Loader(lab.Pipeline([]).map(str).batch(3)) as loader:
        assert list(loader) == []
    p = lab.Pipeline(lambda: (i for i in range(5))).map(lambda x: -x)
    with lab.Loader(p) as loader:
        assert list(loader) == [0, -1, -2, -3, -4]
        assert list(loader) == [0, -1, -2, -3, -4]  # every iteration is a fresh run


@pytest.mark.parametrize("ordered", [True, False])
def test_set_concurrency_up_and_down_under_load_loses_nothing(ordered):
    n = 100_000
    p = lab.Pipeline(range(n)).map(lambda x: x, concurrency=2, name="a", ordered=ordered)
    p = p.map(lambda x: x, concurrency=1, name="b", ordered=ordered)
    schedule = {5_000: ("a", 8), 20_000: ("b", 6), 40_000: ("a", 1), 60_000: ("b", 1),
                70_000: ("a", 16), 85_000: ("a", 3)}
    out = []
    with lab.Loader(p) as loader:
        for i, x in enumerate(loader):
            out.append(x)
            if i in schedule:
                loader.set_concurrency(*schedule[i])
        assert loader.stats().stages["a"].concurrency == 3
        assert loader.stats().stages["b"].concurrency == 1
    if ordered:
        assert out == list(range(n))
    else:
        assert Counter(out) == Counter(range(n))


def test_set_concurrency_changes_worker_count(wait_until):
    gate = threading.Event()

    def blocked(x):
        gate.wait(5)
        return x

    p = lab.Pipeline(range(100)).map(blocked, concurrency=2, name="a")
    with lab.Loader(p) as loader:
        it = iter(loader)
        assert wait_until(lambda: loader.stats().stages["a"].in_flight == 2, 5)
        loader.set_concurrency("a", 6)
        assert wait_until(lambda: loader.stats().stages["a"].in_flight == 6, 5)
        gate.set()
        loader.set_concurrency("a", 1)
        assert list(it) == list(range(100))
        assert loader.stats().stages["a"].concurrency == 1


def test_set_concurrency_rejects_bad_values():
    p = lab.Pipeline(range(3)).map(str, name="a").batch(2)
    with lab.Loader(p) as loader:
        for bad in (0, -1, 1.5, "4", 10**6, True):
            with pytest.raises(lab.PipelineSpecError, match="stage 'a'.*concurrency"):
                loader.set_concurrency("a", bad)
        with pytest.raises(lab.PipelineSpecError, match="no stage named 'nope'.*'a'"):
            loader.set_concurrency("nope", 2)
        with pytest.raises(lab.PipelineSpecError, match="batch stage"):
            loader.set_concurrency("batch", 2)


def test_set_concurrency_before_iterating_applies_to_the_run():
    p = lab.Pipeline(range(10)).map(str, name="a")
    with lab.Loader(p) as loader:
        loader.set_concurrency("a", 5)
        assert loader.stats().stages["a"].concurrency == 5
        assert list(loader) == [str(i) for i in range(10)]
        assert loader.stats().stages["a"].concurrency == 5


def boom_on(bad):
    def fn(x):
        if x in bad:
            raise ValueError(f"bad item {x}")
        return x

    return fn


def test_first_failure_stops_with_pipeline_error_naming_stage_and_item():
    p = lab.Pipeline(range(1000)).map(boom_on({37}), concurrency=4, name="decode")
    with lab.Loader(p) as loader:
        with pytest.raises(lab.PipelineError) as info:
            for _ in loader:
                pass
    err = info.value
    assert err.stage == "decode" and err.index == 37
    assert "stage 'decode'" in str(err) and "item 37" in str(err) and "max_failures" in str(err)
    assert isinstance(err.__cause__, ValueError)


def test_max_failures_drops_and_counts():
    bad = set(range(0, 1000, 100))
    p = lab.Pipeline(range(1000)).map(boom_on(bad), concurrency=4, name="decode")
    with lab.Loader(p, max_failures=len(bad)) as loader:
        out = list(loader)
        assert out == [x for x in range(1000) if x not in bad]
        assert loader.stats().stages["decode"].failures == len(bad)


def test_one_failure_over_the_limit_stops():
    p = lab.Pipeline(range(100)).map(boom_on({3, 50, 70}), name="decode")
    with lab.Loader(p, max_failures=2) as loader:
        with pytest.raises(lab.PipelineError, match="2 failing item.*already dropped") as info:
            list(loader)
    assert info.value.index == 70


def test_failure_after_batch_names_batch_index():
    def fail_third(batch):
        if batch[0] == 20:
            raise RuntimeError("nope")
        return batch

    p = lab.Pipeline(range(100)).batch(10).map(fail_third, name="collate")
    with lab.Loader(p) as loader, pytest.raises(lab.PipelineError) as info:
        list(loader)
    assert info.value.stage == "collate" and info.value.index == 2


def test_source_failure_is_reported():
    def source():
        yield 1
        raise OSError("disk gone")

    with lab.Loader(lab.Pipeline(source).map(str)) as loader:
        with pytest.raises(lab.PipelineError, match="the source failed on item 1: OSError"):
            list(loader)


def test_stop_mid_iteration_leaves_no_threads():
    p = lab.Pipeline(range(10**9)).map(lambda x: x, concurrency=4).batch(8).map(len)
    with lab.Loader(p) as loader:
        for i, _ in enumerate(loader):
            if i == 100:
                break
    # no_thread_leak checks the rest


def test_breaking_out_and_dropping_the_iterator_stops_the_run():
    p = lab.Pipeline(range(10**9)).map(lambda x: x, concurrency=3)
    loader = lab.Loader(p)
    for i, _ in enumerate(loader):
        if i == 10:
            break
    gc.collect()
    loader.close()


def test_temporary_loader_lives_as_long_as_its_iterator():
    p = lab.Pipeline(range(1000)).map(lambda x: x + 1, concurrency=3)
    it = iter(lab.Loader(p))
    gc.collect()
    assert sum(1 for _ in it) == 1000


def test_abandoned_loader_is_stopped_by_gc(wait_until):
    before = set(threading.enumerate())
    p = lab.Pipeline(range(10**9)).map(lambda x: x, concurrency=3)
    loader = lab.Loader(p)
    it = iter(loader)
    next(it)
    assert len(set(threading.enumerate()) - before) >= 4
    del it, loader
    gc.collect()
    assert wait_until(lambda: set(threading.enumerate()) <= before, 5)


def close_while_busy() -> float:
    """Close a loader whose 8 workers are busy; the seconds close() took."""
    p = lab.Pipeline(range(10**9)).map(lambda x: time.sleep(0.01) or x, concurrency=8)
    loader = lab.Loader(p)
    it = iter(loader)
    next(it)
    t0 = time.monotonic()
    loader.close()
    took = time.monotonic() - t0
    loader.close()  # twice is fine
    with pytest.raises(lab.SpdlLabError, match="closed"):
        iter(loader)
    return took


def test_close_while_workers_are_busy_leaves_no_thread_and_twice_is_fine(no_thread_leak):
    close_while_busy()


@pytest.mark.measurement
def test_close_while_workers_are_busy_returns_promptly():
    assert close_while_busy() < 2.0


def test_close_from_another_thread_ends_iteration():
    p = lab.Pipeline(range(10**9)).map(lambda x: x, concurrency=2)
    loader = lab.Loader(p)
    got = []
    it = iter(loader)
    got.append(next(it))
    closer = threading.Thread(target=loader.close)
    closer.start()
    closer.join(5)
    assert not closer.is_alive()
    # The iterator ends (no hang) once its run is closed, and yields nothing after close():
    # a writer that close() woke from a full queue must not put its item after all.
    rest = sum(1 for _ in it)
    assert rest == 0


def test_error_leaves_no_threads():
    p = lab.Pipeline(range(10**6)).map(boom_on({500}), concurrency=4).batch(4).map(len, concurrency=2)
    with lab.Loader(p) as loader, pytest.raises(lab.PipelineError):
        list(loader)


def test_memory_stays_bounded_behind_a_slow_item():
    started = []

    def fn(x):
        started.append(x)
        if x == 0:
            time.sleep(0.5)
        return x

    p = lab.Pipeline(range(100_000)).map(fn, concurrency=4)
    with lab.Loader(p) as loader:
        it = iter(loader)
        assert next(it) == 0
        # While item 0 slept, the others could run ahead only by the reorder window.
        assert len(started) < 200
        assert sum(1 for _ in it) == 99_999


def test_loader_validation():
    with pytest.raises(lab.PipelineSpecError, match="unknown runner 'gpu'"):
        lab.Loader(lab.Pipeline([1]), runner="gpu")
    with pytest.raises(lab.PipelineSpecError, match="takes a lab.Pipeline"):
        lab.Loader([1, 2, 3])
    with pytest.raises(lab.PipelineSpecError, match="buffer_size"):
        lab.Loader(lab.Pipeline([1]), buffer_size=0)
    with pytest.raises(lab.PipelineSpecError, match="max_failures"):
        lab.Loader(lab.Pipeline([1]), max_failures=-1)


def test_random_pipelines_match_a_plain_loop():
    rng = random.Random(7)
    for _ in range(5):
        n = rng.randint(0, 500)
        p = lab.Pipeline(range(n))
        expected = list(range(n))
        for _ in range(rng.randint(1, 4)):
            if rng.random() < 0.3:
                size = rng.randint(1, 9)
                p = p.batch(size)
                expected = [expected[i : i + size] for i in range(0, len(expected), size)]
            else:
                p = p.map(repr, concurrency=rng.randint(1, 6))
                expected = [repr(x) for x in expected]
        with lab.Loader(p, buffer_size=rng.randint(1, 5)) as loader:
            assert list(loader) == expected
