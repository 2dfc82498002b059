"""``lab.attach`` and ``lab.open``: watch a run or job published on this host, or its records."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pandas as pd

from ..errors import PipelineSpecError, SpdlLabError
from .attach import RemoteSession, record_state
from .discovery import list_endpoints
from .job import JobSession, job_entries

__all__ = ["attach", "open_record"]

_COLUMNS = ["name", "pid", "started", "state", "runner", "record", "ranks"]


def attach(name_or_pid: str | int | None = None, timeout: float = 10.0) -> Any:
    """The published runs on this host (a DataFrame, a data-parallel job on one row with its
    ranks), or what watches the one of that name or pid, waiting up to ``timeout`` s for it: a
    ``JobSession`` for a job's name, else a ``RemoteSession`` (a run's name as given to
    ``lab.publish``, or its pid)::

        lab.attach("resnet").dashboard()
    """
    if name_or_pid is None:
        return _listing()
    if isinstance(name_or_pid, bool) or not isinstance(name_or_pid, (str, int)):
        raise PipelineSpecError(f"lab.attach takes a run's (or a job's) name or pid, got {name_or_pid!r}")
    deadline = time.monotonic() + timeout
    while True:
        ranks = job_entries(name_or_pid) if isinstance(name_or_pid, str) else []
        if ranks:
            return JobSession.attach(ranks)
        found = [e for e in list_endpoints() if name_or_pid in (e["name"], e["pid"], str(e["pid"]))]
        if len(found) > 1:
            pids = ", ".join(str(e["pid"]) for e in found)
            raise SpdlLabError(f"lab.attach: {len(found)} published runs are named {name_or_pid!r} "
                               f"(pids {pids}); attach by pid")
        if found:
            return RemoteSession(found[0])
        if time.monotonic() >= deadline:
            names = ", ".join(f"{e['name']} (pid {e['pid']})" for e in list_endpoints()) or "none"
            raise SpdlLabError(f"lab.attach: no published run {name_or_pid!r} appeared within {timeout:g} s, "
                               f"nor a job of that name (published now: {names}); start the script with "
                               f"lab.publish(...) or spdl-lab watch, or pass a longer timeout=")
        time.sleep(0.1)


def _listing() -> pd.DataFrame:
    """A row per published run, and one per job (its name, rank 0's pid, its ranks, its folder)."""
    rows, jobs = [], {}
    for entry in list_endpoints():
        if entry.get("job"):
            jobs.setdefault(entry["job"], []).append(entry)
        else:
            rows.append({**entry, "state": record_state(entry["record"], "running"), "ranks": ""})
    for entries in jobs.values():
        entries.sort(key=lambda e: e["rank"])
        first = entries[0]
        states = {record_state(e["record"], "running") for e in entries}
        folder = str(Path(first["record"]).parent) if first.get("record") else None
        ranks = ",".join(str(e["rank"]) for e in entries)
        rows.append({"name": first.get("job_name") or first["name"], "pid": first["pid"],
                     "started": min(e["started"] for e in entries), "runner": first["runner"],
                     "state": "running" if "running" in states else ", ".join(sorted(states)),
                     "record": folder, "ranks": f"{ranks} of {first.get('world_size') or '?'}"})
    return pd.DataFrame(sorted(rows, key=lambda r: r["started"]), columns=_COLUMNS)


def open_record(path: str | os.PathLike) -> Any:
    """A run's record file as a RemoteSession (read only), live or ended, or a job's record folder
    as a JobSession: ``lab.open("spdl_lab_runs/resnet-4242.sqlite").frames()``."""
    if Path(path).is_dir():
        return JobSession.from_dir(path)
    return RemoteSession.from_record(path)
