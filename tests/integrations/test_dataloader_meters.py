"""A torch DataLoader's inside, metered with no change to it: its Dataset and collate_fn as the
stages ``fetch`` and ``collate`` (in shared memory, a slot per worker), the batches prefetched
or in flight as its queue, its workers' CPU in the total; under fork, spawn and forkserver,
with and without persistent workers, published or run by ``lab.run``."""

from __future__ import annotations

import functools
import gc
import os
import re
import sys
from multiprocessing import forkserver
from pathlib import Path

import pandas as pd
import pytest
import torch
from torch.utils.data import DataLoader

import spdl_lab as lab
from spdl_lab._integrations.torch_dataloader import PER_WORKER, QUEUE
from spdl_lab._watch.publish import published_by

sys.path.insert(0, str(Path(__file__).parent))
import dataloader_jobs as jobs  # noqa: E402

pytestmark = pytest.mark.usefixtures("no_thread_leak", "no_child_leak")

BATCH = 4
BATCHES = jobs.ITEMS // BATCH
CONTEXTS = ["fork", "spawn", "forkserver"]


@pytest.fixture(scope="module", autouse=True)
def forkserver_running():
    """multiprocessing's fork server starts on first use and lives as long as this process, as its
    resource tracker does: a singleton of the standard library, not a child a test leaves."""
    forkserver.ensure_running()


@pytest.fixture
def runtime(tmp_path, monkeypatch):
    monkeypatch.setenv("SPDL_LAB_RUNTIME_DIR", str(tmp_path / "rt"))
    monkeypatch.setenv("SPDL_LAB_RECORD", str(tmp_path / "run.sqlite"))
    return tmp_path


def dataloader(dataset, context: str, persistent: bool, init=None, workers: int = 2) -> DataLoader:
    return DataLoader(dataset, batch_size=BATCH, num_workers=workers, persistent_workers=persistent,
                      multiprocessing_context=context if workers else None, worker_init_fn=init)


def series(frames: pd.DataFrame, name: str, stage: str) -> pd.Series:
    return frames[(frames.series == name) & (frames.stage == stage)].value


def workers_read(frames: pd.DataFrame) -> bool:
    """Both workers' stage rows, the queue, and the children's CPU have been sampled."""
    return (len(series(frames, PER_WORKER["qps"], "fetch/worker1")) > 0
            and len(series(frames, "queue_capacity", QUEUE)) > 0
            and len(series(frames, "cpu_percent", "children")) > 0)


def check_frames(frames: pd.DataFrame, epochs: int) -> None:
    # Counted exactly: every item the workers fetched, every batch they collated.
    assert series(frames, "tasks", "fetch").max() == epochs * BATCHES * BATCH
    assert series(frames, "tasks", "collate").max() == epochs * BATCHES
    assert series(frames, "failures", "fetch").max() == 0
    assert series(frames, "concurrency", "fetch").max() == 2
    for w in (0, 1):  # each worker's part, apart from the stages: what reads stages sees only them
        for name in ("qps", "busy_frac"):
            assert len(series(frames, PER_WORKER[name], f"fetch/worker{w}")) > 0, (name, w)
    assert set(frames[frames.series == "qps"].stage) == {"fetch", "collate"}
    depth, capacity = series(frames, "queue_depth", QUEUE), series(frames, "queue_capacity", QUEUE)
    assert capacity.max() == 2 * 2  # prefetch_factor x num_workers
    assert 0 <= depth.min() and depth.max() <= capacity.max()
    # The workers' CPU is in the total: total = main + children, tick by tick.
    cpu = frames[frames.series == "cpu_percent"].pivot_table(index="time_s", columns="stage", values="value")
    both = cpu.dropna(subset=["main", "children", "total"])
    assert len(both) > 0
    ceiling = 100.0 * os.cpu_count()
    expected = (both["main"] + both["children"]).clip(upper=ceiling)
    assert both["total"].to_numpy() == pytest.approx(expected.to_numpy())


def wait_for_workers(sampler, wait_until) -> None:
    assert wait_until(lambda: workers_read(sampler.frames()), 30), sampler.frames().stage.unique()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("persistent", [False, True], ids=["fresh", "persistent"])
@pytest.mark.parametrize("context", CONTEXTS)
def test_a_published_dataloader_meters_its_workers(context, persistent, runtime, wait_until):
    init = functools.partial(jobs.mark_started, str(runtime))
    dl = dataloader(jobs.Squares(), context, persistent, init)
    expected = [b for _ in range(2) for b in dataloader(jobs.Squares(), "fork", persistent=False)]
    loop = lab.publish(dl, name="metered")
    publisher = published_by(dl)
    got = []
    for _ in range(2):
        for batch in loop:
            if not got:
                wait_for_workers(publisher.source.sampler(), wait_until)
            got.append(batch)
    assert dl.worker_init_fn is init and len(loop) == BATCHES  # the DataLoader as it was
    assert len(got) == len(expected) and all(torch.equal(a, b) for a, b in zip(got, expected))
    stages = {row["name"]: row for row in publisher.stats()["stages"]}
    lab.unpublish(dl)
    frames = publisher.source.sampler().frames()
    check_frames(frames, epochs=2)
    assert stages["fetch"]["tasks"] >= BATCH
    starts = list(runtime.glob("worker*-*"))
    assert {p.name.split("-")[0] for p in starts} == {"worker0", "worker1"}
    assert len(starts) == (2 if persistent else 4)  # the user's worker_init_fn ran in every worker
    del loop, publisher, dl  # a persistent DataLoader's workers go with it
    gc.collect()


