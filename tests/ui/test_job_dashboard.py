"""The job dashboard follows each rank's training loop: when a rank's loop changes (Lightning's
validation loop first, then training, each on its own clock), its lines start again from the
new loop's ticks instead of going on from where the old loop's clock had got to."""

from __future__ import annotations

import types

import pandas as pd
import pytest

from spdl_lab._telemetry.frames import FrameChunk, Ring
from spdl_lab._ui.job_dashboard import JobDashboard

pytestmark = pytest.mark.usefixtures("no_thread_leak")


class Run:
    """A published loop's ticks, 10 a second, ``steps_per_s`` steps a second, from 0 s."""

    def __init__(self, name: str, seconds: float, steps_per_s: float) -> None:
        self.name, self.state, self._ring = name, "running", Ring(1000)
        ticks = int(seconds * 10)
        for i in range(ticks + 1):
            self._ring.append(i / 10, [("steps", "step", steps_per_s * i / 10), ("data_wait_frac", "step", 0.1)])
        self.elapsed_s = ticks / 10

    def recent(self, seconds: float) -> FrameChunk:
        return FrameChunk(*self._ring.latest(seconds))


class Job:
    name, world_size, running = "fake", 1, True

    def __init__(self, run: Run) -> None:
        self.ranks = {0: run}

    def judge(self):
        return types.SimpleNamespace(text="balanced")

    def summary(self) -> pd.DataFrame:
        return pd.DataFrame()


@pytest.mark.timeout(60)
def test_a_ranks_new_training_loop_is_drawn_from_its_own_start():
    job = Job(Run("fake-rank0", seconds=20, steps_per_s=5))  # the validation loop: 20 s of ticks
    dash = JobDashboard(job, hz=0.01)  # draws once now; the test draws the rest
    try:
        drawn = list(dash._sources[0].data["time_s"])
        assert drawn and max(drawn) > 15
        job.ranks = {0: Run("fake-rank0-2", seconds=6, steps_per_s=50)}  # training took over 6 s ago
        dash.publish()
        times = list(dash._sources[0].data["time_s"])
        assert times and max(times) <= 6  # the training loop's clock, from its start
        assert min(dash._sources[0].data["steps_per_s"]) > 25  # its rate, none of the validation loop's
    finally:
        dash.close()
