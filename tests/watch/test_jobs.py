"""A torchrun job under ``spdl-lab watch``, seen as one: a real 2-rank DDP job (gloo, CPU) whose
ranks publish with their rank and the job's id; ``lab.attach(job)`` gives a JobSession with a row
per rank, every rank's frames, the straggler verdict, and concurrency set per rank; the records
go into one folder that ``lab.open`` and ``spdl-lab report`` read; a rank killed mid-run is named.
How fast and how right the verdict is on a quiet machine: tests/watch/test_job_verdicts.py."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

import spdl_lab as lab

sys.path.insert(0, str(Path(__file__).parent))
from ddp_jobs import leave_nothing, start_job, stop_job, wait_for  # noqa: E402

pytestmark = pytest.mark.timeout(240)


def test_a_torchrun_job_is_one_job_with_a_session_per_rank(tmp_path):
    proc = start_job("ddp-one", tmp_path, "--loader", "lab", "--seconds", "60", "--slow-rank", "1",
                     "--slow-ms", "9", "--val-steps", "2")
    job = None
    try:
        job = lab.attach("ddp-one", timeout=90)
        assert isinstance(job, lab.JobSession) and job.world_size == 2
        wait_for(lambda: len(job.ranks) == 2, 60, "both ranks")
        listing = lab.attach()
        row = listing[listing["name"] == "ddp-one"]
        assert len(row) == 1 and row["ranks"].iloc[0] == "0,1 of 2"
        # Each rank ran 2 validation steps first: a rank is its training loop, once it has more.
        wait_for(lambda: {r: s.name for r, s in job.ranks.items()} == {0: "ddp-one-rank0-2", 1: "ddp-one-rank1-2"},
                 60, "each rank's training loop")
        assert [[s.name for s in runs] for runs in job.runs.values()] == [
            ["ddp-one-rank0", "ddp-one-rank0-2"], ["ddp-one-rank1", "ddp-one-rank1-2"]]
        # The listing's steps: the slowest rank's training loop, past its 2 validation steps.
        wait_for(lambda: lab.attach().set_index("name").loc["ddp-one", "steps"] > 2, 30, "the training steps")
        assert {s.rank for s in job.ranks.values()} == {0, 1}

        wait_for(lambda: job.straggler == 1, 90, "the slowed rank named")
        assert job.verdict().startswith("rank 1 waits")
        summary = job.summary()
        assert list(summary.index) == [0, 1] and set(summary["state"]) == {"running"}
        assert summary.loc[1, "data_wait_frac"] > summary.loc[0, "data_wait_frac"]
        assert "load items/s" in summary.columns
        frames = job.frames()
        assert list(frames.columns[:2]) == ["rank", "time_s"] and set(frames["rank"]) == {0, 1}

        job.set_concurrency("load", 12, rank=1)  # the slowed rank only
        wait_for(lambda: job.controls()[1].get("load") == 12, 30, "rank 1's new concurrency")
        assert job.controls()[0]["load"] == 2
        with pytest.raises(lab.PipelineSpecError, match="no rank 5"):
            job.set_concurrency("load", 4, rank=5)
        job.set_concurrency("load", 3)  # every rank
        wait_for(lambda: all(c.get("load") == 3 for c in job.controls().values()), 30, "every rank at 3")
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # the scheduler's stop: watch passes it on to torchrun
        out = stop_job(proc, timeout=60)
        if job is not None:
            job.close()
    wait_for(lambda: not job.running, 30, f"the ranks' end; output:\n{out[-3000:]}")

    folder = tmp_path / "ddp-one"
    assert sorted(p.name for p in folder.glob("*.sqlite")) == ["rank0-2.sqlite", "rank0.sqlite", "rank1-2.sqlite",
                                                               "rank1.sqlite"]
    recorded = lab.open(folder)
    assert isinstance(recorded, lab.JobSession) and sorted(recorded.ranks) == [0, 1]
    assert recorded.world_size == 2 and recorded.name == "ddp-one"
    assert (recorded.summary()["steps"] > 0).all()
    report = subprocess.run([sys.executable, "-m", "spdl_lab", "report", str(folder), "-o",
                             str(tmp_path / "job.html")], capture_output=True, text=True, timeout=120)
    assert report.returncode == 0, report.stderr
    assert "verdict: " in report.stdout and (tmp_path / "job.html").stat().st_size > 10_000
    page = (tmp_path / "job.html").read_text()
    assert "spdl_lab job ddp-one" in page and "rank 1" in page


def test_a_rank_killed_mid_run_is_named_and_the_others_follow_torchrun(tmp_path):
    proc = start_job("ddp-kill", tmp_path, "--seconds", "90")
    job = None
    try:
        job = lab.attach("ddp-kill", timeout=90)
        wait_for(lambda: len(job.ranks) == 2, 60, "both ranks")
        wait_for(lambda: (job.summary()["steps"] > 5).all(), 60, "steps on both ranks")
        os.kill(job.ranks[1].pid, signal.SIGKILL)
        wait_for(lambda: not job.running, 60, "the job's end")
        out = stop_job(proc, timeout=60)
    finally:
        leave_nothing(proc, job)
    # torchrun stops the other ranks (SIGTERM) when one fails, and exits non-zero.
    assert proc.returncode != 0, out[-2000:]
    assert job.states == {0: "stopped", 1: "killed"}, out[-3000:]  # once under load, 0 read "killed"
    assert job.verdict() == "rank 1 died (killed); rank 0 stopped"
    assert job.state == "0 stopped, 1 killed"


def test_spdl_lab_watch_1_under_torchrun_alone_records_the_job_in_one_folder(tmp_path):
    from ddp_jobs import TORCHRUN

    env = {**os.environ, "SPDL_LAB_WATCH": "1", "SPDL_LAB_WATCH_NAME": "envjob", "OMP_NUM_THREADS": "1"}
    # --val-steps: each rank iterates a validation loader first (Lightning's sanity check), a
    # second run of the same name: the job and its steps are still the training loop's.
    done = subprocess.run([TORCHRUN, "--nproc_per_node=2", "--standalone", str(lab.workloads.job_script("ddp")),
                           "--steps", "40", "--workers", "1", "--val-steps", "3"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    (folder,) = (tmp_path / "spdl_lab_runs").iterdir()
    assert folder.name.startswith("envjob-")  # NAME-JOBID: torchrun's TORCHELASTIC_RUN_ID
    assert sorted(p.name for p in folder.iterdir()) == ["rank0-2.sqlite", "rank0.sqlite", "rank1-2.sqlite",
                                                         "rank1.sqlite"]
    job = lab.open(folder)
    assert job.world_size == 2 and job.name == "envjob" and job.state == "finished"
    assert list(job.summary()["steps"]) == [40, 40]
    assert {r: s.name for r, s in job.ranks.items()} == {0: "envjob-rank0-2", 1: "envjob-rank1-2"}
    assert {r: [s.name for s in runs] for r, runs in job.runs.items()} == {
        0: ["envjob-rank0", "envjob-rank0-2"], 1: ["envjob-rank1", "envjob-rank1-2"]}
    assert [s.stats().step.steps for s in job.runs[0]] == [3, 40]

    # The job run again into its folder: the earlier run's records stay beside (here, copies made
    # older, of another job id); the folder opens as the latest run.
    for record in list(folder.iterdir()):
        earlier = folder / f"{record.stem}-earlier.sqlite"
        shutil.copy(record, earlier)
        with contextlib.closing(sqlite3.connect(earlier)) as db, db:
            db.executemany("UPDATE meta SET value = ? WHERE key = ?",
                           [("2000-01-01T00:00:00+00:00", "started"), ("earlier-job", "job"), ("0", "steps_first_ns")])
            db.execute("DELETE FROM steps WHERE idx >= 5")
    reopened = lab.open(folder)
    assert reopened.job_id == job.job_id and list(reopened.summary()["steps"]) == [40, 40]
    assert [len(runs) for runs in reopened.runs.values()] == [2, 2]
    assert job.job_id.startswith(folder.name.removeprefix("envjob-"))
