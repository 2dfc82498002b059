"""Verdicts that hold on a busy machine (issue 30): with one CPU-bound process beside them,
diagnose gives each stage its quiet machine's verdict or says it was busy, compare names the load,
and the tuner recommends no move. The quiet runs are the rest of the measurement set
(test_battery_verdicts, test_a_starved_step_gets_its_readers_within_the_budget)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

import spdl_lab as lab
from spdl_lab._diagnose._sweep import SweepSettings
from spdl_lab._diagnose.measure import others_share

sys.path.insert(0, str(Path(__file__).parent.parent / "diagnose"))
import battery_stages as b  # noqa: E402

pytestmark = [pytest.mark.measurement, pytest.mark.usefixtures("no_thread_leak", "no_child_leak")]

BATTERY = {"pure_python": (b.pure_python, "gil-bound"), "sleeps": (b.sleeps, "scales"),
           "compresses": (b.compresses, "cpu-bound"), "locked": (b.locked, "contended")}
FAST = SweepSettings(warmup_s=0.2, window_s=0.3, min_windows=3, max_windows=5, point_timeout_s=5.0)


@pytest.fixture
def burner():
    """One CPU-bound process, spinning on a core until the test ends. Started by a shell that exits
    at once, so it is not this process's child: the lab counts its own children as its own CPU."""
    spin = f"{sys.executable} -c 'while True: pass' > /dev/null 2>&1 & echo $!"
    pid = int(subprocess.run(["sh", "-c", spin], capture_output=True, text=True, check=True).stdout)
    proc = psutil.Process(pid)
    assert pid not in {p.pid for p in psutil.Process().children(recursive=True)}
    t0 = time.monotonic()
    while proc.cpu_percent(0.2) < 50 and time.monotonic() - t0 < 10:
        pass
    yield proc
    os.kill(pid, signal.SIGKILL)
    psutil.wait_procs([proc], timeout=10)


def _busy_said(stage) -> bool:
    return (stage.status == "unstable" and stage.verdict is None
            and stage.evidence.startswith("unstable: the machine was busy (other processes used "))


@pytest.mark.timeout(300)
def test_diagnose_beside_a_burner_gives_the_quiet_verdict_or_says_the_machine_was_busy(burner):
    p = lab.Pipeline(range(32))
    for name, (fn, _) in BATTERY.items():
        p = p.map(fn, name=name)
    diag = lab.diagnose(p, (1, 2, 4), num_items=32, processes=False, settings=FAST, progress=False)
    cores = psutil.cpu_count()
    for name, stage in diag.stages.items():
        quiet = BATTERY[name][1]
        # The burner is seen: about one core of the machine's, outside the run.
        assert others_share(stage.points) >= 0.5 / cores, diag.summary()
        assert stage.verdict == quiet or _busy_said(stage), f"{name}: {stage.verdict}\n{diag.summary()}"
    if any(_busy_said(s) for s in diag.stages.values()):
        assert "Other processes used up to" in diag.machine_load(), diag.summary()


def read(i):
    time.sleep(0.02)  # I/O-like: one reader makes 12.5 batches/s of 4
    return i


def step(batch):
    time.sleep(0.004)


@pytest.mark.timeout(180)
def test_compare_beside_a_burner_names_the_load(burner):
    p = lab.Pipeline(range(10**7)).map(read, concurrency=2, name="read").batch(4)
    comparison = lab.compare(p, step, runners=["thread", "cache"], steps=60, warmup=4, progress=False)
    others = comparison.table["others_cpu_percent"]
    assert (others >= 50).all(), comparison.table
    assert any(w.startswith("Other processes used up to") for w in comparison.warnings), comparison.warnings


@pytest.mark.timeout(180)
def test_the_tuner_beside_a_burner_recommends_no_move(burner):
    # Quiet, the tuner moves this pipeline to more readers (test_tune_measured); beside a burner it
    # must not act on what it measured.
    p = lab.Pipeline(range(10**7)).map(read, concurrency=1, name="read").batch(4)
    tuning = lab.tune(p, step, runners=("thread",), budget_s=15, progress=False)
    assert not tuning.moved, tuning.log
    assert tuning.advice.startswith("keep what you have: the machine was busy"), tuning.advice
    assert any("other processes took" in w for w in tuning.warnings), tuning.warnings
