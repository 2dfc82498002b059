"""The dashboard without a browser: it reads frames, drives the session, and stops cleanly."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import spdl_lab as lab
from spdl_lab._ui.dashboard import Dashboard
from spdl_lab._ui.live_plots import SOURCE_NAME

pytestmark = pytest.mark.usefixtures("no_thread_leak", "no_child_leak")


def pipeline():
    def work(x):
        time.sleep(0.001)
        return x

    return (lab.Pipeline(range(10**7)).map(work, concurrency=2, name="decode")
            .map(lambda x: x + 1, concurrency=1, name="augment").batch(8))


def step(batch):
    time.sleep(0.005)


def rows(dash):
    return len(dash.plots.source.data["time_s"]) if dash.plots is not None else 0


@pytest.mark.measurement
def test_dashboard_returns_at_once():
    session = lab.run(pipeline(), step, duration=60)
    t0 = time.monotonic()
    dash = session.dashboard()
    try:
        assert time.monotonic() - t0 < 2.0
    finally:
        session.stop()
        dash.close()


def test_dashboard_streams_frames(wait_until):
    session = lab.run(pipeline(), step, duration=60)
    try:
        dash = session.dashboard()
        assert isinstance(dash, Dashboard) and "spdl-lab-dashboard" in dash._dom_classes
        assert wait_until(lambda: rows(dash) > 5, 15)
        source = dash.plots.source
        assert source.name == SOURCE_NAME
        assert {"qps:decode", "queue_depth:decode→augment", "step_ms:step", "cpu_percent:total",
                "gil_wait_frac:gil"} <= set(source.data)
        first = rows(dash)
        assert wait_until(lambda: rows(dash) > first + 5, 15)
        assert np.nanmax(source.data["qps:decode"]) > 0
        assert len({len(column) for column in source.data.values()}) == 1  # one row per tick
        # header, table and verdict are filled from the same frames
        assert wait_until(lambda: "steps/s" in dash.header.value and "decode" in dash.table.value, 10)
        assert "GIL on" in dash.header.value and "runner <b>thread</b>" in dash.header.value
        assert dash.last_verdict is not None and dash.last_verdict.text in dash.verdict.value.replace("&#x27;", "'")
        assert dash.publisher_cpu_s > 0 and dash.publishes >= 2
    finally:
        session.stop()
        dash.close()


def test_slider_sets_concurrency_and_code_changes_move_the_slider(wait_until):
    session = lab.run(pipeline(), step, duration=60)
    dash = session.dashboard()
    try:
        assert set(dash.sliders) == {"decode", "augment"}
        dash.sliders["decode"].value = 4
        assert session.stats().stages["decode"].concurrency == 4
        session.set_concurrency("augment", 3)  # from code: the slider follows
        assert wait_until(lambda: dash.sliders["augment"].value == 3, 10)
        assert session.stats().stages["augment"].concurrency == 3
    finally:
        session.stop()
        dash.close()


def test_slider_callbacks_from_other_threads_race_the_publisher(wait_until):
    # Kernel subshells deliver widget messages on their own threads.
    session = lab.run(pipeline(), step, duration=60)
    dash = session.dashboard(hz=50)
    try:
        def move(values):
            for n in values:
                dash.sliders["decode"].value = n

        threads = [threading.Thread(target=move, args=([1, 5, 2, 6, 3],)) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        dash.sliders["decode"].value = 7
        assert session.stats().stages["decode"].concurrency == 7
        assert wait_until(lambda: dash.sliders["decode"].value == 7 and rows(dash) > 3, 10)
    finally:
        session.stop()
        dash.close()


def test_runner_selector_and_start_stop(wait_until):
    session = lab.run(pipeline(), step, duration=60)
    dash = session.dashboard()
    try:
        dash.runner.value = "cache"
        assert dash.session is not session and not session.running
        assert dash.session.runner == "cache" and dash.session.running
        assert wait_until(lambda: dash.session.stats().step.steps > 3, 20)
        dash.stop_button.click()
        assert not dash.session.running
        stopped = dash.session
        dash.start_button.click()
        assert dash.session is not stopped and dash.session.running and dash.session.runner == "cache"
        assert wait_until(lambda: rows(dash) > 2, 15)
    finally:
        dash.session.stop()
        dash.close()


def test_bad_slider_value_is_reported_not_raised():
    session = lab.run(pipeline(), step, duration=60)
    dash = session.dashboard()
    try:
        dash._on_slider("nope", 2)
        assert "nope" in dash.message.value
    finally:
        session.stop()
        dash.close()


def test_publisher_stops_by_itself_when_the_session_ends(wait_until):
    session = lab.run(pipeline(), step, steps=5)
    dash = session.dashboard()
    assert session.wait(timeout=30)
    assert wait_until(lambda: dash._publisher is None, 10)
    assert "finished" in dash.header.value
    dash.close()


def test_the_publisher_rewrites_text_only_when_due_or_when_the_state_changes(wait_until, monkeypatch):
    """Each rewrite of the header, table or verdict is a comm message (GIL time
    under the thread runner): the publisher's own pushes leave them alone until
    TEXT_EVERY_S has passed, except when the session's state changes."""
    monkeypatch.setattr("spdl_lab._ui.dashboard.TEXT_EVERY_S", 1e9)
    session = lab.run(pipeline(), step, duration=60)
    dash = session.dashboard(hz=1e-3)  # no publisher pushes: the test makes them
    try:
        assert wait_until(lambda: (dash.publish(), "steps/s" in dash.header.value)[1], 15)
        header, t = dash.header.value, session.elapsed_s
        assert wait_until(lambda: session.elapsed_s > t + 1.5, 15)  # a rewrite would show new seconds
        before = dash.publishes
        with dash._lock:
            dash._publish_locked(text=False)
        assert dash.publishes == before + 1 and dash.header.value == header  # not due: untouched
        session.stop()
        with dash._lock:
            dash._publish_locked(text=False)
        assert f"<b>{session.state}</b>" in dash.header.value != header  # a new state: at once
    finally:
        session.stop()
        dash.close()


def test_iterable_sessions_get_no_runner_choice(wait_until):
    session = lab.run([[1, 2]] * 10**6, step, duration=60)
    dash = session.dashboard()
    try:
        assert dash.runner.disabled and dash.sliders == {}
        assert wait_until(lambda: rows(dash) > 3, 15)
    finally:
        session.stop()
        dash.close()


def test_bad_rate_is_refused():
    session = lab.run(pipeline(), step, steps=1)
    try:
        with pytest.raises(lab.SpdlLabError, match="hz must be a number > 0"):
            Dashboard(session, hz=0)
    finally:
        session.stop()
