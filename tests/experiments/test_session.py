"""lab.run / Session: a background loop with telemetry that stops cleanly."""

from __future__ import annotations

import time

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import spdl_lab as lab

pytestmark = pytest.mark.usefixtures("no_thread_leak", "no_child_leak")


def pipeline(n=10**6):
    return lab.Pipeline(range(n)).map(lambda x: x * 2, concurrency=2, name="double").batch(4)


def test_run_returns_at_once_and_finishes_its_steps():
    calls = []

    def step(batch):
        calls.append(batch)
        time.sleep(0.002)

    session = lab.run(pipeline(), step=step, steps=50)
    assert session.wait(timeout=30)
    assert session.state == "finished" and not session.running
    assert len(calls) == 50 and calls[0] == [0, 2, 4, 6]
    snap = session.stats()
    assert snap.step.steps == 50
    assert snap.stages["double"].tasks >= 200
    summary = session.summary()
    assert "step" in summary.index and "double" in summary.index
    assert summary.loc["step", "tasks"] == 50
    frames = session.frames()
    assert {"steps", "step_ms", "gil_wait_frac", "cpu_percent", "qps"} <= set(frames.series)
    assert "finished" in repr(session) and "steps=50/50" in repr(session)


def test_stop_ends_the_loop(wait_until):
    session = lab.run(pipeline(), step=lambda b: time.sleep(0.01))
    assert wait_until(lambda: session.stats().step.steps > 3, 30)
    session.stop()
    assert session.wait(timeout=5)
    assert session.state == "stopped"


@pytest.mark.measurement
def test_run_returns_at_once_and_stop_is_prompt(wait_until):
    t0 = time.monotonic()
    session = lab.run(pipeline(), step=lambda b: time.sleep(0.01))
    assert time.monotonic() - t0 < 1.0
    assert wait_until(lambda: session.stats().step.steps > 3, 30)
    t0 = time.monotonic()
    session.stop()
    assert time.monotonic() - t0 < 5
    assert session.wait(timeout=5)


def test_stop_returns_after_the_child_and_its_shared_memory_are_gone(wait_until):
    # stop() closes the loader from a helper thread while the loop's own exit
    # closes it too; the second close must wait for the first, or a script that
    # exits right after stop() leaves the child's segments in /dev/shm.
    import os

    from spdl_lab._runners._shm import shm_dir

    session = lab.run(pipeline(), step=lambda b: time.sleep(0.01), runner="subprocess-threads")
    assert wait_until(lambda: session.stats().step.steps > 3, 30)
    session.stop()
    assert not session.running
    left = [n for n in os.listdir(shm_dir()) if n.startswith(f"spdl_lab_{os.getpid()}_")]
    assert left == []


def test_duration_limits_the_run():
    session = lab.run(pipeline(), step=lambda b: None, duration=0.5)
    assert session.wait(timeout=10)
    assert 0.4 < session.elapsed_s


@pytest.mark.measurement
def test_duration_ends_the_run_soon_after():
    session = lab.run(pipeline(), step=lambda b: None, duration=0.5)
    assert session.wait(timeout=10)
    assert session.elapsed_s < 5


def test_step_error_is_raised_by_wait_once():
    def step(batch):
        if batch[0] >= 40:
            raise ValueError("loss is nan")

    session = lab.run(pipeline(), step=step)
    with pytest.raises(ValueError, match="loss is nan"):
        session.wait(timeout=30)
    assert session.state == "failed" and "loss is nan" in repr(session)
    assert session.wait(timeout=1)  # reported once


def test_set_concurrency_through_the_session(wait_until):
    session = lab.run(pipeline(), step=lambda b: time.sleep(0.001))
    try:
        session.set_concurrency("double", 5)
        assert wait_until(lambda: session.stats().stages["double"].concurrency == 5, 5)
    finally:
        session.stop()


