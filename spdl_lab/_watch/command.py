"""``spdl-lab watch [--name NAME] [--record PATH] -- COMMAND...``: run a training script,
unchanged, with its runs published (``SPDL_LAB_WATCH=1``, see ``publish`` and ``hook``), and
exit with the script's status."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import uuid
from pathlib import Path

from ..errors import UsageError
from .discovery import JOB_ENV
from .publish import ENV, ENV_NAME

__all__ = ["run_watched", "watched_env"]


def watched_env(name: str | None = None, record: str | None = None) -> dict[str, str]:
    """This process's environment with publishing on, and a job id for launchers that give none."""
    env = {**os.environ, ENV: "1", JOB_ENV: f"watch-{os.getpid()}-{uuid.uuid4().hex[:8]}"}
    # The hook for scripts that never import spdl_lab, as spdl_lab_watch.pth installs it too.
    boot = str(Path(__file__).resolve().parent / "boot")
    env["PYTHONPATH"] = os.pathsep.join([boot, *filter(None, [os.environ.get("PYTHONPATH")])])
    if name:
        env[ENV_NAME] = name
    if record:
        env["SPDL_LAB_RECORD"] = str(Path(record).resolve())
    return env


def run_watched(command: list[str], name: str | None = None, record: str | None = None) -> int:
    """Run ``command`` with publishing on; its exit status (128 + N when signal N ended it)."""
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise UsageError("give the command to run after --, e.g. spdl-lab watch -- python train.py")
    env = watched_env(name, record)
    try:
        proc = subprocess.Popen(command, env=env)
    except OSError as exc:
        raise UsageError(f"cannot run {command[0]!r}: {exc.strerror or exc}") from None
    forwarded = _forward_signals(proc)
    try:
        code = proc.wait()
    except KeyboardInterrupt:
        # The script is in our process group and got the same Ctrl-C: let it finish.
        try:
            code = proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
    finally:
        for sig, handler in forwarded.items():
            signal.signal(sig, handler)
    return 128 + signal.Signals(-code).value if code < 0 else code


def _forward_signals(proc: subprocess.Popen) -> dict[signal.Signals, object]:
    """SIGTERM and SIGHUP go on to the script (a scheduler stopping ``spdl-lab watch`` must not
    leave it running); returns the handlers to put back."""
    def forward(sig: int, _frame: object) -> None:
        if proc.poll() is None:
            proc.send_signal(sig)

    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGHUP)}
