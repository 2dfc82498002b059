"""lab.compare: the same pipeline and step under several runners, in interleaved rounds."""

from __future__ import annotations

import math
import subprocess
import sys
import threading
import time

import psutil
import pytest

import spdl_lab as lab
from spdl_lab._experiments import compare as contender
from spdl_lab._experiments.compare import DEFAULT_WARMUP, TABLE_COLUMNS, pipeline_length
from spdl_lab._experiments.comparison import WIDTH
from spdl_lab._telemetry.probes import cpu_seconds

pytestmark = pytest.mark.usefixtures("no_thread_leak", "no_child_leak")


def slow_items(x):
    time.sleep(0.004)
    return x


def test_compare_thread_and_cache_in_interleaved_rounds():
    p = lab.Pipeline(range(10**6)).map(slow_items, concurrency=1, name="slow").batch(2)
    cmp = lab.compare(p, step=lambda b: time.sleep(0.002), runners=["thread", "cache"],
                      steps=20, warmup=3, repeats=4, progress=False)
    table = cmp.table
    assert list(table.index) == ["thread", "cache"]
    assert list(table.columns) == TABLE_COLUMNS
    assert (table["steps"] == 20).all() and cmp.repeats == 4
    # Every runner got one window per round, and the order rotated.
    rounds = cmp.rounds
    assert sorted(rounds.groupby("runner").size().tolist()) == [4, 4]
    first = rounds.sort_values("started_s").groupby("round")["runner"].first().tolist()
    assert first == ["thread", "cache", "thread", "cache"]
    # The median lies within its spread; ratios pair rounds.
    assert (table["batches_per_s_lo"] <= table["batches_per_s"]).all()
    assert (table["batches_per_s"] <= table["batches_per_s_hi"]).all()
    assert table.loc["cache", "vs_cache"] == pytest.approx(1.0)
    assert cmp.ratios("cache")["cache"] == pytest.approx(1.0)
    assert set(cmp.frames) == {"thread", "cache"}
    html = cmp._repr_html_()
    assert "vs cache" in html and "thread" in html
    assert cmp.plot() is not None


class _Waits(threading.Event):
    """An event that records each wait (none fires)."""

    def __init__(self) -> None:
        super().__init__()
        self.waits: list[float] = []

    def wait(self, timeout: float | None = None) -> bool:
        self.waits.append(timeout)
        return super().wait(timeout)


def test_a_first_window_waits_until_the_processes_its_run_started_are_old_enough(monkeypatch):
    """Ray starts workers for its first tasks just after the first batch: measured at once, their
    start-up read as the runner's speed (half its rate). Its first window waits for them."""
    monkeypatch.setattr(contender, "SETTLE_AGE_S", 1.0)
    since = time.time()
    nothing = _Waits()
    contender._settle(since, 0.1, nothing)  # no process started since: no wait (the thread runner)
    assert nothing.waits == []
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        started = _Waits()
        contender._settle(since, 0.1, started)
        assert started.waits and time.time() - max(contender._births()) >= 1.0
    finally:
        child.kill()
        child.wait()


@pytest.mark.measurement
def test_cache_removes_the_loader_bottleneck():
    p = lab.Pipeline(range(10**6)).map(slow_items, concurrency=1, name="slow").batch(2)
    cmp = lab.compare(p, step=lambda b: time.sleep(0.002), runners=["thread", "cache"],
                      steps=20, warmup=3, repeats=4, progress=False)
    table = cmp.table
    # The loader is the bottleneck under thread; cache removes it.
    assert table.loc["cache", "batches_per_s"] > table.loc["thread", "batches_per_s"]
    assert table.loc["thread", "data_wait_frac"] > table.loc["cache", "data_wait_frac"]


def test_compare_rejects_bad_arguments():
    p = lab.Pipeline(range(10**6))
    with pytest.raises(lab.PipelineSpecError, match="unknown runner"):
        lab.compare(p, step=print, runners=["gpu"])
    with pytest.raises(lab.PipelineSpecError, match="steps must be"):
        lab.compare(p, step=print, steps=0)
    with pytest.raises(lab.PipelineSpecError, match="repeats must be"):
        lab.compare(p, step=print, repeats=0)
    with pytest.raises(lab.PipelineSpecError, match="named twice"):
        lab.compare(p, step=print, runners=["thread", "thread"])
    with pytest.raises(lab.PipelineSpecError, match="takes a lab.Pipeline"):
        lab.compare([1], step=print)


