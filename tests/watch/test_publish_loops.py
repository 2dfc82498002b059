"""Publishing what a training loop iterates: a plain torch DataLoader (by lab.publish, and
with no code change under spdl-lab watch), a Loader over several epochs, a built SPDL
pipeline; the steps are timed, the timeline is one run, the state says how it ended."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import spdl_lab as lab
from spdl_lab._training import cuda_available
from spdl_lab._watch.publish import published_by, record_of
from spdl_lab._watch.records import read_record, record_meta


class Squares(Dataset):
    def __len__(self) -> int:
        return 24

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((4,), float(i * i))


@pytest.fixture
def runtime(tmp_path, monkeypatch):
    monkeypatch.setenv("SPDL_LAB_RUNTIME_DIR", str(tmp_path / "rt"))
    monkeypatch.setenv("SPDL_LAB_RECORD", str(tmp_path / "run.sqlite"))
    return tmp_path


def _series(frames, series: str, stage: str):
    return frames[(frames.series == series) & (frames.stage == stage)].value


def test_a_published_dataloader_times_each_epoch_and_refuses_set_concurrency(runtime, no_thread_leak,
                                                                             wait_until):
    dl = DataLoader(Squares(), batch_size=4)
    loop = lab.publish(dl, name="squares")
    assert len(loop) == 6 and loop.batch_size == 4 and lab.publish(dl) is loop  # the DataLoader's own
    publisher = published_by(dl)
    seen = []
    for _ in range(2):
        for batch in loop:
            seen.append(batch)
    for i, _ in enumerate(loop):  # a loop that breaks: the held step is not counted
        if i == 2:
            break
    assert len(seen) == 12 and torch.equal(seen[6][1], torch.full((4,), 1.0))
    assert publisher.source.loop.clock.steps == 12 + 2
    remote = lab.attach("squares", timeout=5)
    try:
        assert remote.runner == "DataLoader" and remote.controls() == {}
        with pytest.raises(lab.SpdlLabError, match="num_workers is fixed when an epoch starts"):
            remote.set_concurrency("workers", 4)
        wait_until(lambda: _series(remote.frames(), "steps", "step").max() == 14, timeout=5)
        summary = remote.summary()
        assert summary.loc["step", "tasks"] == 14 and 0 <= summary.loc["step", "data_wait_frac"] <= 1
    finally:
        remote.close()
    lab.unpublish(loop)
    assert published_by(dl) is None and record_meta(runtime / "run.sqlite")["state"] == "finished"
    assert not list((runtime / "rt").iterdir())


def test_a_loader_published_over_several_epochs_is_one_timeline(runtime, no_thread_leak, wait_until):
    pipeline = lab.Pipeline(range(40)).map(lambda x: x + 1, concurrency=2, name="inc").batch(4)
    loader = lab.publish(lab.Loader(pipeline, runner="thread", sample_hz=50), name="epochs")
    publisher = published_by(loader)
    with loader:
        for _ in range(3):
            for _ in loader:
                pass
            # each epoch is a new run of the Loader: the timeline must keep its ticks
            wait_until(lambda: len(publisher.timeline.ring) > 0, timeout=5)
        wait_until(lambda: _series(lab.open(runtime / "run.sqlite").frames(), "steps", "step").max() == 30,
                   timeout=10)
    lab.unpublish(loader)
    frames = read_record(runtime / "run.sqlite")
    times = np.sort(frames.time_s.unique())
    assert (np.diff(times) > 0).all() and publisher.source.loop.clock.steps == 30
    # the stage's tasks restart with each epoch's run; each run reaches 40
    assert (_series(frames, "tasks", "inc") == 40).sum() >= 1


def test_unpublish_in_the_loop_stops_the_publishing_not_the_loop(runtime, no_thread_leak):
    """The epoch goes on, untimed: it ended after the batch it held (4 of 10) before."""
    items = list(range(10))
    seen = []
    for i, item in enumerate(lab.publish(items, name="cut")):
        seen.append(item)
        if i == 3:
            clock = published_by(items).source.clock
            lab.unpublish(items)
    assert seen == items and clock.steps == 4


def _run(tmp_path, code: str, *args: str, watch: bool = False) -> subprocess.CompletedProcess:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(code))
    env = {**os.environ, "SPDL_LAB_RUNTIME_DIR": str(tmp_path / "rt")}
    command = [sys.executable, str(script), *args]
    if watch:
        command = [sys.executable, "-m", "spdl_lab", "watch", "--record", str(tmp_path / "run.sqlite"),
                   "--", *command]
    else:
        env["SPDL_LAB_RECORD"] = str(tmp_path / "run.sqlite")
    return subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


NO_SPDL_LAB = '''
    import sys, time
    import torch
    from torch.utils.data import DataLoader, Dataset

    class Slow(Dataset):
        def __len__(self): return 64
        def __getitem__(self, i):
            t = time.perf_counter()
            while time.perf_counter() - t < 0.003: pass
            return torch.full((8,), float(i))

    if __name__ == "__main__":
        dl = DataLoader(Slow(), batch_size=4, num_workers=2)
        for epoch in range(4):
            for batch in dl:
                time.sleep(0.03)  # epochs of ~0.5 s: the 10-Hz sampler reads the workers' CPU
        assert "spdl_lab" in sys.modules  # imported by the hook, at the first epoch
        print("trained", flush=True)
'''


@pytest.mark.timeout(150)
def test_spdl_lab_watch_publishes_a_dataloader_in_a_script_that_never_imports_spdl_lab(tmp_path, monkeypatch,
                                                                                      wait_until):
    monkeypatch.setenv("SPDL_LAB_RUNTIME_DIR", str(tmp_path / "rt"))
    (tmp_path / "train.py").write_text(textwrap.dedent(NO_SPDL_LAB))
    proc = subprocess.Popen([sys.executable, "-m", "spdl_lab", "watch", "--name", "plain", "--record",
                             str(tmp_path / "run.sqlite"), "--", sys.executable, "train.py"],
                            cwd=tmp_path, stdout=subprocess.PIPE, text=True)
    try:
        remote = lab.attach("plain", timeout=60)  # attached while the script trains
        try:
            assert remote.runner == "DataLoader" and remote.controls() == {}
            wait_until(lambda: len(_series(remote.frames(), "cpu_percent", "workers")) > 0, timeout=30)
            with pytest.raises(lab.SpdlLabError, match="lab.from_dataloader"):
                remote.set_concurrency("workers", 4)
            wait_until(lambda: remote.state == "finished", timeout=60)
        finally:
            remote.close()
        assert proc.wait(30) == 0 and proc.stdout.read().strip() == "trained"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        proc.stdout.close()
    meta = record_meta(tmp_path / "run.sqlite")
    assert meta["runner"] == "DataLoader" and meta["state"] == "finished" and meta["name"] == "plain"
    frames = read_record(tmp_path / "run.sqlite")
    assert _series(frames, "steps", "step").max() == 4 * 16
    workers = _series(frames, "cpu_percent", "workers")
    assert len(workers) > 0 and workers.max() <= 100 * os.cpu_count()
    assert _series(frames, "processes", "workers").max() == 2
    assert not list((tmp_path / "rt").iterdir())


COLLECTS_AFTER_THE_IMPORT = '''
    import gc, json, sys
    from torch.utils.data import DataLoader

    full = []  # who asked for each full collection (an allocation's function, or gc.collect's caller)
    gc.callbacks.append(lambda phase, info: phase == "start" and info["generation"] == 2
                        and full.append(sys._getframe(1).f_code.co_name))
    imported_before = "spdl_lab" in sys.modules
    for batch in DataLoader(list(range(8)), batch_size=2):
        pass
    print(json.dumps([imported_before, full]))
'''


@pytest.mark.timeout(120)
def test_the_watch_hook_collects_the_garbage_of_its_import_before_the_first_epoch_goes_on(tmp_path, monkeypatch):
    """The lab's import at a script's first epoch leaves some 49,000 objects (docs/measurements.md):
    the hook collects then, so that the full collection they make due does not fall in a later epoch."""
    monkeypatch.setenv("SPDL_LAB_RUNTIME_DIR", str(tmp_path / "rt"))
    (tmp_path / "train.py").write_text(textwrap.dedent(COLLECTS_AFTER_THE_IMPORT))
    out = subprocess.run([sys.executable, "-m", "spdl_lab", "watch", "--record", str(tmp_path / "run.sqlite"),
                          "--", sys.executable, "train.py"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=90)
    assert out.returncode == 0, out.stderr[-2000:]
    imported_before, full = json.loads(out.stdout.strip().splitlines()[-1])
    assert not imported_before and "_import_the_lab" in full, full


ON_A_GPU_MACHINE = '''
    import json, sys, torch
    from torch.utils.data import DataLoader

    x = torch.ones(512, 512, device=sys.argv[1])
    for batch in DataLoader([torch.zeros(2)] * 40, batch_size=2):
        for _ in range(20):
            x = (x @ x).clamp(max=1)
    print(json.dumps([torch.cuda.is_initialized(), torch._C._cuda_hasPrimaryContext(0)]))
'''


@pytest.mark.timeout(120)
@pytest.mark.skipif(not cuda_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_watched_job_is_timed_on_the_gpu_it_uses_and_one_that_uses_none_gets_no_context(tmp_path, device):
    done = _run(tmp_path, ON_A_GPU_MACHINE, device, watch=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.splitlines()[-1]) == [device == "cuda"] * 2  # the lab made no context
    opened = lab.open(tmp_path / "run.sqlite")
    step = opened.stats().step
    opened.close()
    assert step.steps == 20 and step.device == ("cuda" if device == "cuda" else "")
    if device == "cuda":
        assert step.device_mean_ms > 0 and 0 < step.device_util <= 1
    else:
        assert math.isnan(step.device_mean_ms) and math.isnan(step.device_util)


LOADER_FAILS = '''
    import spdl_lab as lab
    import torch
    from torch.utils.data import DataLoader

    ds = [torch.zeros(2)] * 8
    session = lab.run(DataLoader(ds, batch_size=2), step=lambda b: None, steps=3)
    session.wait(30)
    for batch in DataLoader(ds, batch_size=2):  # published under watch, named after this line
        pass
    for i, batch in enumerate(lab.publish(DataLoader(ds, batch_size=2), name="dies")):
        if i == 2:
            raise RuntimeError("the step failed")
'''


@pytest.mark.timeout(120)
def test_an_uncaught_exception_marks_the_run_failed_and_spdl_labs_own_iterations_are_not_published(
        tmp_path):
    done = _run(tmp_path, LOADER_FAILS, watch=True)
    assert done.returncode == 1 and "the step failed" in done.stderr
    records = sorted((tmp_path).glob("run*.sqlite"))
    metas = {record_meta(r)["name"]: record_meta(r) for r in records}
    # the lab.run session and the plain DataLoader (published by spdl-lab watch) and the
    # lab.publish call; the DataLoader that lab.run iterates inside spdl_lab is not a fourth
    assert sorted(metas) == ["dies", "train-7", "train-9"], metas
    assert metas["dies"]["state"] == "failed" and metas["train-7"]["state"] == "finished"
    # a DataLoader's run lasts as long as the script: the script failed, so did the run
    assert metas["train-9"]["runner"] == "DataLoader" and metas["train-9"]["state"] == "failed"


SPDL_SCRIPT = '''
    from spdl.pipeline import PipelineBuilder

    pipeline = (PipelineBuilder().add_source(range(40)).pipe(lambda x: x * 2, concurrency=2)
                .aggregate(4).add_sink(3).build(num_threads=2))
    with pipeline.auto_stop():
        total = sum(len(batch) for batch in pipeline)
    print(total, flush=True)
'''


@pytest.mark.timeout(120)
def test_a_built_spdl_pipeline_is_published_under_watch(tmp_path):
    pytest.importorskip("spdl.pipeline")
    done = _run(tmp_path, SPDL_SCRIPT, watch=True)
    assert done.returncode == 0 and done.stdout.strip() == "40", done.stderr
    meta = record_meta(tmp_path / "run.sqlite")
    assert meta["runner"] == "spdl" and meta["state"] == "finished"
    assert _series(read_record(tmp_path / "run.sqlite"), "steps", "step").max() == 10


@pytest.mark.timeout(90)
def test_sigterm_to_spdl_lab_watch_reaches_the_script(tmp_path, wait_until):
    (tmp_path / "train.py").write_text("import time\nprint('up', flush=True)\ntime.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-m", "spdl_lab", "watch", "--", sys.executable, "train.py"],
                            cwd=tmp_path, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "SPDL_LAB_RUNTIME_DIR": str(tmp_path / "rt")})
    try:
        assert proc.stdout.readline().strip() == "up"
        script = [c for c in psutil.Process(proc.pid).children() if "train.py" in " ".join(c.cmdline())]
        assert len(script) == 1
        proc.terminate()
        assert proc.wait(20) == 128 + 15  # the script's end, as the shell would say it
        wait_until(lambda: not script[0].is_running() or script[0].status() == psutil.STATUS_ZOMBIE, 5)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        proc.stdout.close()


def test_a_stalled_viewer_skips_ahead_and_the_ticks_it_missed_are_counted(runtime, no_thread_leak):
    from spdl_lab._telemetry.sampler import Sampler
    from spdl_lab._watch.publish import Timeline

    timeline, ticks = Timeline(capacity=4), iter(range(100))
    sampler = Sampler([lambda dt: [("x", "s", float(next(ticks)))]], hz=1000)
    for _ in range(10):
        sampler.tick()
    timeline.pull(sampler)
    chunk = timeline.frames_since(0)  # a viewer that has seen nothing: 10 ticks, 4 kept
    assert len(chunk) == 4 and chunk.cursor == 10 and timeline.skipped_by_viewers == 6
    assert list(chunk.columns[("x", "s")]) == [6.0, 7.0, 8.0, 9.0]  # the newest, in order
    batches = [1, 2, 3]
    loop = lab.publish(batches, name="dropped")
    assert list(loop) == [1, 2, 3]
    stats = published_by(batches).stats()
    assert stats["dropped_ticks"] == {"record": 0, "viewers": 0} and stats["step"]["steps"] == 3
    lab.unpublish(loop)
    assert published_by(batches) is None


def _publishers():
    from spdl_lab._watch.publish import _PUBLISHED

    return list(_PUBLISHED.values())


def test_an_spdl_pipeline_builder_is_published_as_a_monitor_with_its_stages(runtime, no_thread_leak,
                                                                           wait_until):
    spdl = pytest.importorskip("spdl.pipeline")
    builder = spdl.PipelineBuilder().add_source(range(40)).pipe(lambda x: x * 2, concurrency=2)
    monitor = lab.publish(builder.aggregate(4).add_sink(3), name="spdl-builder")
    assert monitor.runner == "spdl"
    with monitor:
        assert sum(len(b) for b in monitor) == 40
    stats = next(p for p in _publishers() if p.name == "spdl-builder").stats()
    assert stats["step"]["steps"] == 10 and len(stats["stages"]) >= 2
    lab.unpublish(monitor)
    assert record_meta(runtime / "run.sqlite")["runner"] == "spdl"


@pytest.mark.timeout(120)
def test_spdl_lab_watch_1_alone_publishes_through_the_pth_hook(tmp_path):
    """torchrun's way: no spdl-lab watch, only SPDL_LAB_WATCH=1 (and RANK) in the environment."""
    import sysconfig
    from pathlib import Path

    if not (Path(sysconfig.get_path("purelib")) / "spdl_lab_watch.pth").exists():
        pytest.skip("spdl_lab_watch.pth is not in site-packages (make venv or a wheel install puts it there)")
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(NO_SPDL_LAB))
    env = {**os.environ, "SPDL_LAB_WATCH": "1", "RANK": "1", "SPDL_LAB_RUNTIME_DIR": str(tmp_path / "rt"),
           "SPDL_LAB_RECORD": str(tmp_path / "run.sqlite")}
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=100)
    assert done.returncode == 0, done.stderr
    meta = record_meta(tmp_path / "run.sqlite")
    assert meta["runner"] == "DataLoader" and meta["name"] == "train-16-rank1" and meta["state"] == "finished"


