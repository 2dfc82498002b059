"""``spdl-lab watch -- COMMAND...``: run a script, unchanged, with its runs published. ``spdl-lab
tune --script``: check DataLoader advice in the job itself, running it under watch alternately with
its own arguments and with the advice (``$SPDL_LAB_DATALOADER_KWARGS``), comparing steps/s."""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from .._runners import sweep_dead_owners
from .._startup import interrupt_taken
from .._table import num, text_table
from ..errors import SpdlLabError, UsageError
from .hook import KWARGS_ENV
from .publish import ENV, ENV_NAME, JOB_ENV
from .records import RECORD_ENV, record_meta, with_record


def watched_env(name: str | None = None, record: str | None = None) -> dict[str, str]:
    """This process's environment with publishing on, and a job id for launchers that give none."""
    env = {**os.environ, ENV: "1", JOB_ENV: f"watch-{os.getpid()}-{uuid.uuid4().hex[:8]}"}
    # The hook for scripts that never import spdl_lab, as spdl_lab_watch.pth installs it too.
    boot = str(Path(__file__).resolve().parent / "boot")
    env["PYTHONPATH"] = os.pathsep.join([boot, *filter(None, [os.environ.get("PYTHONPATH")])])
    if name:
        env[ENV_NAME] = name
    if record:
        env[RECORD_ENV] = str(Path(record).resolve())
    return env


def run_watched(command: list[str], name: str | None = None, record: str | None = None) -> int:
    """Run ``command`` with publishing on; its exit status (128 + N when signal N ended it), 130
    after a Ctrl-C whatever the script made of it (torch's import, cut short, ends in ImportError)."""
    command = command[1:] if command[:1] == ["--"] else command
    if not command:
        raise UsageError("give the command to run after --, e.g. spdl-lab watch -- python train.py")
    proc = _start(command, env=watched_env(name, record))
    forwarded = _forward_signals(proc)
    try:
        code = proc.wait()
    except KeyboardInterrupt:
        # The script is in our process group and got the same Ctrl-C: let it finish.
        interrupt_taken()
        print("spdl-lab watch: interrupted", file=sys.stderr)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:  # it did not stop: it goes, with what it started
            with contextlib.suppress(psutil.Error):
                root = psutil.Process(proc.pid)
                kill_all([root, *root.children(recursive=True)])
            proc.wait()
        code = -signal.SIGINT
    finally:
        for sig, handler in forwarded.items():
            signal.signal(sig, handler)
        # What the script could not unlink (killed, or interrupted between making a segment and
        # arranging its removal) goes now, not when the next lab process makes one.
        sweep_dead_owners()
    return 128 + signal.Signals(-code).value if code < 0 else code


def _start(command: list[str], **popen: Any) -> subprocess.Popen:
    try:
        return subprocess.Popen(command, **popen)
    except OSError as exc:
        raise UsageError(f"cannot run {command[0]!r}: {exc.strerror or exc}") from None


def kill_all(procs: list[psutil.Process]) -> None:
    """SIGKILL ``procs``, and wait up to 3 s for them to go. A multiprocessing resource tracker
    among them is spared: it exits once the processes holding it are gone and unlinks the
    semaphores and segments they leaked; killed, it leaves them in /dev/shm, and the tracker the
    next free relaunches prints a KeyError for each one it never saw."""
    procs = [p for p in procs if not _is_resource_tracker(p)]
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(procs, timeout=3.0)


def _group(pgid: int) -> list[psutil.Process]:
    """The processes of process group ``pgid``: a stopped script's workers outlive it there."""
    found = []
    for proc in psutil.process_iter():
        with contextlib.suppress(OSError, psutil.Error):
            if os.getpgid(proc.pid) == pgid:
                found.append(proc)
    return found


def _is_resource_tracker(proc: psutil.Process) -> bool:
    with contextlib.suppress(psutil.Error):
        return "multiprocessing.resource_tracker" in " ".join(proc.cmdline())
    return False


def _forward_signals(proc: subprocess.Popen) -> dict[signal.Signals, object]:
    """SIGTERM and SIGHUP go on to the script (a scheduler stopping ``spdl-lab watch`` must not
    leave it running); returns the handlers to put back."""
    def forward(sig: int, _frame: object) -> None:
        if proc.poll() is None:
            proc.send_signal(sig)

    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGHUP)}


#: How often a run's record is read for its step count.
POLL_S = 0.5
#: How long a script may take to end after SIGTERM before it is killed.
STOP_GRACE_S = 20.0
CONFIGS = ("start", "advice")


@dataclass(frozen=True)
class ScriptRun:
    """One run of the script: its figures over its counted steps (after the warm-up)."""

    config: str  # "start" (the script's own arguments) or "advice"
    steps: int
    steps_per_s: float
    step_p50_ms: float
    data_wait_p50_ms: float