@pytest.mark.timeout(60)
def test_dropping_a_published_persistent_dataloader_stops_its_workers_at_once_as_without_the_lab(runtime):
    """torch stops persistent workers when the DataLoader's last reference goes. Had the lab put it
    in a reference cycle, a garbage collection would take it instead: multiprocessing's queue
    finalizers run first, the workers never get their stop, and torch waits 5 s for each."""
    dl = dataloader(jobs.Squares(), "fork", persistent=True)
    loop = lab.publish(dl, name="dropped")
    publisher = published_by(dl)
    for _ in range(2):
        for _ in loop:
            pass
    lab.unpublish(dl)
    workers = list(dl._iterator._workers)
    assert all(w.is_alive() for w in workers)
    gc.disable()
    try:
        del loop, publisher, dl
        alive = [w.pid for w in workers if w.is_alive()]
    finally:
        gc.enable()
    assert not alive, "the workers outlived the DataLoader: it is held in a reference cycle"


@pytest.mark.timeout(180)
@pytest.mark.parametrize("persistent", [False, True], ids=["fresh", "persistent"])
@pytest.mark.parametrize("context", CONTEXTS)
def test_lab_run_meters_a_dataloaders_workers(context, persistent, tmp_path, wait_until):
    init = functools.partial(jobs.mark_started, str(tmp_path))
    dl = dataloader(jobs.Batched(), context, persistent, init)
    sampled, box = [], {}

    def step(batch):
        if not sampled:
            assert wait_until(lambda: "session" in box, 10)
            wait_for_workers(box["session"].sampler, wait_until)
        sampled.append(batch)

    session = box["session"] = lab.run(dl, step=step, sample_hz=20)
    assert session.wait(timeout=120)
    assert len(sampled) == BATCHES and dl.worker_init_fn is init
    check_frames(session.frames(), epochs=1)
    stats = session.stats()
    assert stats.stages["fetch"].tasks == jobs.ITEMS and stats.stages["collate"].tasks == BATCHES
    assert stats.stages["fetch"].concurrency == 2 and stats.step.steps == BATCHES
    assert len(session.summary().loc[["fetch", "collate", "step"]]) == 3
    assert len(list(tmp_path.glob("worker*-*"))) == 2
    box.clear()
    del session, dl
    gc.collect()


def raised(run, kind: type[BaseException]) -> tuple[type, str, str]:
    """What ``run()`` raised: its type, the first line of its message and the last (the worker's
    own error). The traceback is dropped: it holds the iterator, and so its workers, which torch
    stops at once when the iterator goes, but only after seconds when the garbage collector takes it."""
    try:
        run()
    except kind as error:
        lines = str(error).strip().splitlines()
        error.__traceback__ = None
        return type(error), lines[0], lines[-1]
    raise AssertionError(f"no {kind.__name__} raised")


def drain(iterable) -> None:
    for _ in iterable:
        pass


@pytest.mark.timeout(120)
@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_a_dataset_that_raises_raises_the_same_through_the_lab(context, runtime):
    plain = raised(lambda: drain(dataloader(jobs.Faulty(), context, persistent=False)), ValueError)
    assert plain[2] == "ValueError: item 13 cannot be read"
    dl = dataloader(jobs.Faulty(), context, persistent=False)
    assert raised(lambda: drain(lab.publish(dl, name="faulty")), ValueError) == plain
    publisher = published_by(dl)
    lab.unpublish(dl)
    assert series(publisher.source.sampler().frames(), "failures", "fetch").max() == 1
    session = lab.run(dataloader(jobs.Faulty(), context, persistent=False), step=lambda b: None)
    assert raised(lambda: session.wait(timeout=60), ValueError) == plain


#: torch's words for a worker that died: from its SIGCHLD handler ("is killed by signal: Killed.")
#: or, when a get times out first, from the iterator ("exited unexpectedly"); which comes first is timing.
WORKER_DIED = re.compile(r"DataLoader worker \(pid(?:\(s\))? [\d, ]+\) (exited unexpectedly|is killed by signal)")


@pytest.mark.timeout(120)
def test_a_killed_worker_leaves_no_shared_memory(runtime):
    session = lab.run(dataloader(jobs.Killed(), "fork", persistent=True), step=lambda b: None)
    kind, first, _ = raised(functools.partial(session.wait, timeout=60), RuntimeError)
    assert WORKER_DIED.search(first), first
    dl = dataloader(jobs.Killed(), "fork", persistent=False)
    kind, first, _ = raised(functools.partial(drain, lab.publish(dl, name="killed")), RuntimeError)
    assert WORKER_DIED.search(first), first
    lab.unpublish(dl)
    del session, dl  # a persistent DataLoader's workers go with it; no_child_leak checks the rest


@pytest.mark.timeout(60)
def test_without_workers_there_is_nothing_to_meter_and_nothing_in_shared_memory(runtime):
    dl = dataloader(jobs.Squares(), "fork", persistent=False, workers=0)
    before = set(os.listdir("/dev/shm"))
    session = lab.run(dl, step=lambda b: None)
    assert session.wait(timeout=30)
    frames = session.frames()
    assert series(frames, "num_workers", "dataloader").max() == 0
    assert not {"fetch", "collate"} & set(frames.stage) and not session.stats().stages
    made = set(os.listdir("/dev/shm")) - before
    assert not [n for n in made if n.startswith(f"spdl_lab_{os.getpid()}_")]  # no block was made
