"""lab.compare: the same pipeline and step under several runners."""

from __future__ import annotations

import time

import pytest

import spdl_lab as lab
from spdl_lab.experiments.compare import TABLE_COLUMNS

pytestmark = pytest.mark.usefixtures("no_thread_leak", "no_child_leak")


def slow_items(x):
    time.sleep(0.004)
    return x


def test_compare_thread_and_cache():
    p = lab.Pipeline(range(10**6)).map(slow_items, concurrency=1, name="slow").batch(2)
    cmp = lab.compare(p, step=lambda b: time.sleep(0.002), runners=["thread", "cache"],
                      steps=20, warmup=3, progress=False)
    table = cmp.table
    assert list(table.index) == ["thread", "cache"]
    assert list(table.columns) == TABLE_COLUMNS
    assert (table["steps"] == 20).all()
    # The loader is the bottleneck under thread; cache removes it.
    assert table.loc["cache", "batches_per_s"] > table.loc["thread", "batches_per_s"]
    assert table.loc["thread", "data_wait_frac"] > table.loc["cache", "data_wait_frac"]
    assert cmp.ratios("cache")["cache"] == pytest.approx(1.0)
    assert set(cmp.frames) == {"thread", "cache"}
    html = cmp._repr_html_()
    assert "vs_cache" in html and "thread" in html
    layout = cmp.plot()
    assert layout is not None


def test_compare_rejects_bad_arguments():
    p = lab.Pipeline(range(10))
    with pytest.raises(lab.PipelineSpecError, match="unknown runner"):
        lab.compare(p, step=print, runners=["gpu"])
    with pytest.raises(lab.PipelineSpecError, match="steps must be"):
        lab.compare(p, step=print, steps=0)
    with pytest.raises(lab.PipelineSpecError, match="takes a lab.Pipeline"):
        lab.compare([1], step=print)


def test_compare_names_a_failing_runner():
    p = lab.Pipeline(range(3)).batch(1)
    with pytest.raises(lab.SpdlLabError, match="'thread' run made only 3 steps"):
        lab.compare(p, step=lambda b: None, runners=["thread"], steps=10, warmup=2, progress=False)


def test_a_workload_pair_unpacks_into_compare():
    pipeline, device = lab.workloads.noisy_neighbour(items=10_000, decode_us=200.0, read_ms=0.1)
    small = lab.SimulatedDevice(kernels=10, launch_us=100, kernel_us=200)
    cmp = lab.compare(*(pipeline, small), runners=["thread"], steps=5, warmup=1, progress=False)
    assert cmp.table.loc["thread", "steps"] == 5
    assert cmp.table.loc["thread", "train_gil_wait_frac"] >= 0
    assert device.kernels == 200
