"""The subprocess-threads runner: child process, shared-memory transport, control channel."""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest
import torch

import spdl_lab as lab
from spdl_lab._runners._shm import shm_dir

pytestmark = pytest.mark.usefixtures("no_thread_leak", "no_child_leak")

RUNNER = "subprocess-threads"


def make_arrays(i):
    return {"img": np.full((4, 5), i, dtype=np.float32), "label": i, "t": torch.full((3,), i)}


def test_lambdas_closures_and_nested_outputs_arrive_intact():
    offset = 1000  # captured by the closure below
    p = (
        lab.Pipeline(range(40))
        .map(lambda i: i + offset, concurrency=3, name="shift")
        .map(make_arrays, concurrency=2)
        .batch(8)
        .map(lambda b: (np.stack([x["img"] for x in b]), [x["label"] for x in b],
                        torch.stack([x["t"] for x in b]).to(torch.bfloat16)), name="collate")
    )
    with lab.Loader(p, runner=RUNNER) as loader:
        out = list(loader)
    assert len(out) == 5
    imgs, labels, ts = out[0]
    assert imgs.shape == (8, 4, 5) and imgs.dtype == np.float32 and imgs.flags.writeable
    assert labels == list(range(1000, 1008))
    expected = torch.arange(1000, 1008).repeat_interleave(3).reshape(8, 3).to(torch.bfloat16)
    assert ts.dtype == torch.bfloat16 and torch.equal(ts, expected)
    assert float(out[-1][0][-1, 0, 0]) == 1039


def test_strided_and_odd_arrays():
    def odd(_):
        a = np.arange(60, dtype=np.int16).reshape(6, 10)
        return [a[::2, 1::3], np.array(5.5), np.zeros((0, 3)), np.array(["a", "bc"]),
                np.array([1, None], dtype=object), torch.arange(12).reshape(3, 4).t()]

    with lab.Loader(lab.Pipeline(range(2)).map(odd), runner=RUNNER) as loader:
        got = list(loader)[0]
    expected = odd(0)
    for g, e in zip(got, expected):
        if isinstance(e, torch.Tensor):
            assert torch.equal(g, e)
        else:
            assert g.dtype == e.dtype and g.shape == e.shape and (g == e).all()


def test_stats_come_from_the_child_and_match_the_items():
    p = lab.Pipeline(range(200)).map(lambda x: x * 2, concurrency=2, name="double").batch(10)
    with lab.Loader(p, runner=RUNNER) as loader:
        assert len(list(loader)) == 20
        snap = loader.stats()
        frames = loader.frames()
    assert snap.runner == RUNNER
    assert snap.source.tasks == 200
    assert snap.stages["double"].tasks == 200
    assert snap.stages["batch"].tasks == 20
    assert snap.stages["double"].p50_ms >= 0
    tasks = frames[(frames.series == "tasks") & (frames.stage == "double")]
    assert tasks.value.max() == 200


def test_set_concurrency_goes_through_the_control_channel(wait_until):
    def nap(x):
        time.sleep(0.01)
        return x

    p = lab.Pipeline(range(400)).map(nap, concurrency=1, name="nap")
    with lab.Loader(p, runner=RUNNER) as loader:
        out = []
        for i, x in enumerate(loader):
            out.append(x)
            if i == 10:
                loader.set_concurrency("nap", 8)
                assert wait_until(lambda: loader.stats().stages["nap"].in_flight > 1, 5)
        assert out == list(range(400))
        assert loader.stats().stages["nap"].concurrency == 8


def test_stage_error_is_a_pipeline_error_with_the_child_traceback():
    def bad(x):
        if x == 13:
            raise KeyError("thirteen")
        return x

    with lab.Loader(lab.Pipeline(range(100)).map(bad, name="lookup"), runner=RUNNER) as loader:
        with pytest.raises(lab.PipelineError) as info:
            list(loader)
    err = info.value
    assert err.stage == "lookup" and err.index == 13 and "item 13" in str(err)
    assert isinstance(err.__cause__, KeyError)
    assert "thirteen" in str(err.__cause__.__cause__)  # the child's traceback text


def test_unpicklable_stage_fails_at_start_naming_it():
    lock = threading.Lock()
    p = lab.Pipeline(range(3)).map(str, name="fine").map(lambda x: (lock, x), name="holds_lock")
    with pytest.raises(lab.PipelineSpecError, match="stage 'holds_lock'.*cannot be pickled"):
        lab.Loader(p, runner=RUNNER)


def kill_the_child() -> float:
    """SIGKILL the child mid-run; the seconds until its RunnerError came."""
    p = lab.Pipeline(range(10**9)).map(lambda x: time.sleep(0.001) or x, name="slow")
    loader = lab.Loader(p, runner=RUNNER)
    it = iter(loader)
    next(it)
    pid = loader._state.run.runner._child.proc.pid
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(lab.RunnerError, match=r"pid \d+\) was killed by signal SIGKILL"):
        for _ in it:
            pass
    took = time.monotonic() - t0
    loader.close()
    return took


# One run checks the error and how soon it came (a timing assert: the measurement set).
@pytest.mark.measurement
def test_sigkill_of_the_child_gives_runner_error_quickly():
    assert kill_the_child() < 5


def test_child_that_cannot_unpickle_the_pipeline_reports_its_traceback():
    class Unloadable:
        def __reduce__(self):
            return (_raise_on_load, ())

        def __call__(self, x):
            return x

    with pytest.raises(lab.RunnerError, match="exited with status 1") as info:
        with lab.Loader(lab.Pipeline(range(3)).map(Unloadable(), name="u"), runner=RUNNER) as loader:
            list(loader)
    assert "cannot be loaded here" in str(info.value.__cause__)


def _raise_on_load():
    raise RuntimeError("cannot be loaded here")


def test_close_mid_iteration_stops_the_child():
    def ours() -> set[str]:  # other spdl_lab runs on the machine have segments too
        return {n for n in os.listdir(shm_dir()) if n.startswith("spdl_lab_")}

    before = ours()
    p = lab.Pipeline(range(10**9)).map(lambda x: np.zeros(1000) + x, concurrency=2)
    with lab.Loader(p, runner=RUNNER) as loader:
        for i, _ in enumerate(loader):
            if i == 50:
                break
        pid = loader._state.run.runner._child.proc.pid
    assert not [n for n in ours() - before if n.startswith((f"spdl_lab_{os.getpid()}_", f"spdl_lab_{pid}_"))]