def test_a_finite_pipeline_is_refused_before_running_with_the_numbers():
    p = lab.Pipeline(range(200)).batch(16)  # 13 batches
    assert pipeline_length(p) == 13
    with pytest.raises(lab.PipelineSpecError, match=r"yields 13 outputs.*needs 150 \(5 rounds x 10 warm-up \+ 100 measured"):
        lab.compare(p, step=lambda b: None, runners=["thread"], steps=100, progress=False)
    assert pipeline_length(lab.Pipeline(range(200)).batch(16, drop_last=True)) == 12
    assert pipeline_length(lab.Pipeline(lambda: iter(range(5)))) is None


def test_data_that_runs_out_anyway_names_the_runner():
    def fewer(x):  # the source's len() promises more than the stage lets through
        if x >= 3:
            raise ValueError("dropped")
        return x
    p = lab.Pipeline(range(50)).map(fewer, name="fewer").batch(1)
    with pytest.raises(lab.SpdlLabError, match="'thread'"):
        lab.compare(p, step=lambda b: None, runners=["thread"], steps=10, warmup=2, repeats=2,
                    progress=False)


def test_a_workload_pair_unpacks_into_compare():
    pipeline, device = lab.workloads.noisy_neighbour(items=10_000, decode_us=200.0, read_ms=0.1)
    small = lab.SimulatedDevice(kernels=10, launch_us=100, kernel_us=200)
    cmp = lab.compare(*(pipeline, small), runners=["thread"], steps=6, warmup=1, repeats=2, progress=False)
    assert cmp.table.loc["thread", "steps"] == 6
    assert cmp.table.loc["thread", "train_gil_wait_frac"] >= 0
    assert device.kernels == 200


def test_printed_table_fits_100_columns_and_leaves_out_what_does_not_apply():
    p = lab.Pipeline(range(10**6)).map(slow_items, concurrency=2, name="slow").batch(2)
    cmp = lab.compare(p, step=lambda b: None, runners=["thread", "subprocess-threads", "cache"],
                      steps=6, warmup=1, repeats=2, progress=False)
    text = repr(cmp)
    assert max(map(len, text.splitlines())) <= WIDTH, text
    header = text.splitlines()[2]
    assert "device" not in header and "train GIL" not in header  # no SimulatedDevice: no such columns
    assert "batches/s [lo-hi]" in header and "vs cache" in header


def test_warmup_defaults_agree_between_api_and_cli():
    from spdl_lab import cli

    parser = cli.build_parser()
    for command in ("compare", "demo"):
        args = parser.parse_args([command, "m:p"] if command == "compare" else [command])
        assert args.warmup == DEFAULT_WARMUP, command
    assert not math.isnan(DEFAULT_WARMUP)


def test_the_ray_instances_cpu_never_goes_down_when_one_of_its_processes_ends(monkeypatch):
    """A sum over the instance's live processes fell by a retired worker's whole life (a busy
    unit run read 20.3 s, then 18.4 s): a window's idle Ray CPU came out negative, and was taken
    as none. Each process keeps what it used."""
    burner = subprocess.Popen([sys.executable, "-c", "import time\nt = time.process_time()\n"
                               "while time.process_time() - t < 0.3: pass\ninput()"], stdin=subprocess.PIPE)
    try:
        proc = psutil.Process(burner.pid)
        monkeypatch.setattr(contender, "ray_processes", lambda: [proc] if proc.is_running() else [])
        clock = contender.MachineClock(None)  # sees the worker from its start
        while (cpu_seconds(proc) or 0.0) < 0.3:
            time.sleep(0.02)
        used = clock.ray_s()
        assert used > 0.1, used
    finally:
        burner.communicate(b"\n", timeout=10)  # the worker ends
    assert clock.ray_s() >= used
