"""Ctrl-C at any instant (issue 30): every command, with each runner it takes, interrupted 0.1, 0.5,
2 and 10 s after it starts, exits 130 with one line on stderr and no traceback, and leaves nothing
running 5 s later. ``watch`` gets SIGINT as a terminal sends it, to the whole process group: the
script stops, and its record holds every step the script counted.

The four instants of one command run side by side (each its own process), so a row costs about
its longest instant, not their sum."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest
from test_cli_interrupt import MODULE, before_the_lab

import spdl_lab as lab
from spdl_lab._watch.records import record_meta

#: watch at 2 s lands in the script's ``import torch``, which a Ctrl-C can end in torch's own
#: ImportError, an abort or (rarely, as without the lab) no exception at all: watch still exits 130.
INSTANTS = (0.1, 0.5, 2.0, 10.0)

PIPELINE = MODULE  # a pipeline of slow items, and a step


SCRIPT = textwrap.dedent('''
    import time
    import torch
    from torch.utils.data import DataLoader, Dataset

    class Items(Dataset):
        def __len__(self): return 10**6
        def __getitem__(self, i): return torch.full((4,), float(i))

    counted = 0
    try:
        for batch in DataLoader(Items(), batch_size=4, num_workers=1):
            time.sleep(0.005)
            counted += 1
    finally:
        with open("counted.txt", "w") as f:
            f.write(str(counted))
''')

STEP = ["--step", "ctrlc_pipeline:step"]
LONG = ["--steps", "100000"]

#: id -> the command's arguments (``{record}``: a saved comparison to report on)
COMMANDS = {
    **{f"compare-{r}": ["compare", "ctrlc_pipeline:make_pipeline", *STEP, "--runners", r, *LONG]
       for r in ("thread", "process", "subprocess-threads", "cache", "ray")},
    "diagnose": ["diagnose", "ctrlc_pipeline:make_pipeline"],
    **{f"tune-{r}": ["tune", "ctrlc_pipeline:make_pipeline", *STEP, "--runners", r, "--budget", "60"]
       for r in ("thread", "process", "subprocess-threads")},
    "demo-noisy-neighbour": ["demo", "--steps", "400"],
    "demo-images": ["demo", "--workload", "images", "--steps", "400"],
    "report": ["report", "{record}"],
    "watch": ["watch", "--name", "ctrlc", "--record", "run.sqlite", "--", sys.executable, "train.py"],
}


#: A run that exits 0, quietly, this soon after SIGINT was already ending as the signal came.
ENDING_S = 1.0


class Interrupted:
    """One run of a command, sent SIGINT ``after_s`` after its start (or found ended by then)."""

    def __init__(self, workdir: Path, args: list[str], after_s: float) -> None:
        self.workdir, self.after_s = workdir, after_s
        env = {**os.environ, "PYTHONPATH": str(workdir), "SPDL_LAB_REPORT_DIR": str(workdir / "reports"),
               "SPDL_LAB_RUNTIME_DIR": str(workdir / "rt"), "SPDL_LAB_CACHE_DIR": str(workdir / "cache")}
        self.group = args[0] == "watch"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "spdl_lab", *args], cwd=workdir, env=env, text=True,
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=self.group,
            # A shell's background jobs ignore SIGINT and Python keeps it ignored: restore it, as a
            # terminal has it.
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        self.kids: list[int] = []
        self.sent = False
        self.ended_at_once = False  # it exited within ENDING_S of the signal
        self.err = ""

    def interrupt(self) -> None:
        if self.proc.poll() is not None:
            return
        try:
            self.kids = [p.pid for p in psutil.Process(self.proc.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            return
        self.sent = True
        if self.group:  # as a terminal: the whole foreground group
            os.killpg(self.proc.pid, signal.SIGINT)
        else:
            self.proc.send_signal(signal.SIGINT)
        deadline = time.monotonic() + ENDING_S
        while time.monotonic() < deadline and not self.ended_at_once:
            self.ended_at_once = self.proc.poll() is not None
            time.sleep(0.02)

    def finish(self, timeout: float) -> None:
        try:
            _, self.err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            tree = [(p.pid, p.status(), " ".join(p.cmdline())[:80]) for p in _tree(self.proc.pid)]
            raise AssertionError(f"{self.after_s} s: still running {timeout:g} s after Ctrl-C: {tree}") from None
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait(10)

    def left_running(self) -> list[int]:
        alive = [psutil.Process(pid) for pid in self.kids if psutil.pid_exists(pid)]
        return [p.pid for p in psutil.wait_procs(alive, timeout=5)[1]]


def _shm() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def _tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def _run_at_every_instant(tmp_path: Path, args: list[str], instants: tuple[float, ...]) -> list[Interrupted]:
    runs = []
    for after_s in instants:
        workdir = tmp_path / f"at-{after_s}"
        workdir.mkdir()
        (workdir / "ctrlc_pipeline.py").write_text(PIPELINE)
        (workdir / "train.py").write_text(SCRIPT)
        runs.append(Interrupted(workdir, args, after_s))
    start = time.monotonic()
    timers = [threading.Timer(max(0.0, run.after_s - (time.monotonic() - start)), run.interrupt) for run in runs]
    for timer in timers:
        timer.start()
    try:
        for run, timer in zip(runs, timers):
            timer.join(run.after_s + 5)
            run.finish(timeout=40)
    finally:
        for timer in timers:
            timer.cancel()
        for run in runs:
            if run.proc.poll() is None:
                run.proc.kill()
    return runs


_SAVED: list[str] = []


def _saved_comparison() -> str:
    """A comparison saved as JSON, made once per test process, for ``report`` to render."""
    if not _SAVED:
        pipeline, step = lab.workloads.noisy_neighbour(items=400)
        comparison = lab.compare(pipeline, step, runners=["thread", "cache"], steps=20, warmup=2,
                                 repeats=1, progress=False)
        path = Path(tempfile.mkdtemp(prefix="ctrlc-")) / "comparison.json"
        comparison.to_json(path)
        _SAVED.append(str(path))
    return _SAVED[0]


# Four runs of a command at once, each starting workers: beside the unit set's other tests, they
# starve them (a torchrun job's rank made no step in its window). The measurement set runs alone.
@pytest.mark.measurement
@pytest.mark.timeout(240)
@pytest.mark.parametrize("command", COMMANDS)
def test_ctrl_c_at_any_instant_exits_130_with_one_line_and_leaves_nothing(tmp_path, command):
    args = [a.format(record=_saved_comparison()) for a in COMMANDS[command]]
    shm_before = _shm()
    runs = _run_at_every_instant(tmp_path, args, INSTANTS)
    # Named semaphores and segments too (the measurement set runs alone: nothing else makes them).
    deadline = time.monotonic() + 5
    while (shm_left := _shm() - shm_before) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not shm_left, f"{command}: left in /dev/shm 5 s after Ctrl-C: {sorted(shm_left)}"
    for run in runs:
        at = f"{command} at {run.after_s} s"
        left = run.left_running()
        assert not left, f"{at}: processes left running 5 s after Ctrl-C: {left}\n{run.err}"
        ending = run.proc.returncode == 0 and not run.err and (command == "report" or run.ended_at_once)
        if not run.sent or ending:
            # It ended before the instant, or was ending as it came (report, done in about 2 s;
            # tune-process, which converges in 8-10 s; once its work is done, a Ctrl-C is moot):
            # it must have ended well. An ignored Ctrl-C runs on well past ENDING_S.
            assert run.proc.returncode == 0, f"{at}: ended {run.proc.returncode} before Ctrl-C\n{run.err}"
            continue
        if before_the_lab(run.err):  # a loaded machine: Python was still starting, the lab's handler not set
            continue
        assert run.proc.returncode == 130, f"{at}: exit {run.proc.returncode}\n{run.err}"
        ours = [line for line in run.err.splitlines() if line.startswith("spdl-lab")]
        assert ours == [f"spdl-lab {args[0]}: interrupted"], f"{at}:\n{run.err}"
        if command == "watch":
            _assert_record_complete(run, at)
        else:
            assert run.err.strip().splitlines() == ours, f"{at}: more than one line\n{run.err}"


def _assert_record_complete(run: Interrupted, at: str) -> None:
    """The script's own count of its steps is what its record holds (no record if it never began)."""
    counted_file, record = run.workdir / "counted.txt", run.workdir / "run.sqlite"
    counted = int(counted_file.read_text()) if counted_file.exists() else 0
    if not record.exists():
        assert counted == 0, f"{at}: the script counted {counted} steps and no record was written\n{run.err}"
        return
    assert record_meta(record)["state"] in ("stopped", "finished"), f"{at}: {record_meta(record)}"
    stats = lab.open(record).stats().step
    assert (stats.steps if stats is not None else 0) == counted, f"{at}: record vs script\n{run.err}"
