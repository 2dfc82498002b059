"""diagnose measures in a clean child interpreter: a session running in the same kernel
cannot change its verdicts."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest

import spdl_lab as lab
from spdl_lab._diagnose._sweep import SweepSettings

sys.path.insert(0, str(Path(__file__).parent))
import battery_stages as b  # noqa: E402

pytestmark = pytest.mark.usefixtures("no_thread_leak", "no_child_leak")

FAST = SweepSettings(warmup_s=0.2, window_s=0.3, min_windows=3, max_windows=5, point_timeout_s=5.0)
EXPECTED = {"sleeps": "scales", "pure_python": "gil-bound"}


def _pipeline() -> lab.Pipeline:
    return lab.Pipeline(range(32)).map(b.sleeps, name="sleeps").map(b.pure_python, name="pure_python")


@pytest.mark.timeout(120)
def test_diagnose_runs_in_a_child_and_falls_back_here_for_what_cannot_travel():
    diag = lab.diagnose(_pipeline(), (1, 2), num_items=16, processes=False, settings=FAST, progress=False)
    assert diag.settings["isolated"] is True
    lock = threading.Lock()  # cannot be pickled: the stage is measured in this process instead

    def locked(x):
        with lock:
            return x

    here = lab.diagnose(lab.Pipeline(range(8)).map(locked, name="locked"), (1, 2), num_items=8,
                        processes=False, settings=FAST, progress=False)
    assert here.settings["isolated"] is False and here.stages["locked"].status in ("measured", "unstable")


@pytest.mark.measurement
@pytest.mark.timeout(300)
def test_the_same_verdicts_beside_a_running_session():
    alone = lab.diagnose(_pipeline(), (1, 2, 4), num_items=32, processes=False, settings=FAST, progress=False)
    pipeline, device = lab.workloads.noisy_neighbour(items=10**6)
    session = lab.run(pipeline, step=device, runner="thread", duration=120)
    try:
        beside = lab.diagnose(_pipeline(), (1, 2, 4), num_items=32, processes=False, settings=FAST,
                              progress=False)
        assert session.running
    finally:
        session.stop()
    assert {n: s.verdict for n, s in alone.stages.items()} == EXPECTED, alone.summary()
    assert {n: s.verdict for n, s in beside.stages.items()} == EXPECTED, beside.summary()
