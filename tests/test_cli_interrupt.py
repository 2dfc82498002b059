"""Ctrl-C in the middle of an experiment: exit 130, one line on stderr, nothing left running."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

MODULE = textwrap.dedent('''
    import time
    import spdl_lab as lab

    def slow(x):
        time.sleep(0.01)
        return x

    def make_pipeline():
        return lab.Pipeline(range(10**6)).map(slow, concurrency=2, name="slow").batch(2)

    def step(batch):
        time.sleep(0.005)
''')


def _interrupt(tmp_path: Path, *args: str, program: list[str] | None = None,
               after_s: float | None = None) -> tuple[int, str, list[int]]:
    """Run the command; SIGINT once its runs begin (or ``after_s`` after its start); its exit code,
    stderr, and the processes it had then."""
    (tmp_path / "ctrlc_pipeline.py").write_text(MODULE)
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "SPDL_LAB_REPORT_DIR": str(tmp_path / "reports")}
    proc = subprocess.Popen(
        [*(program or [sys.executable, "-m", "spdl_lab"]), *args], cwd=tmp_path, env=env, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        # A shell's background jobs ignore SIGINT and Python keeps it ignored: restore it, as a terminal has it.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        if after_s is None:
            first = proc.stdout.readline()  # printed once the pipeline is loaded and the runs begin
            assert first.startswith("pipeline:"), first
        else:
            time.sleep(after_s)
        kids = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    return proc.returncode, err, kids


@pytest.mark.timeout(90)
@pytest.mark.parametrize("command", [
    ["compare", "ctrlc_pipeline:make_pipeline", "--step", "ctrlc_pipeline:step", "--runners", "thread",
     "--steps", "100000"],
    ["compare", "ctrlc_pipeline:make_pipeline", "--runners", "subprocess-threads", "--steps", "100000"],
])
def test_ctrl_c_exits_130_with_one_line(tmp_path, command):
    code, err, kids = _interrupt(tmp_path, *command)
    assert code == 130, err
    assert err.strip().splitlines() == [f"spdl-lab {command[0]}: interrupted"], err
    gone = psutil.wait_procs([psutil.Process(pid) for pid in kids if psutil.pid_exists(pid)], timeout=5)[1]
    assert not gone, f"processes left running after Ctrl-C: {[p.pid for p in gone]}"


#: What Python itself prints when SIGINT lands in its start-up, before any program's code runs.
BEFORE_ANY_CODE = "Fatal Python error: init_import_site"
#: The modules that run before the lab's handler exists: the package's first statement imports
#: ``_startup`` (which imports ``errors``), and the next installs the handler.
_PACKAGE = Path(importlib.util.find_spec("spdl_lab").origin).read_text().splitlines()
_STARTUP_LINE = _PACKAGE.index("from ._startup import quit_on_interrupt as _quit_on_interrupt") + 1
_BEFORE_THE_HANDLER = [("__init__.py", _STARTUP_LINE), ("_startup.py", None), ("errors.py", None)]


def before_the_lab(err: str) -> bool:
    """Whether SIGINT came before the lab's handler existed: in Python's start-up, or in the import
    of the package up to its handler. Python's own KeyboardInterrupt then, as for any program."""
    lines = err.strip().splitlines()
    if BEFORE_ANY_CODE in err:
        return True
    if not lines or lines[-1] != "KeyboardInterrupt":
        return False
    frames = [line.strip() for line in lines if line.strip().startswith('File "')]
    ours = [frame for frame in frames if f"{os.sep}spdl_lab{os.sep}" in frame]
    return all(any(f'{os.sep}spdl_lab{os.sep}{name}", line ' in frame and frame.endswith("in <module>")
                   and (line is None or f'line {line},' in frame) for name, line in _BEFORE_THE_HANDLER)
               for frame in ours)

COMMAND = ["compare", "ctrlc_pipeline:make_pipeline", "--step", "ctrlc_pipeline:step", "--runners", "thread",
           "--steps", "100000"]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("entry", ["-m", "console-script"])
@pytest.mark.parametrize("after_s", [0.1, 0.3, 0.6])
def test_ctrl_c_while_the_command_starts_and_imports_exits_130_with_one_line(tmp_path, entry, after_s):
    """SIGINT while the interpreter imports spdl_lab and its modules: no traceback from the import
    machinery, no exit by the signal, no hang on a module lock."""
    program = ([sys.executable, "-m", "spdl_lab"] if entry == "-m"
               else [str(Path(sys.executable).with_name("spdl-lab"))])
    if not Path(program[0]).exists():
        pytest.skip("the spdl-lab console script is not installed")
    code, err, kids = _interrupt(tmp_path, *COMMAND, program=program, after_s=after_s)
    if before_the_lab(err):  # a loaded machine: the interpreter was still starting
        pytest.skip(f"SIGINT at {after_s} s came before the lab's handler existed (Python's start-up, or "
                    f"the package's first statement): Python's own KeyboardInterrupt, as for any program")
    assert code == 130, err
    assert err.strip().splitlines() == ["spdl-lab compare: interrupted"], err
    gone = psutil.wait_procs([psutil.Process(pid) for pid in kids if psutil.pid_exists(pid)], timeout=5)[1]
    assert not gone, f"processes left running after Ctrl-C: {[p.pid for p in gone]}"


TRACKED = textwrap.dedent('''
    import multiprocessing, subprocess, sys
    from spdl_lab import cli

    cli._quiet_resource_tracker()  # as a command that runs workers starts it
    lock = multiprocessing.get_context("spawn").Lock()  # named, and the tracker knows it
    print(lock._semlock.name, flush=True)
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    print(worker.pid, flush=True)
    cli._interrupted("spdl-lab compare", exiting=True)  # what Ctrl-C ends in
''')


@pytest.mark.timeout(60)
def test_ctrl_c_kills_the_workers_and_spares_the_resource_tracker_which_unlinks_what_they_leaked(tmp_path):
    """Killed with the workers, multiprocessing's resource tracker left every semaphore it held in
    /dev/shm (13 after four Ctrl-C'd ``compare --runners process`` beside a busy demo), and the
    next one a lab thread freed relaunched it to print a KeyError per semaphore it never saw."""
    proc = subprocess.run([sys.executable, "-c", TRACKED], capture_output=True, text=True, timeout=30,
                          env={**os.environ, "PYTHONPATH": os.getcwd()})
    name, worker = proc.stdout.split()
    assert proc.returncode == 130 and proc.stderr.strip() == "spdl-lab compare: interrupted", proc.stderr
    assert not psutil.pid_exists(int(worker)) or psutil.Process(int(worker)).status() == psutil.STATUS_ZOMBIE
    assert semaphore_unlinked(name), f"{name} left in /dev/shm 5 s after Ctrl-C"


def semaphore_unlinked(name: str, timeout: float = 5.0) -> bool:
    """Whether the named semaphore ``name`` leaves /dev/shm within ``timeout``."""
    semaphore = Path("/dev/shm") / f"sem.{name.lstrip('/')}"
    deadline = time.monotonic() + timeout
    while semaphore.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return not semaphore.exists()
