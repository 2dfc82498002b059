"""A script publishes its run (lab.publish); a viewer here attaches, reads, steers, and sees it end."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pandas as pd
import pytest

import spdl_lab as lab
from spdl_lab._watch.records import read_record

pytestmark = pytest.mark.usefixtures("no_thread_leak")

SCRIPT = textwrap.dedent('''
    import sys, time
    import spdl_lab as lab

    def slow(x):
        time.sleep(0.002)
        return x

    pipeline = lab.Pipeline(range(10**7)).map(slow, concurrency=2, name="slow").batch(4)
    loader = lab.publish(lab.Loader(pipeline, runner="thread"), name=sys.argv[1])
    print("published", flush=True)
    for i, batch in enumerate(loader):
        time.sleep(0.01)
        if len(sys.argv) > 2 and i >= int(sys.argv[2]):
            break
    loader.close()
''')


@pytest.fixture
def script(tmp_path, monkeypatch):
    runtime = tmp_path / "rt"
    monkeypatch.setenv("SPDL_LAB_RUNTIME_DIR", str(runtime))
    path = tmp_path / "train.py"
    path.write_text(SCRIPT)
    started = []

    def start(name: str, *args: str) -> subprocess.Popen:
        env = {**os.environ, "SPDL_LAB_RUNTIME_DIR": str(runtime),
               "SPDL_LAB_RECORD": str(tmp_path / f"{name}.sqlite")}
        proc = subprocess.Popen([sys.executable, str(path), name, *args], cwd=tmp_path, env=env,
                                stdout=subprocess.PIPE, text=True)
        started.append(proc)
        assert proc.stdout.readline().strip() == "published"
        return proc

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
        proc.stdout.close()


@pytest.mark.timeout(90)
def test_attach_reads_steers_and_sees_a_kill(script, wait_until):
    proc = script("trainer")
    runs = lab.attach()
    assert list(runs["name"]) == ["trainer"] and runs["pid"].iloc[0] == proc.pid
    assert runs["state"].iloc[0] == "running" and runs["runner"].iloc[0] == "thread"
    wait_until(lambda: lab.attach()["steps"].iloc[0] > 0, timeout=10)  # as its record has them so far
    remote = lab.attach("trainer", timeout=10)
    try:
        wait_until(lambda: "qps" in set(remote.frames()["series"]), timeout=10)  # a tick after the first
        assert "concurrency" in set(remote.frames()["series"])
        assert remote.controls() == {"slow": 2}
        remote.set_concurrency("slow", 3)
        wait_until(lambda: remote.controls().get("slow") == 3, timeout=10)
        with pytest.raises(lab.SpdlLabError, match="must be|concurrency|1024"):
            remote.set_concurrency("slow", 0)
        with pytest.raises(lab.SpdlLabError, match="nope"):
            remote.set_concurrency("nope", 2)
        snap = remote.stats()
        assert isinstance(snap, lab.Snapshot) and snap.runner == "thread"
        assert snap.stages["slow"].concurrency == 3 and snap.step is not None
        record = runs["record"].iloc[0]
        wait_until(lambda: len(read_record(record)) > 0, timeout=10)  # flushed at least every 2 s
        proc.send_signal(signal.SIGKILL)
        assert wait_until(lambda: remote.state == "killed", timeout=30)  # how soon: the measurement below
        assert len(remote.frames()) > 0  # what was received stays readable
    finally:
        remote.close()
    assert len(read_record(record)) > 0  # the record, up to its last flush
    proc.wait(10)  # reaped, as a shell reaps its jobs (a zombie's pid is still alive)
    assert lab.attach().empty  # the dead run's discovery file was cleaned


@pytest.mark.measurement
@pytest.mark.timeout(90)
def test_a_viewer_sees_a_kill_within_5_s(script, wait_until):
    proc = script("victim")
    remote = lab.attach("victim", timeout=10)
    try:
        proc.send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        wait_until(lambda: remote.state == "killed", timeout=5)
        assert time.monotonic() - t0 < 5
    finally:
        remote.close()


@pytest.mark.timeout(90)
def test_a_script_that_ends_is_finished_and_leaves_nothing_in_the_runtime_dir(script, tmp_path, wait_until):
    proc = script("short", "30")
    remote = lab.attach(proc.pid, timeout=10)
    try:
        wait_until(lambda: remote.state == "finished", timeout=30)
    finally:
        remote.close()
    assert proc.wait(10) == 0
    assert list((tmp_path / "rt").iterdir()) == []
    assert lab.attach().empty
    run = lab.open(tmp_path / "short.sqlite")  # the record, after the script
    assert run.state == "finished" and run.pid == proc.pid and run.runner == "thread"
    assert {"qps", "concurrency"} <= set(run.frames()["series"])
    assert_same_frames(remote, tmp_path / "short.sqlite")  # the last ticks too, after the last poll
    with pytest.raises(lab.SpdlLabError, match="finished: nothing to change"):
        run.set_concurrency("slow", 2)
    run.close()


def assert_same_frames(remote: lab.RemoteSession, record) -> None:
    """A viewer of a run that ended holds every tick its record does, to the last."""
    recorded = lab.open(record)
    try:
        pd.testing.assert_frame_equal(remote.frames().reset_index(drop=True),
                                      recorded.frames().reset_index(drop=True))
    finally:
        recorded.close()


def test_attach_names_what_is_published_when_nothing_matches(monkeypatch, tmp_path):
    monkeypatch.setenv("SPDL_LAB_RUNTIME_DIR", str(tmp_path / "rt"))
    # Were a publish below accepted, its record would go here, not to ./spdl_lab_runs (a
    # list was accepted once, and its record was committed).
    monkeypatch.setenv("SPDL_LAB_RECORD", str(tmp_path / "refused.sqlite"))
    with pytest.raises(lab.SpdlLabError, match="no published run 'ghost' appeared within 0.2 s"):
        lab.attach("ghost", timeout=0.2)
    with pytest.raises(lab.PipelineSpecError, match="name or pid"):
        lab.attach(3.5)
    with pytest.raises(lab.PipelineSpecError, match="a torch DataLoader, an SPDL pipeline"):
        lab.publish(42)
    with pytest.raises(lab.PipelineSpecError, match=r"publish lab.Loader\(pipeline"):
        lab.publish(lab.Pipeline(range(3)))


UNCHANGED = textwrap.dedent('''
    import sys, time
    import spdl_lab as lab

    def slow(x):
        time.sleep(0.002)
        return x

    loader = lab.Loader(lab.Pipeline(range(10**7)).map(slow, concurrency=2, name="slow").batch(4))
    for i, batch in enumerate(loader):   # no lab.publish: spdl-lab watch publishes it
        if i == 0:
            print("training", flush=True)
        time.sleep(0.01)
        if i >= int(sys.argv[1]):
            break
    loader.close()
    sys.exit(3)
''')


@pytest.mark.timeout(90)
def test_spdl_lab_watch_publishes_an_unchanged_script_and_exits_with_its_status(tmp_path, monkeypatch,
                                                                               wait_until):
    monkeypatch.setenv("SPDL_LAB_RUNTIME_DIR", str(tmp_path / "rt"))
    (tmp_path / "train.py").write_text(UNCHANGED)
    record = tmp_path / "runs" / "w.sqlite"
    proc = subprocess.Popen([sys.executable, "-m", "spdl_lab", "watch", "--name", "w", "--record", str(record),
                             "--", sys.executable, "train.py", "150"], cwd=tmp_path, stdout=subprocess.PIPE,
                            text=True, env={**os.environ, "SPDL_LAB_RUNTIME_DIR": str(tmp_path / "rt")})
    try:
        assert proc.stdout.readline().strip() == "training"
        remote = lab.attach("w", timeout=10)
        try:
            wait_until(lambda: len(remote.frames()) > 0, timeout=10)
            assert remote.runner == "thread" and remote.controls() == {"slow": 2}
            wait_until(lambda: remote.state != "running", timeout=60)
            assert remote.state == "finished"
        finally:
            remote.close()
        assert proc.wait(30) == 3  # the script's own status
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        proc.stdout.close()
    assert len(read_record(record)) > 0 and not list((tmp_path / "rt").iterdir())


def test_watch_without_a_command_is_a_usage_error(capsys):
    from spdl_lab.cli import main

    assert main(["watch", "--name", "x"]) == 2
    assert "give the command to run after --" in capsys.readouterr().err


@pytest.mark.timeout(90)
def test_the_dashboard_draws_a_remote_run_and_its_slider_steers_it(script, wait_until):
    script("dash")
    remote = lab.attach("dash", timeout=10)
    dash = remote.dashboard()
    try:
        wait_until(lambda: dash.plots is not None and len(dash.plots.source.data["time_s"]) > 5, timeout=20)
        assert "qps:slow" in dash.plots.source.data, sorted(dash.plots.source.data)
        assert wait_until(lambda: "runner <b>thread</b>" in dash.header.value, 10)
        dash.sliders["slow"].value = 3  # as a user moving the slider
        wait_until(lambda: remote.controls().get("slow") == 3, timeout=10)
    finally:
        dash.close()
        remote.close()


@pytest.mark.timeout(90)
def test_two_viewers_at_once_and_one_going_away_changes_nothing(script, wait_until):
    proc = script("shared")
    first, second = lab.attach("shared", timeout=10), lab.attach(proc.pid, timeout=10)
    try:
        wait_until(lambda: len(first.frames()) > 0 and len(second.frames()) > 0, timeout=10)
        first.close()  # one viewer goes away...
        seen = len(second.frames())
        wait_until(lambda: len(second.frames()) > seen, timeout=10)  # ...the other still reads
        assert second.state == "running" and proc.poll() is None  # and the script trains on
    finally:
        second.close()


def test_a_run_that_does_not_answer_while_its_record_is_open_and_its_pid_lives_is_not_killed(tmp_path):
    """A SIGTERM's flush on a busy machine, or a run too busy to answer in time: the viewer asks
    again, and reads how it ended once its record says (it read "killed" at once before)."""
    from spdl_lab._telemetry.frames import Ring
    from spdl_lab._watch.attach import RemoteSession
    from spdl_lab._watch.records import RecordWriter
    from spdl_lab.errors import SpdlLabError

    class Unanswered:
        socket_path = str(tmp_path / "gone.sock")

        def request(self, kind, **fields):
            raise SpdlLabError("timed out")

    record = tmp_path / "r.sqlite"
    writer = RecordWriter(record, meta={"name": "busy", "runner": "DataLoader"})  # this pid: alive
    try:
        viewer = RemoteSession({"name": "busy", "pid": os.getpid(), "record": str(record)}, ring=Ring(8))
        viewer._client = Unanswered()
        assert viewer._poll() and viewer.state == "running"
    finally:
        writer.close(state="stopped")
    assert not viewer._poll() and viewer.state == "stopped"
