"""A data-parallel job (``lab.workloads.job_script("ddp")``: 2 ranks, gloo on the CPU) started
under ``spdl-lab watch -- torchrun``, for the job tests and the job benchmark."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import spdl_lab as lab

TORCHRUN = str(Path(sys.executable).with_name("torchrun"))


def start_job(name: str, folder: Path, *args: str, ranks: int = 2) -> subprocess.Popen:
    """``spdl-lab watch --name NAME --record FOLDER/NAME -- torchrun ... train_ddp.py ARGS``."""
    command = [sys.executable, "-m", "spdl_lab", "watch", "--name", name, "--record", str(folder / name), "--",
               TORCHRUN, f"--nproc_per_node={ranks}", "--standalone",  # a free port: jobs side by side
               str(lab.workloads.job_script("ddp")), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    return subprocess.Popen(command, cwd=folder, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def stop_job(proc: subprocess.Popen, timeout: float = 30.0) -> str:
    """Wait for the job (SIGTERM to its group after ``timeout``, then SIGKILL); its output."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
    return out


def leave_nothing(proc: subprocess.Popen, job) -> None:
    """After a test, whatever happened: the job's processes killed, the viewer closed."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    if job is not None:
        job.close()


def wait_for(predicate, timeout: float, what: str, interval: float = 0.25):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)
