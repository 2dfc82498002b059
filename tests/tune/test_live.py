"""session.autotune() and the dashboard's "auto" toggle on a real running session."""

from __future__ import annotations

import time

import pytest

import spdl_lab as lab
from spdl_lab.errors import PipelineSpecError

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("no_thread_leak", "no_child_leak")]


def sleepy(i):
    time.sleep(0.01)  # waits without the GIL: the answer is more threads
    return i


def step(batch):
    time.sleep(0.004)


def pipeline():
    return lab.Pipeline(range(10**7)).map(sleepy, concurrency=1, name="read").batch(4)


def _autotuned(check) -> None:
    """Autotune a running session for 8 s, then ``check(session, tuner, heard)``."""
    session = lab.run(pipeline(), step, duration=120)
    try:
        heard = []
        tuner = session.autotune(budget_s=8, on_log=heard.append)
        assert tuner.wait(60)
        assert tuner.error is None, tuner.log
        check(session, tuner, heard)
    finally:
        session.stop()


def test_autotune_moves_the_running_sessions_knob_and_leaves_it_at_the_best():
    def check(session, tuner, heard):
        assert session.controls()["read"] > 1, tuner.log
        assert session.controls() == tuner.best
        assert heard == tuner.log and tuner.log[-1].startswith(("converged", "budget spent"))
        moves = tuner.trials
        assert moves["kept"].iloc[0] and len(moves) >= 2
        assert moves["predicted_batches_per_s"].iloc[1:].notna().all()
        assert moves["gil_wait_frac"].between(0, 1).all()  # the session's GIL probe is read

    _autotuned(check)


@pytest.mark.measurement
def test_autotune_more_than_doubles_the_rate():
    def check(session, tuner, heard):
        moves = tuner.trials
        assert moves["batches_per_s"].max() > 2 * moves["batches_per_s"].iloc[0]  # 1 thread: ~25 batches/s

    _autotuned(check)


def test_moving_a_knob_yourself_takes_over():
    session = lab.run(pipeline(), step, duration=120)
    try:
        tuner = session.autotune(budget_s=30)
        deadline = time.monotonic() + 30
        while not tuner.steps and time.monotonic() < deadline:
            time.sleep(0.05)
        session.set_concurrency("read", 3)
        assert tuner.wait(15)
        assert any("you took over" in line for line in tuner.log), tuner.log
        time.sleep(0.3)
        assert session.controls()["read"] == 3  # the user's setting stays
    finally:
        session.stop()


def test_autotune_refuses_what_it_cannot_tune():
    session = lab.run(range(10**6), step, duration=30)
    try:
        with pytest.raises(PipelineSpecError, match="lab.Pipeline"):
            session.autotune(budget_s=5)
    finally:
        session.stop()
    session = lab.run(pipeline(), step, duration=30)
    try:
        for bad in (0, -1, float("nan"), "60"):
            with pytest.raises(PipelineSpecError, match="budget_s"):
                session.autotune(budget_s=bad)
    finally:
        session.stop()


def test_the_dashboard_toggle_runs_it_the_sliders_follow_and_it_switches_off_by_itself(wait_until):
    session = lab.run(pipeline(), step, duration=120)
    dash = session.dashboard()
    try:
        dash.auto_budget_s = 8
        dash.auto.value = True
        assert dash.autotuner is not None
        assert wait_until(lambda: dash.sliders["read"].value > 1, 40), dash.autotuner.log
        assert wait_until(lambda: not dash.auto.value, 60), dash.autotuner.log
        assert "raised read 1 -&gt;" in dash.auto_log.value or "raised read 1 ->" in dash.auto_log.value
        assert dash.sliders["read"].value == session.controls()["read"]
        # Moving a slider while it runs hands control back (from one reader, so it has work to do).
        dash.sliders["read"].value = 1
        assert wait_until(lambda: session.controls()["read"] == 1, 10)
        dash.auto_budget_s = 60
        dash.auto.value = True
        assert wait_until(lambda: len(dash.autotuner.log) >= 2, 30)
        dash.sliders["read"].value = 2
        assert wait_until(lambda: not dash.auto.value, 20)
        assert any("you took over" in line for line in dash.autotuner.log)
    finally:
        dash.close()
        session.stop()
