"""runner="ray": the Pipeline on Ray Data on a local Ray instance that the runner starts and stops.

Starting a local instance costs 10-30 s on this machine (GCS, raylet, then worker
processes that import Ray), so the tests share one (``ray_instance`` in conftest.py:
it opens one as a lab runner would, every Loader joins it, and its teardown checks
that closing the last user leaves no Ray process and no temporary directory behind).
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

import spdl_lab as lab
from spdl_lab.errors import PipelineError, PipelineSpecError

ray = pytest.importorskip("ray")
from spdl_lab._runners._ray_cluster import ray_processes  # noqa: E402

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("ray_instance")]


def decode(i):
    return np.full((4, 4), i, dtype=np.float32)


def stack(items):
    return np.stack(items)


def pipeline(n=64):
    return lab.Pipeline(range(n)).map(decode, concurrency=2, name="decode").batch(8).map(stack, name="collate")


def test_batches_come_in_order_with_meters_from_the_workers():
    with lab.Loader(pipeline(), runner="ray") as loader:
        batches = list(loader)
        stats = loader.stats()
    assert len(batches) == 8
    assert [int(b[0, 0, 0]) for b in batches] == list(range(0, 64, 8))  # the pipeline asked for order
    assert all(b.shape == (8, 4, 4) for b in batches)
    assert stats.stages["decode"].tasks == 64 and stats.stages["collate"].tasks == 8
    assert stats.stages["batch"].tasks == 8 and stats.source.tasks == 64
    assert stats.stages["decode"].concurrency == 2 and stats.stages["decode"].p50_ms >= 0
    assert ray.is_initialized()  # the fixture still holds the instance: closing a Loader left it


def test_a_stage_that_raises_ends_the_run_naming_stage_and_item():
    def bad(i):
        if i == 13:
            raise ValueError("corrupt record")
        return i

    p = lab.Pipeline(range(40)).map(bad, name="parse").batch(4)
    with lab.Loader(p, runner="ray") as loader:
        with pytest.raises(PipelineError, match=r"(?s)parse.*13.*corrupt record") as info:
            list(loader)
    assert info.value.stage == "parse" and info.value.index == 13


def test_max_failures_drops_and_counts():
    def flaky(i):
        if i % 10 == 3:
            raise KeyError(i)
        return i

    p = lab.Pipeline(range(40)).map(flaky, name="parse").batch(4)
    with lab.Loader(p, runner="ray", max_failures=10) as loader:
        items = [x for batch in loader for x in batch]
        time.sleep(0.3)
        failures = loader.stats().stages["parse"].failures
    assert sorted(items) == [i for i in range(40) if i % 10 != 3]
    assert failures == 4


def test_set_concurrency_restarts_from_the_first_item_not_delivered():
    with lab.Loader(pipeline(400), runner="ray") as loader:
        it = iter(loader)
        first = [next(it) for _ in range(5)]
        loader.set_concurrency("decode", 1)
        rest = list(it)
        assert loader.stats().stages["decode"].concurrency == 1
    starts = [int(b[0, 0, 0]) for b in first + rest]
    assert starts == list(range(0, 400, 8))  # nothing lost, nothing twice


def test_bad_options_are_refused_before_ray_starts():
    with pytest.raises(PipelineSpecError, match="address"):
        lab.Loader(pipeline(), runner="ray", address=42)
    with pytest.raises(PipelineSpecError, match="resources"):
        lab.Loader(pipeline(), runner="ray", resources={"nope": {"num_cpus": 1}})
    with pytest.raises(PipelineSpecError, match="ray_init_kwargs must be a dict"):
        lab.Loader(pipeline(), runner="ray", ray_init_kwargs="num_cpus=2")


def test_a_source_without_random_access_is_read_into_a_list_up_to_a_limit(monkeypatch):
    from spdl_lab._runners import ray_runner

    with lab.Loader(lab.Pipeline(iter(range(20))).map(str, name="fmt").batch(8), runner="ray") as loader:
        assert [len(b) for b in loader] == [8, 8, 4]
    monkeypatch.setattr(ray_runner, "MAX_MATERIALIZED", 5)
    with lab.Loader(lab.Pipeline(lambda: (i for i in range(10))).map(str, name="fmt"), runner="ray") as loader:
        with pytest.raises(PipelineSpecError, match=r"more than 5 items without random access.*Pass a sequence"):
            list(loader)


def test_the_local_instance_listens_on_loopback_only():
    import ipaddress

    import psutil

    with lab.Loader(pipeline(), runner="ray") as loader:
        assert len(list(loader)) == 8  # the workers are up, with their servers
        procs = [psutil.Process(), *ray_processes()]
        listening = []
        for proc in procs:
            try:
                conns = proc.net_connections(kind="inet")
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            listening += [(proc.name(), c.laddr.ip) for c in conns if c.status == psutil.CONN_LISTEN]
    assert listening, "GCS, raylet and workers listen somewhere"

    def loopback(ip: str) -> bool:
        address = ipaddress.ip_address(ip.split("%")[0])
        mapped = getattr(address, "ipv4_mapped", None)
        return (mapped or address).is_loopback

    assert all(loopback(ip) for _, ip in listening), [x for x in listening if not loopback(x[1])]


def nap(i):
    time.sleep(0.005)
    return i


def kill_a_task_worker() -> float:
    """SIGKILL a busy Ray worker mid-run; the seconds the rest of the run took."""
    import signal

    with lab.Loader(lab.Pipeline(range(2000)).map(nap, concurrency=2, name="nap").batch(8), runner="ray") as loader:
        it = iter(loader)
        items = list(next(it))
        deadline = time.monotonic() + 10
        while not (busy := [p for p in ray_processes() if "MapBatches(_Stages)" in " ".join(p.cmdline())]):
            # Between two tasks a worker is titled ray::IDLE: look again.
            assert time.monotonic() < deadline, [" ".join(p.cmdline()) for p in ray_processes()]
            time.sleep(0.005)
        os.kill(busy[0].pid, signal.SIGKILL)
        t0 = time.monotonic()
        for batch in it:
            items += list(batch)
        took = time.monotonic() - t0
    assert items == list(range(2000))  # Ray made the killed worker's items again; delivered once, in order
    return took


# One run checks both (the scenario costs ~25 s): Ray makes the killed worker's items again,
# each delivered once and in order, and the rest of the run takes less than a minute.
@pytest.mark.measurement
def test_a_killed_task_worker_is_retried_by_ray_nothing_is_lost_or_repeated_within_a_minute():
    assert kill_a_task_worker() < 60



def quick(i):
    time.sleep(0.002)
    return i


def test_the_first_batch_comes_while_most_of_a_large_source_is_still_unread():
    # 20,000 items of 2 ms at concurrency 2: about 20 s of work. Blocks hold a few batches, so
    # the first batch is out after a few blocks (before: Ray Data cut the source into a handful
    # of blocks and the first batch came once nearly everything was made).
    p = lab.Pipeline(range(20_000)).map(quick, concurrency=2, name="nap").batch(8)
    with lab.Loader(p, runner="ray") as loader:
        assert next(iter(loader)) == list(range(8))
        read = loader.stats().source.tasks
    assert read < 10_000, read


def test_stages_with_one_setting_run_as_one_ray_operation_with_the_source_and_batch():
    from spdl_lab._runners._ray_plan import chunk_size, groups

    class Tokenizer:
        def __call__(self, x):
            return x

    p = (lab.Pipeline(range(10)).map(decode, concurrency=2, name="decode").map(str, concurrency=2, name="fmt")
         .batch(4).map(stack, name="collate").map(Tokenizer(), name="tok").batch(2))
    cut = groups(p, {"decode": 2, "fmt": 2, "collate": 1, "tok": 1}, {})
    assert [[s.name for s in g.stages] for g in cut] == [["decode", "fmt", "batch"], ["collate"], ["tok", "batch_2"]]
    assert [(g.actors, g.concurrency) for g in cut] == [(False, 2), (False, 1), (True, 1)]
    assert chunk_size(p) == 8  # blocks hold whole batches of both batch stages
    # Per-stage resources part stages that would otherwise share an operation.
    cut = groups(p, {"decode": 2, "fmt": 2, "collate": 1, "tok": 1}, {"fmt": {"num_cpus": 2}})
    assert [[s.name for s in g.stages] for g in cut][:2] == [["decode"], ["fmt", "batch"]]


def test_frames_show_the_blocks_waiting_after_each_ray_data_operation():
    p = lab.Pipeline(range(4000)).map(quick, concurrency=2, name="decode").batch(8).map(stack, name="collate")
    with lab.Loader(p, runner="ray") as loader:
        it = iter(loader)
        next(it)
        reading = loader._state.run.runner.read()
        names = [q.name for q in reading.queues]
        for _ in range(20):
            next(it)
        frame = loader.frames()
    assert names == ["batch→collate", "collate→pump", "ray→output"]
    assert all(q.depth >= 0 and q.capacity >= 0 for q in reading.queues)
    depths = frame[frame.series == "queue_depth"]
    assert {"batch→collate", "collate→pump"} <= set(depths.stage) and (depths.value >= 0).all()


def test_arrays_of_one_shape_travel_as_one_tensor_column():
    from spdl_lab._runners._ray_plan import _column

    a, b = np.zeros((2, 3), np.float32), np.ones((2, 3), np.float32)
    assert _column([a, b]).shape == (2, 2, 3)  # one copy into one array, not a list for Ray to convert
    batches = _column([[a, b, a], [b, a, b]])
    assert batches.shape == (2, 3, 2, 3) and (batches[1, 0] == 1).all()
    ragged = _column([a, np.zeros((4, 3), np.float32)])
    assert isinstance(ragged, list)  # Ray converts what is not one shape and dtype
    assert isinstance(_column([[a], [a, b]]), list) and isinstance(_column(["x", "y"]), list)


def test_batches_come_back_whole_from_a_block_ray_joined_of_two_widths():
    """A task yields its batches as it makes them, a chunk at a time, each chunk's indices padded
    to its widest batch; Ray may join two chunks of other widths into one block, whose index column
    is then ragged (an object column of arrays). Each batch still comes back as its Python list."""
    from ray.data._internal.delegating_block_builder import DelegatingBlockBuilder
    from ray.data.block import BlockAccessor

    from spdl_lab._runners._ray_plan import _block_of, rows_of

    builder = DelegatingBlockBuilder()
    for rows in ([(list(range(32)), [0.0] * 32)], [(list(range(32, 40)), [1.0] * 8), ([40], [2.0])]):
        builder.add_block(BlockAccessor.batch_to_block(_block_of(rows)))
    block = BlockAccessor.for_block(builder.build()).to_batch_format("numpy")
    assert block["idx"].dtype == object  # what Ray makes of it (the case that failed)
    rows = rows_of(block, batches=True)
    assert [i for i, _ in rows] == [list(range(32)), list(range(32, 40)), [40]]
    assert all(type(i) is list and all(type(x) is int for x in i) for i, _ in rows)
    assert [len(v) for _, v in rows] == [32, 8, 1]


def test_a_runner_that_joins_a_parked_instance_resumes_it():
    """A compare parks the instance while it is its one user; a second user joining then must not
    wait on stopped processes (a stand-in child here: the shared instance has two users)."""
    import subprocess
    import sys

    import psutil

    from spdl_lab._runners import _ray_cluster as cluster

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    stand_in = psutil.Process(child.pid)
    try:
        stand_in.suspend()
        cluster._LOCAL["parked"] = [stand_in]
        joined = cluster.RayConnection(None, None)
        joined.open()
        try:
            assert joined.role == "local" and cluster._LOCAL["parked"] == []
            assert stand_in.status() != psutil.STATUS_STOPPED
        finally:
            joined.close()
    finally:
        cluster._LOCAL["parked"] = []
        child.kill()
        child.wait(10)


def test_the_instances_cpu_is_read_apart_from_the_lab_process_trees():
    """compare takes what MachineClock.ray_s reads off another runner's window's own CPU (the ray
    contender's instance idles beside it), leaving it in others_cpu_percent: it reads the CPU
    of the instance's processes, which are this process's descendants, and it grows."""
    from spdl_lab._experiments.compare import MachineClock

    ours = {p.pid for p in ray_processes()}
    assert ours, "the shared instance's processes are this process's descendants"
    clock = MachineClock(None)
    before = clock.ray_s()
    busy_until = time.monotonic() + 0.5
    with lab.Loader(pipeline(32), runner="ray") as loader:  # its workers and meter board at work
        for _ in loader:
            pass
    while time.monotonic() < busy_until:
        time.sleep(0.05)
    assert clock.ray_s() > before


def test_a_pump_that_ended_well_just_as_a_get_timed_out_is_not_reported_lost():
    """The consumer's get timed out; before its liveness check ran the pump finished the queue and
    ended: the run ended well, and the next get reads END, not "pump ended without a result"."""
    from spdl_lab._engine.queues import END, BoundedQueue
    from spdl_lab._runners.ray_runner import RayRunner

    class Alive:
        def lost(self):
            return None

    runner = RayRunner.__new__(RayRunner)  # the state of a run whose pump just ended well
    runner._alive_at, runner._connection, runner._error, runner._closed = 0.0, Alive(), None, False
    runner._lock, runner._stopping = threading.Lock(), False
    runner._output = BoundedQueue("output", 2)
    runner._pump = threading.Thread(target=runner._output.finish)
    runner._pump.start()
    runner._pump.join()
    runner._check()
    assert runner._error is None and runner._output.get(0) is END
