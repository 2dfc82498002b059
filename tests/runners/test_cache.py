"""The cache runner (headspace)."""

from __future__ import annotations

import pytest

import spdl_lab as lab
from spdl_lab._runners.cache import expected_outputs

pytestmark = pytest.mark.usefixtures("no_thread_leak")


def pipeline(n=100):
    return lab.Pipeline(range(n)).map(lambda x: x * 10, concurrency=2, name="ten").batch(4)


def test_replays_exactly_the_cached_batches_for_the_pipelines_length():
    with lab.Loader(pipeline(), runner="cache", num_caches=3) as loader:
        out = list(loader)
        snap = loader.stats()
    assert len(out) == 25
    first = out[:3]
    assert first == [[0, 10, 20, 30], [40, 50, 60, 70], [80, 90, 100, 110]]
    for i, batch in enumerate(out):
        assert batch is first[i % 3]
    # The source runner stopped after producing the cached batches.
    assert snap.stages["batch"].tasks < 25


def test_caches_a_process_runner_with_its_options():
    with lab.Loader(pipeline(16), runner="cache", source_runner="process", num_workers=1, num_caches=2) as loader:
        out = list(loader)
    assert out == [[0, 10, 20, 30], [40, 50, 60, 70]] * 2


def test_forever_and_explicit_count():
    with lab.Loader(pipeline(), runner="cache", num_caches=2, forever=True) as loader:
        it = iter(loader)
        got = [next(it) for _ in range(100)]
    assert len(got) == 100 and got[50] is got[0]
    with lab.Loader(pipeline(), runner="cache", num_caches=2, num_outputs=7) as loader:
        assert len(list(loader)) == 7


def test_short_pipeline_caches_what_there_is():
    with lab.Loader(pipeline(6), runner="cache", num_caches=8) as loader:
        assert list(loader) == [[0, 10, 20, 30], [40, 50]]


def test_expected_outputs_counts_with_and_without_len():
    assert expected_outputs(pipeline(10)) == 3
    assert expected_outputs(lab.Pipeline(range(10)).batch(4, drop_last=True)) == 2
    assert expected_outputs(lab.Pipeline(lambda: iter(range(9))).batch(2).batch(2)) == 3


def test_headspace_from_a_loader_or_a_pipeline():
    base = lab.Loader(pipeline(), runner="thread", buffer_size=2)
    with lab.headspace(base, num_caches=2) as fast:
        assert fast.runner == "cache"
        assert len(list(fast)) == 25
    base.close()
    with lab.headspace(pipeline(), num_caches=1) as fast:
        out = list(fast)
    assert len(out) == 25 and all(b is out[0] for b in out)
    with pytest.raises(lab.PipelineSpecError, match="headspace takes"):
        lab.headspace([1, 2])


def test_bad_options():
    with pytest.raises(lab.PipelineSpecError, match="num_caches"):
        lab.Loader(pipeline(), runner="cache", num_caches=0)
    with pytest.raises(lab.PipelineSpecError, match="another runner"):
        lab.Loader(pipeline(), runner="cache", source_runner="cache")


def test_unknown_runner_options_are_rejected_up_front():
    with pytest.raises(lab.PipelineSpecError, match="'thread' does not take option.*'num_workers'"):
        lab.Loader(pipeline(), runner="thread", num_workers=3)
    with pytest.raises(lab.PipelineSpecError, match="does not take option.*'bogus'"):
        lab.Loader(pipeline(), runner="cache", bogus=1)


def test_endless_source_without_len_asks_for_a_count(monkeypatch):
    import itertools

    from spdl_lab._runners import cache

    monkeypatch.setattr(cache, "MAX_COUNTED_ITEMS", 1000)
    p = lab.Pipeline(itertools.count).batch(2)
    with pytest.raises(lab.PipelineSpecError, match="num_outputs=N or forever=True"):
        expected_outputs(p)
    with lab.Loader(p, runner="cache", num_caches=2) as loader:
        it = iter(loader)
        next(it)
        with pytest.raises(lab.PipelineSpecError, match="may be endless"):
            next(it)  # the cache is full: replay must know how long to run


def test_a_session_under_cache_replays_until_its_steps():
    import itertools

    session = lab.run(lab.Pipeline(itertools.count).batch(2), step=lambda b: None,
                      runner="cache", steps=30, num_caches=3)
    assert session.wait(timeout=30)
    assert session.stats().step.steps == 30