def test_a_run_outside_a_job_records_to_its_name_and_pid(monkeypatch):
    for var in ("SPDL_LAB_RECORD", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    name, path, facts = record_of("train.py:42 DataLoader/../x", 1234)
    assert path.parent.name == "spdl_lab_runs" and facts == {}
    assert path.name == "train.py_42_DataLoader_.._x-1234.sqlite"
    assert record_of("", 7)[1].name == "run-7.sqlite"
    monkeypatch.setenv("SPDL_LAB_RECORD", "/tmp/mine.sqlite")
    assert str(record_of("x", 1)[1]) == "/tmp/mine.sqlite"


def test_a_ranks_second_run_keeps_the_jobs_name_and_folder(monkeypatch):
    """Lightning's validation loop, then its training loop: NAME-rankR and NAME-rankR-2, both
    of the job NAME, beside each other in its folder."""
    monkeypatch.delenv("SPDL_LAB_RECORD", raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "abcdef123456")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    first, second = record_of("train-rank1", 9), record_of("train-rank1-2", 9)
    assert (first[0], second[0]) == ("train-rank1", "train-rank1-2")
    assert first[1] == Path("spdl_lab_runs/train-abcdef12/rank1.sqlite")
    assert second[1] == first[1].with_name("rank1-2.sqlite")
    assert first[2] == second[2] and second[2]["job_name"] == "train" and second[2]["rank"] == 1
    assert record_of("train", 9)[:2] == first[:2]  # lab.publish(obj, name="train") in a rank


def test_a_loop_a_library_runs_is_named_by_the_scripts_line(tmp_path, monkeypatch):
    """Lightning iterates the DataLoader in its own code: the run is named by the script's
    ``trainer.fit`` line, not Lightning's; with every frame in a library, by the innermost."""
    import inspect

    from spdl_lab._watch import publish as publishing

    lib = tmp_path / "site-packages"
    lib.mkdir()
    (lib / "fitting_lib.py").write_text("from spdl_lab._watch.publish import caller_line\n\n"
                                        "def fit():\n    return caller_line()\n")
    monkeypatch.syspath_prepend(str(lib))
    import fitting_lib

    monkeypatch.setattr(publishing, "_LIBRARIES", ("<frozen ", str(lib)))
    assert fitting_lib.fit() == f"test_publish_loops-{inspect.currentframe().f_lineno}"
    monkeypatch.setattr(publishing, "_LIBRARIES", ("<", "/"))  # the script is an installed package too
    assert fitting_lib.fit() == "fitting_lib-4"


@pytest.mark.measurement
@pytest.mark.timeout(60)
@pytest.mark.parametrize("after", [5, 2])
def test_a_loop_run_while_another_holds_its_last_batch_is_not_in_that_batchs_step(tmp_path, monkeypatch,
                                                                                  no_thread_leak, after):
    """Lightning never asks a sized loader past its length: it runs validation while the training
    loop holds its last batch, and training's next epoch while validation holds its own. Each
    loop's step ends as the other starts an epoch. Before, training's last step of each epoch
    held all of validation (0.03 + 3 x 0.03 s here) and validation's the next training epoch
    (5 x 0.02 s). Validation inside the epoch (``val_check_interval``, ``after`` 2 batches) ends
    as training goes on; before, its last step held the rest of the training epoch, and the next."""
    import time

    monkeypatch.setenv("SPDL_LAB_RUNTIME_DIR", str(tmp_path / "rt"))
    train_items, val_items = list(range(5)), list(range(3))
    train = lab.publish(train_items, name="train")
    val = lab.publish(val_items, name="val")
    for _ in range(3):
        batches = iter(train)  # kept, as Lightning keeps its iterators: neither is let go of
        for i in range(5):
            next(batches)
            time.sleep(0.02)
            if i + 1 == after:
                held = iter(val)
                for _ in range(3):
                    next(held)
                    time.sleep(0.03)
    batches = held = None
    clocks = {name: published_by(items).source.clock for name, items in (("train", train_items), ("val", val_items))}
    lab.unpublish(train)
    lab.unpublish(val)
    steps = {name: [r.step_s for r in clock.records_since(0)] for name, clock in clocks.items()}
    assert [len(s) for s in steps.values()] == [15, 9]
    assert max(steps["train"]) < 0.06, steps["train"]
    assert max(steps["val"]) < 0.06, steps["val"]
