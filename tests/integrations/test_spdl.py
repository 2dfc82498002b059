"""SPDL pipelines on the lab bench: converted (lab.from_spdl) and monitored as SPDL runs them (lab.run)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import cloudpickle
import pytest

pytest.importorskip("spdl.pipeline")

from spdl.pipeline import PipelineBuilder  # noqa: E402
from spdl.pipeline.defs import (  # noqa: E402
    MAIN_PROCESS,
    Aggregator,
    Merge,
    Pipe,
    PipelineConfig,
    ProcessPoolExecutorConfig,
    SinkConfig,
    SourceConfig,
)

import spdl_lab as lab  # noqa: E402
from spdl_lab._diagnose._sweep import SweepSettings  # noqa: E402
from spdl_lab._integrations import SpdlMonitor, is_spdl_spec  # noqa: E402
from spdl_lab._integrations.spdl import SpdlNotInstalledError  # noqa: E402

AGGREGATE = "aggregate(op=collate(4), drop_last=False)"  # SPDL's own name for aggregate(4)
NAMES = ["scale", "shift", AGGREGATE, "total"]


def scale(x):
    return x * 10


async def shift(x):
    await asyncio.sleep(0.001)
    return x + 1


def total(batch):
    return sorted(batch)


def builder(n=20):
    return (PipelineBuilder().add_source(range(n))
            .pipe(scale, concurrency=2)
            .pipe(shift, concurrency=3)
            .aggregate(4)
            .pipe(total)
            .add_sink(3))


def run_in_spdl(b):
    pipeline = b.build(num_threads=4)
    with pipeline.auto_stop(timeout=10):
        return list(pipeline.get_iterator(timeout=10))


def flat(batches):
    return sorted(x for batch in batches for x in batch)


def step(batch):
    time.sleep(0.001)


# -- lab.from_spdl ---------------------------------------------------------------------------


def test_from_spdl_keeps_names_concurrency_and_order():
    p = lab.from_spdl(builder())
    assert [s.name for s in p.stages] == NAMES
    assert [(s.kind, s.concurrency) for s in p.stages] == [("map", 2), ("map", 3), ("batch", 1), ("map", 1)]
    assert p.stages[2].size == 4 and not p.stages[2].drop_last
    assert not any(s.ordered for s in p.stages if s.kind == "map")  # SPDL's default: completion order

    same = (PipelineBuilder().add_source(range(3)).pipe(scale, output_order="input")
            .pipe(scale, concurrency=4).pipe(scale, name="source").aggregate(2, drop_last=True).add_sink(1))
    p = lab.from_spdl(same.get_config())  # a PipelineConfig works as well as its builder
    assert [s.name for s in p.stages] == ["scale", "scale_2", "source_2",
                                          "aggregate(op=collate(2), drop_last=True)"]
    assert p.stages[0].ordered and not p.stages[1].ordered and p.stages[3].drop_last


def test_converted_pipeline_gives_spdl_items_under_thread_runner(no_thread_leak):
    expected = run_in_spdl(builder())
    with lab.Loader(lab.from_spdl(builder()), runner="thread") as loader:
        got = list(loader)
        snap = loader.stats()
    assert len(got) == len(expected) == 5
    assert flat(got) == flat(expected) == [10 * x + 1 for x in range(20)]
    assert snap.stages["shift"].tasks == 20 and snap.stages["total"].tasks == 5


def test_converted_pipeline_is_diagnosed(no_thread_leak):
    p = lab.from_spdl(builder())
    diag = lab.diagnose(p, concurrency=(1, 2), num_items=20, processes=False,
                        settings=SweepSettings(warmup_s=0.1, window_s=0.2, min_windows=3, max_windows=4),
                        progress=False)
    assert list(diag.stages) == NAMES
    for name in ("scale", "shift", "total"):
        stage = diag.stages[name]
        assert stage.error is None, stage.error
        # A verdict, or that other processes took the cores (the unit set runs two tests at once).
        assert stage.verdict in ("scales", "cpu-bound", "gil-bound", "contended") or (
            stage.status == "unstable" and stage.evidence.startswith("unstable: the machine was busy")), stage
        assert stage.best_concurrency in (1, 2)
    assert diag.stages[AGGREGATE].kind == "batch"


def test_converted_pipeline_is_compared(no_thread_leak):
    cmp = lab.compare(lab.from_spdl(builder(400)), step, runners=("thread", "cache"), steps=12, warmup=4,
                      progress=False, probes=False)
    assert list(cmp.table.index) == ["thread", "cache"]
    assert (cmp.table["batches_per_s"] > 0).all()


def _loop_running() -> bool:
    return any(t.name == "spdl_lab:async-stages" for t in threading.enumerate())


def test_async_stages_run_on_a_loop_that_stops_with_their_threads(no_thread_leak, wait_until):
    p = lab.from_spdl(builder())
    shift_fn = p.stage("shift").fn
    assert not _loop_running()  # started by the first call
    seen = []
    worker = threading.Thread(target=lambda: seen.append((shift_fn(1), _loop_running())))
    worker.start()
    worker.join(5)
    assert seen == [(2, True)]
    assert wait_until(lambda: not _loop_running(), 5)  # its last user ended: the loop stopped
    copy = cloudpickle.loads(cloudpickle.dumps(p))  # what process runners send
    assert copy.stage("shift").fn.loop is not shift_fn.loop
    with ThreadPoolExecutor(2) as pool:
        assert pool.submit(copy.stage("shift").fn, 4).result(5) == 5


def test_async_source_and_none_results(no_thread_leak):
    class Numbers:
        def __aiter__(self):
            return self._items()

        async def _items(self):
            for i in range(6):
                await asyncio.sleep(0)
                yield i

    def odd_or_none(x):
        return x if x % 2 else None  # SPDL drops the Nones

    b = PipelineBuilder().add_source(Numbers()).pipe(odd_or_none).add_sink(2)
    assert sorted(run_in_spdl(b)) == [1, 3, 5]
    with lab.Loader(lab.from_spdl(b), max_failures=10) as loader:
        assert sorted(loader) == [1, 3, 5]
        assert loader.stats().stages["odd_or_none"].failures == 3
    with lab.Loader(lab.from_spdl(b)) as loader, pytest.raises(lab.PipelineError, match="returned None"):
        list(loader)


class Longest(Aggregator):
    def accumulate(self, item):
        return None

    def flush(self):
        return None


def gen(x):
    yield x


async def agen(x):
    yield x


def region():
    return (PipelineBuilder().add_source(range(4)).to(ProcessPoolExecutorConfig(max_workers=1))
            .pipe(scale).to(MAIN_PROCESS).add_sink(2))


REFUSED = {
    "generator": (lambda: PipelineBuilder().add_source(range(3)).pipe(gen).add_sink(1),
                  ["stage 'gen'", "generator", "lab.run(builder"]),
    "async generator": (lambda: PipelineBuilder().add_source(range(3)).pipe(agen).add_sink(1),
                        ["stage 'agen'", "async generator"]),
    "executor": (lambda: PipelineBuilder().add_source(range(3)).pipe(scale, executor=ThreadPoolExecutor(1))
                 .add_sink(1), ["stage 'scale'", "ThreadPoolExecutor", "Drop executor="]),
    "stage max_failures": (lambda: PipelineBuilder().add_source(range(3)).pipe(scale, max_failures=2)
                           .add_sink(1), ["stage 'scale'", "max_failures (2)", "lab.Loader"]),
    "custom aggregator": (lambda: PipelineBuilder().add_source(range(3)).aggregate(Longest()).add_sink(1),
                          ["custom Aggregator (Longest)", "aggregate(n)"]),
    "disaggregate": (lambda: PipelineBuilder().add_source(range(3)).aggregate(2).disaggregate().add_sink(1),
                     ["stage 'disaggregate'", "split batches"]),
    "path variants": (lambda: PipelineBuilder().add_source(range(3))
                      .path_variants(lambda x: x % 2, [[Pipe(scale)], [Pipe(total)]], name="route").add_sink(1),
                      ["stage 'route'", "path_variants with 2 paths", "builder.build("]),
    "to() region": (region, ["region marker", "ProcessPoolExecutorConfig", "no regions"]),
    "merge source": (lambda: PipelineConfig(
        Merge([PipelineConfig(SourceConfig([1]), [], SinkConfig(1))] * 2), [], SinkConfig(1)),
        ["Merge of 2 pipelines", "one source"]),
    "continuous source": (lambda: PipelineBuilder().add_source(range(3), continuous=True).add_sink(1),
                          ["continuous=True", "continuous=False"]),
    "built pipeline": (lambda: PipelineBuilder().add_source(range(3)).add_sink(1).build(num_threads=1),
                       ["built spdl.pipeline.Pipeline", "pass the PipelineBuilder"]),
    "builder without sink": (lambda: PipelineBuilder().add_source(range(3)), ["Sink is not set", "add_sink"]),
    "not SPDL": (lambda: [1, 2, 3], ["PipelineBuilder or", "got list"]),
}


@pytest.mark.parametrize("kind", list(REFUSED))
def test_from_spdl_refuses_what_it_cannot_honour(kind):
    make, words = REFUSED[kind]
    spec = make()
    with pytest.raises(lab.PipelineSpecError) as caught:
        lab.from_spdl(spec)
    if hasattr(spec, "auto_stop"):  # a built pipeline: run it once, or its coroutine is never awaited
        with spec.auto_stop(timeout=5):
            list(spec.get_iterator(timeout=5))
    for word in words:
        assert word in str(caught.value)


# -- lab.run(builder): the SPDL pipeline as SPDL runs it ----------------------------------------


def test_monitor_counts_every_task_and_queue(no_thread_leak):
    # 20 items, 5 batches: everything flows. Each step takes 20 ms so that the run outlasts the
    # CPU probe's shortest span (MIN_SPAN_S): a 5 ms run has no CPU reading, and says none.
    session = lab.run(builder(), step=lambda batch: time.sleep(0.02), steps=5)
    assert session.wait(timeout=30)
    assert session.runner == "spdl" and session.state == "finished"
    snap = session.stats()
    assert snap.runner == "spdl" and snap.items_out == 5 and snap.step.steps == 5
    assert list(snap.stages) == NAMES
    assert snap.source.tasks == 20
    assert {name: s.tasks for name, s in snap.stages.items()} == {
        "scale": 20, "shift": 20, AGGREGATE: 20, "total": 5}  # an aggregate's task is one item
    assert all(s.failures == 0 and s.in_flight == 0 for s in snap.stages.values())
    assert snap.stages["shift"].concurrency == 3
    assert list(snap.queues) == ["source→scale", "scale→shift", f"shift→{AGGREGATE}",
                                 f"{AGGREGATE}→total", "total→sink", "sink→output"]
    assert snap.queues["sink→output"].capacity == 3 and snap.stages["scale"].queue_capacity == 2
    frames = session.frames()
    tasks = frames[frames.series == "tasks"]
    assert set(tasks.stage) == {"source", *NAMES}
    assert tasks.groupby("stage").value.max().to_dict()["total"] == 5
    assert {"queue_depth", "queue_capacity", "put_blocked_frac", "step_ms", "cpu_percent"} <= set(frames.series)
    assert session.controls() == {}
    with pytest.raises(lab.PipelineSpecError, match="fixes each stage's concurrency"):
        session.set_concurrency("scale", 4)
    assert "total" in session.summary().index


@pytest.mark.measurement
def test_monitor_times_each_task(no_thread_leak):
    session = lab.run(builder(), step=step, steps=5)
    assert session.wait(timeout=30)
    assert session.stats().stages["shift"].p50_ms >= 0.9  # it sleeps 1 ms


def test_monitor_counts_failures_and_names_the_failing_stage(no_thread_leak):
    def picky(x):
        if x % 5 == 0:
            raise ValueError(f"no {x}")
        return x

    def failing():
        return PipelineBuilder().add_source(range(20)).pipe(picky, concurrency=2).aggregate(4).add_sink(2)

    session = lab.run(failing(), step=step)  # SPDL's default max_failures: drop and count
    assert session.wait(timeout=30)
    snap = session.stats()
    assert snap.stages["picky"].tasks == 20 and snap.stages["picky"].failures == 4
    assert snap.step.steps == 4

    session = lab.run(failing(), step=step, max_failures=0)
    with pytest.raises(lab.PipelineError, match="stage 'picky' failed") as caught:
        session.wait(timeout=30)
    assert caught.value.stage == "picky"


def test_monitor_takes_what_from_spdl_refuses(no_thread_leak):
    def pairs(x):
        yield x
        yield -x

    with ThreadPoolExecutor(1) as own:
        b = (PipelineBuilder().add_source(range(6)).pipe(pairs)
             .pipe(scale, executor=own, output_order="input").aggregate(3).disaggregate().add_sink(4))
        seen = []
        with SpdlMonitor(b, task_hook_factory=lambda info: seen.append(info.stage_name) or []) as monitor:
            assert monitor.options["num_threads"] == 1  # pairs; scale brings its own executor
            assert sorted(monitor) == sorted(10 * y for x in range(6) for y in (x, -x))
            snap = monitor.stats()
    assert seen == ["pairs", "scale", AGGREGATE.replace("4", "3"), "disaggregate"]  # the user's hooks too
    # a generator's task is one value yielded (SPDL's own count), disaggregate's too
    assert [snap.stages[n].tasks for n in ("pairs", "scale", "disaggregate")] == [12, 12, 12]
    assert snap.stages[AGGREGATE.replace("4", "3")].tasks == 12


@pytest.mark.parametrize("kind", ["path variants", "to() region", "merge source"])
def test_monitor_refuses_branches_and_regions(kind):
    make, _ = REFUSED[kind]
    with pytest.raises(lab.PipelineSpecError, match=r"lab\.run.*(not supported).*builder\.build\(num_threads"):
        lab.run(make(), step=step)


def test_monitor_checks_build_options():
    with pytest.raises(lab.PipelineSpecError, match="queue_class"):
        lab.run(builder(), step=step, queue_class=object)
    with pytest.raises(lab.PipelineSpecError, match="'buffer_size'.*num_threads"):
        lab.run(builder(), step=step, buffer_size=3)


def test_run_under_a_lab_runner_converts(no_thread_leak):
    session = lab.run(builder(), step=step, runner="thread", steps=5)
    assert session.wait(timeout=30)
    assert session.runner == "thread" and list(session.stats().stages) == NAMES
    assert session.controls()["shift"] == 3


def test_diagnostic_mode_diagnoses_the_converted_pipeline(monkeypatch):
    from spdl_lab._diagnose import env_mode as diagnostic_mode

    seen = []

    def fake(pipeline):
        seen.append(pipeline)
        raise SystemExit(1)

    monkeypatch.setenv(diagnostic_mode.ENV, "1")
    monkeypatch.setattr(diagnostic_mode, "run_diagnostic_mode", fake)
    with pytest.raises(SystemExit):
        lab.run(builder(), step=step)
    assert [s.name for s in seen[0].stages] == NAMES
    with pytest.raises(lab.PipelineSpecError, match="SPDL_PIPELINE_DIAGNOSTIC_MODE=1.*refused"):
        lab.run(PipelineBuilder().add_source(range(3)).pipe(gen).add_sink(1), step=step)


def test_dashboard_shows_a_monitored_pipeline(no_thread_leak, wait_until):
    pytest.importorskip("ipywidgets")
    pytest.importorskip("bokeh")
    session = lab.run(builder(10**6), step=step, duration=30)
    dash = None
    try:
        dash = session.dashboard()
        assert list(dash.runner.options) == ["spdl"] and dash.runner.disabled and dash.sliders == {}
        assert wait_until(lambda: dash.plots is not None and "shift" in dash.table.value, 15)
        assert {"qps:shift", "queue_depth:scale→shift"} <= set(dash.plots.source.data)
    finally:
        session.stop()
        if dash is not None:
            dash.close()


# -- without SPDL ---------------------------------------------------------------------------


def test_from_spdl_without_spdl_says_to_install_it(monkeypatch):
    spdl_builder = builder()
    for name in [m for m in sys.modules if m == "spdl" or m.startswith("spdl.")]:
        monkeypatch.setitem(sys.modules, name, None)
    assert not is_spdl_spec(spdl_builder)
    with pytest.raises(SpdlNotInstalledError, match="pip install spdl_core"):
        lab.from_spdl(object())


def test_spdl_lab_imports_without_spdl():
    script = textwrap.dedent("""
        import sys

        tried = []

        class NoSpdl:  # spdl is not installed, as far as this interpreter can tell
            def find_spec(self, name, path=None, target=None):
                if name == "spdl" or name.startswith("spdl."):
                    tried.append(name)
                    raise ModuleNotFoundError(f"No module named {name!r}")

        sys.meta_path.insert(0, NoSpdl())
        import spdl_lab as lab
        assert tried == [], tried  # importing spdl_lab does not even look for spdl
        try:
            lab.from_spdl(object())
        except ImportError as exc:
            print(type(exc).__name__, exc)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("SpdlNotInstalledError") and "pip install spdl_core" in done.stdout