class Squares(Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        return torch.tensor([i * i], dtype=torch.float32)


def test_run_over_a_plain_torch_dataloader():
    loader = DataLoader(Squares(), batch_size=8, num_workers=0)
    seen = []
    session = lab.run(loader, step=lambda b: seen.append(b.shape), steps=100)
    assert session.wait(timeout=30)
    assert len(seen) == 8  # the data ran out before 100 steps
    assert session.runner == "DataLoader"
    assert session.stats().step.steps == 8
    assert {"steps", "data_wait_ms"} <= set(session.frames().series)
    with pytest.raises(lab.PipelineSpecError, match="needs a lab.Pipeline"):
        session.set_concurrency("x", 2)


def test_simulated_device_as_the_step():
    device = lab.SimulatedDevice(kernels=20, launch_us=100, kernel_us=200)
    session = lab.run(pipeline(), step=device, steps=10)
    assert session.wait(timeout=30)
    step = session.stats().step
    assert step.steps == 10 and step.device_util > 0


def test_bad_arguments():
    with pytest.raises(lab.PipelineSpecError, match="step must be a callable"):
        lab.run(pipeline(), step=42)
    with pytest.raises(lab.PipelineSpecError, match="steps must be"):
        lab.run(pipeline(), step=print, steps=0)
    for duration in (-1, 0, True, float("nan"), float("inf"), "5"):
        with pytest.raises(lab.PipelineSpecError, match="duration must be a finite number"):
            lab.run(pipeline(), step=print, duration=duration)
    with pytest.raises(lab.PipelineSpecError, match="apply to a lab.Pipeline"):
        lab.run([1, 2], step=print, runner="thread")


def test_set_concurrency_while_the_run_starts_is_never_lost():
    # A dashboard slider can move while the session's loader is still starting
    # its run; the change must land in the spec or in the running runner.
    for _ in range(20):
        session = lab.run(pipeline(), step=lambda b: None, steps=10**6)
        session.set_concurrency("double", 3)
        deadline = time.monotonic() + 10
        while session.loader.stats().running is False and time.monotonic() < deadline:
            time.sleep(0.005)
        assert session.stats().stages["double"].concurrency == 3
        session.stop()


class _Squares(Dataset):
    def __len__(self):
        return 200

    def __getitem__(self, i):
        return torch.tensor([i * i])


def test_a_dataloader_shorter_than_steps_says_it_ran_out():
    dl = DataLoader(_Squares(), batch_size=16)  # 13 batches
    with pytest.warns(RuntimeWarning, match="the loader has 13 batches, fewer than steps=60"):
        session = lab.run(dl, step=lambda b: None, steps=60)
    assert session.wait(timeout=30)
    assert session.state == "exhausted"
    assert session.clock.steps == 13
    assert any("ran out after 13 of steps=60" in w for w in session.warnings)


def test_a_pipeline_that_runs_out_is_exhausted_not_finished():
    session = lab.run(lab.Pipeline(range(5)).batch(1), step=lambda b: None, steps=50)
    with pytest.warns(RuntimeWarning, match="ran out after 5 of steps=50"):
        assert session.wait(timeout=30)
    assert session.state == "exhausted"
    full = lab.run(lab.Pipeline(range(50)).batch(1), step=lambda b: None, steps=5)
    assert full.wait(timeout=30) and full.state == "finished" and full.warnings == []


def test_pause_holds_the_loop_and_resume_goes_on(wait_until):
    session = lab.run(pipeline(), step=lambda b: time.sleep(0.002))
    try:
        wait_until(lambda: session.stats().step.steps > 5, timeout=10)
        assert session.pause(timeout=5)
        assert session.state == "paused" and session.running
        held = session.stats().step.steps
        time.sleep(0.3)  # a span in which a running loop would take ~100 steps
        assert session.stats().step.steps == held
        session.resume()
        assert session.state == "running"
        wait_until(lambda: session.stats().step.steps > held + 5, timeout=10)
        session.pause()
    finally:
        session.stop()  # a paused session stops too
    assert session.wait(timeout=5) and session.state == "stopped"


def test_diagnose_pauses_the_running_sessions_of_this_kernel(wait_until):
    from spdl_lab._experiments.session import sessions_paused

    session = lab.run(pipeline(), step=lambda b: time.sleep(0.002))
    try:
        with sessions_paused() as paused:
            assert paused == 1 and session.state == "paused"
        assert session.state == "running"
        quick = lab.SweepSettings(warmup_s=0.05, window_s=0.05, min_windows=1, max_windows=1)
        diag = lab.diagnose(lab.Pipeline(range(8)).map(abs, name="abs"), (1,), num_items=8,
                            processes=False, settings=quick, progress=False)
        assert diag.settings["paused_sessions"] == 1
        assert "1 running session of this kernel was paused" in diag.machine_load()
        assert session.state == "running"
    finally:
        session.stop()