def script_report(runs: list[ScriptRun]) -> str:
    """The runs' table, each way's median steps/s, and what they say of the advice."""
    headings = ["run", "config", "steps", "steps/s", "step p50 ms", "wait p50 ms"]
    rows = [[str(i), r.config, str(r.steps), num(r.steps_per_s), num(r.step_p50_ms), num(r.data_wait_p50_ms)]
            for i, r in enumerate(runs, 1)]
    lines = text_table(headings, rows, left=(1,))
    rates = {config: [r.steps_per_s for r in runs if r.config == config] for config in CONFIGS}
    for config, rate in rates.items():
        lines.append(f"{config}: {statistics.median(rate):.3g} steps/s [{min(rate):.3g}-{max(rate):.3g}] "
                     f"over {len(rate)} runs")
    start, advice = rates["start"], rates["advice"]
    low, high = min(advice) / max(start), max(advice) / min(start)
    spread = f"{statistics.median(advice) / statistics.median(start):.2f}x [{low:.2f}-{high:.2f}]"
    keep = "; keep what you have"
    verdict = (f"the advice holds in the job: {spread} the steps/s of the script's own DataLoader"
               if low > 1.0 else f"the advice is slower in the job: {spread}{keep}" if high < 1.0
               else f"not beyond the noise in the job: {spread}{keep}")
    return "\n".join([*lines, "", verdict])


def check_script(command: list[str], advice: dict[str, Any], workdir: Path, *, steps: int = 200,
                 warmup: int = 20, rounds: int = 2, timeout_s: float = 600.0) -> str:
    """Run ``command`` ``rounds`` times each way, alternating (start, advice, advice, start...),
    each until ``warmup + steps`` steps (``timeout_s`` at most); ``script_report`` of the runs."""
    if not command:
        raise UsageError("give the script to check after --script, e.g. --script train.py --epochs 3")
    if not advice:
        raise UsageError("give the advice to check: --set num_workers=4 (repeat --set for more), or "
                         "--advice tuning.json (what spdl-lab tune --json or Tuning.to_json wrote)")
    workdir.mkdir(parents=True, exist_ok=True)
    order = [CONFIGS[(i + i // 2) % 2] for i in range(2 * rounds)]  # start, advice, advice, start, ...
    runs = []
    for i, config in enumerate(order):
        record = workdir / f"run{i + 1:02d}-{config}.sqlite"
        kwargs = advice if config == "advice" else None
        _run_until(command, record, kwargs, warmup + steps, timeout_s)
        runs.append(_figures(_training_loop(record), config, warmup, steps))
    return script_report(runs)


def _run_until(command: list[str], record: Path, kwargs: dict[str, Any] | None, steps: int,
               timeout_s: float) -> None:
    """Run the script under watch until its record holds ``steps`` steps, it ends, or ``timeout_s``
    passes (then SIGTERM, which flushes the record)."""
    env = watched_env(name=f"tune-script-{record.stem}", record=str(record))
    env.pop(KWARGS_ENV, None)
    if kwargs is not None:
        env[KWARGS_ENV] = json.dumps(kwargs)
    proc = _start(command, env=env, start_new_session=True, stdout=subprocess.DEVNULL,
                  stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + timeout_s
    try:
        while proc.poll() is None:
            if _steps_in(_training_loop(record)) >= steps or time.monotonic() > deadline:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(STOP_GRACE_S)
                except subprocess.TimeoutExpired:
                    proc.kill()
                break
            time.sleep(POLL_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        # The DataLoader workers it left (not its resource tracker): they hold its stderr open until
        # they see it gone, which takes them up to 5 s (torch's status check).
        kill_all(_group(proc.pid))
    stderr = proc.communicate(timeout=STOP_GRACE_S)[1] or ""
    if not record.exists():
        last = stderr.strip().splitlines()[-1:] or ["(nothing on stderr)"]
        raise SpdlLabError(f"the script never iterated a torch DataLoader (no run was published), so there "
                           f"is nothing to apply the advice to; it exited with status {proc.returncode}: "
                           f"{last[0]}")
    if kwargs is not None and KWARGS_ENV in stderr:
        raise SpdlLabError(stderr.strip().splitlines()[-1])


def _training_loop(record: Path) -> Path:
    """The record of the script's training loop: of its runs (``record``, then ``record-NAME`` for
    each further loop, as Lightning's validation loop before its training loop), the one with
    the most steps."""
    return max([record, *sorted(record.parent.glob(f"{record.stem}-*.sqlite"))], key=_steps_in)


def _steps_in(record: Path) -> int:
    with contextlib.suppress(SpdlLabError):  # not there yet, or still being made
        return with_record(record, lambda db: int(db.execute("SELECT count(*) FROM steps").fetchone()[0]))
    return 0


def _figures(record: Path, config: str, warmup: int, steps: int) -> ScriptRun:
    meta = record_meta(record)
    if meta.get("runner") != "DataLoader":
        raise SpdlLabError(f"the script's published run iterates a {meta.get('runner')!r}, not a torch DataLoader: "
                           "tune --script applies DataLoader arguments only")
    rows = with_record(record, lambda db: db.execute("SELECT end_ns, wait_ns, step_ns FROM steps ORDER BY idx")
                       .fetchall())
    if len(rows) < warmup + 2:
        raise SpdlLabError(f"the {config} run of the script ended after {len(rows)} steps, fewer than the "
                           f"warm-up ({warmup}) and two more; pass a smaller --warmup or --steps")
    counted = rows[warmup:warmup + steps]
    since = rows[warmup - 1][0] if warmup else counted[0][0] - counted[0][1] - counted[0][2]
    span_s = (counted[-1][0] - since) / 1e9
    return ScriptRun(config=config, steps=len(counted),
                     steps_per_s=len(counted) / span_s if span_s > 0 else math.nan,
                     step_p50_ms=statistics.median(r[2] for r in counted) / 1e6,
                     data_wait_p50_ms=statistics.median(r[1] for r in counted) / 1e6)
