"""``lab.attach`` and ``lab.open``: watch a run published on this host, or read its record; the
ranks of a data-parallel job (``torchrun``) as one ``JobSession``, live or from its records."""

from __future__ import annotations

import math
import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from .._telemetry.live_verdict import VERDICT_WINDOW_S, Verdict, judge, rank_window
from .._views import view
from ..errors import PipelineSpecError, SpdlLabError
from .attach import RemoteSession, record_state
from .endpoint import list_endpoints
from .records import record_meta, recorded_steps

#: How often a live job looks for ranks that have published since.
RANKS_EVERY_S = 0.5
_STEP_FIGURES = ("batches_per_s", "step_p50_ms", "data_wait_p50_ms", "data_wait_frac")


class JobSession:
    """A data-parallel job: ``ranks`` maps each rank to its ``RemoteSession``; ``summary()`` has a
    row per rank, ``frames()`` a ``rank`` column; ``verdict()`` names the rank whose loading holds
    the job back (``straggler``), or says the ranks are balanced. A rank that published several
    loops (Lightning's validation and training) is its training loop, the one with the most steps;
    ``runs`` has them all::

        job = lab.attach("train")
        job.verdict()
        job.set_concurrency("load", 8, rank=1)
    """

    def __init__(self, name: str, job_id: str, world_size: int | None, sessions: list[RemoteSession],
                 record: str | None = None) -> None:
        self.name, self.job_id, self.world_size = name, job_id, world_size
        self.record = record  # the job's record folder; None: live, attached
        self._runs: dict[int, list[RemoteSession]] = {}
        for session in sessions:
            self._add(session)
        self._lock = threading.Lock()
        self._looked_at = time.monotonic()

    @classmethod
    def attach(cls, name_or_id: str) -> JobSession | None:
        """The published job named (or with the id) ``name_or_id``, live; None if there is none."""
        found = [e for e in list_endpoints()
                 if e.get("job") and name_or_id in (e.get("job_name"), e["job"])]
        jobs = {e["job"] for e in found}
        if len(jobs) > 1:
            raise SpdlLabError(f"lab.attach: {len(jobs)} published jobs are named {name_or_id!r} "
                               f"(ids {', '.join(sorted(jobs))}); attach by the job's id")
        if not found:
            return None
        first = found[0]
        return cls(first.get("job_name") or first["name"], first["job"], first.get("world_size"),
                   [RemoteSession(e) for e in found])

    @classmethod
    def from_dir(cls, path: str | os.PathLike) -> JobSession:
        """The job whose ranks recorded into the folder ``path`` (``rank0.sqlite``, ...), read only;
        of a job run again into its folder (the same ``--record``), the latest run."""
        folder = Path(path)
        files = sorted(folder.glob("rank*.sqlite"), key=lambda f: (len(f.name), f.name))  # rank0, then rank0-2
        if not files:
            raise SpdlLabError(f"{folder} holds no rank records (rank0.sqlite, ...); give the job's record "
                               f"folder, as `spdl-lab watch --record DIR -- torchrun ...` writes it")
        metas = {file: record_meta(file) for file in files}
        for file, meta in metas.items():
            if not meta.get("rank", "").isdigit():
                raise SpdlLabError(f"{file} is not a rank's record (its meta names no rank); open it "
                                   f"with lab.open({str(file)!r}) on its own")
        latest = max(metas.values(), key=lambda meta: meta.get("started", ""))
        files = [file for file, meta in metas.items() if meta.get("job") == latest.get("job")]
        world = latest.get("world_size", "")
        return cls(latest.get("job_name") or folder.name, latest.get("job", folder.name),
                   int(world) if world.isdigit() else None, [RemoteSession.from_record(f) for f in files],
                   str(folder))

    @property
    def ranks(self) -> dict[int, RemoteSession]:
        """Each rank's RemoteSession, its training loop, lowest rank first (a live job adds ranks
        as they publish)."""
        return {rank: runs[0] if len(runs) == 1 else max(runs, key=_steps) for rank, runs in self.runs.items()}

    @property
    def runs(self) -> dict[int, list[RemoteSession]]:
        """Each rank's published runs, in the order they started."""
        self._look_for_runs()
        return {rank: list(runs) for rank, runs in self._runs.items()}

    def _add(self, session: RemoteSession) -> None:
        runs = dict(self._runs)  # a new dict: readers iterate the old one without the lock
        runs[session.rank] = [*runs.get(session.rank, []), session]
        self._runs = dict(sorted(runs.items()))

    def _look_for_runs(self) -> None:
        if self.record is not None or time.monotonic() - self._looked_at < RANKS_EVERY_S:
            return
        with self._lock:
            self._looked_at = time.monotonic()
            known = {(s.pid, s.name) for runs in self._runs.values() for s in runs}
            for entry in list_endpoints():
                if entry.get("job") == self.job_id and (entry["pid"], entry["name"]) not in known:
                    self._add(RemoteSession(entry))

    @property
    def states(self) -> dict[int, str]:
        return {rank: session.state for rank, session in self.ranks.items()}

    @property
    def state(self) -> str:
        """"running" while any rank runs; else ``"finished"`` or ``"0 stopped, 1 killed"``."""
        states = self.states
        if any(s == "running" for s in states.values()) or not states:
            return "running"
        ends = set(states.values())
        return ends.pop() if len(ends) == 1 else ", ".join(f"{r} {s}" for r, s in states.items())

    @property
    def running(self) -> bool:
        return self.state == "running"

    def summary(self) -> pd.DataFrame:
        """One row per rank: its state, its steps' figures, and each loader stage's items/s."""
        rows = []
        for rank, session in self.ranks.items():
            snap = session.stats()
            step = snap.step.to_dict() if snap.step is not None else {}
            row = {"rank": rank, "name": session.name, "pid": session.pid, "state": session.state,
                   "runner": session.runner, "steps": step.get("steps", 0),
                   **{k: step.get(k, math.nan) for k in _STEP_FIGURES}}
            row.update({f"{name} items/s": stage.qps_avg for name, stage in snap.stages.items()})
            rows.append(row)
        return pd.DataFrame(rows).set_index("rank") if rows else pd.DataFrame()

    def frames(self) -> pd.DataFrame:
        """Every rank's ticks so far, long format with a ``rank`` column first."""
        parts = [session.frames().assign(rank=rank) for rank, session in self.ranks.items()]
        if not parts:
            return pd.DataFrame(columns=["rank", "time_s", "series", "stage", "value"])
        frame = pd.concat(parts, ignore_index=True)
        return frame[["rank", *(c for c in frame.columns if c != "rank")]]

    def judge(self, window_s: float = VERDICT_WINDOW_S) -> Verdict:
        """The verdict over each rank's latest ``window_s`` seconds, with its kind and straggler."""
        windows = [rank_window(session.recent(window_s), rank, session.state, window_s)
                   for rank, session in self.ranks.items()]
        return judge(windows, self.world_size)

    def verdict(self) -> str:
        """The current verdict, a sentence: which rank's loading holds the job back, or balanced."""
        return self.judge().text

    @property
    def straggler(self) -> int | None:
        """The rank whose loading holds the job back now, or None."""
        return self.judge().straggler

    def controls(self) -> dict[int, dict[str, int]]:
        return {rank: session.controls() for rank, session in self.ranks.items()}

    def set_concurrency(self, stage: str, n: int, rank: int | None = None) -> None:
        """Set ``stage``'s concurrency on every rank, or on ``rank`` alone (a lab.Loader's stage)."""
        ranks = self.ranks
        if rank is not None and rank not in ranks:
            raise PipelineSpecError(f"set_concurrency: the job {self.name!r} has no rank {rank!r}; its ranks "
                                    f"are {', '.join(map(str, ranks))}")
        for r in [rank] if rank is not None else list(ranks):
            try:
                ranks[r].set_concurrency(stage, n)
            except SpdlLabError as exc:
                raise type(exc)(f"rank {r}: {exc}") from exc

    def dashboard(self, **options: Any) -> Any:
        return view("job_dashboard")(self, **options)

    def to_html(self, path: str | os.PathLike) -> Any:
        """The job's records as one self-contained HTML page (as ``spdl-lab report DIR``)."""
        return view("job_report")(self, path)

    def close(self, timeout: float = 5.0) -> None:
        """Stop watching every rank (the job goes on)."""
        for session in [s for runs in self._runs.values() for s in runs]:
            session.close(timeout)

    stop = close

    def __repr__(self) -> str:
        states = ", ".join(f"{r}: {s}" for r, s in self.states.items())
        return f"JobSession({self.name!r}, job={self.job_id!r}, world_size={self.world_size}, ranks={{{states}}})"


def _steps(session: RemoteSession) -> float:
    """How many steps a run made, by its latest tick (a killed run's stats went with it)."""
    counts = session.recent(0).columns.get(("steps", "step"))
    return float(np.nanmax(counts)) if counts is not None and not np.isnan(counts).all() else 0.0


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
        job = JobSession.attach(name_or_pid) if isinstance(name_or_pid, str) else None
        if job is not None:
            return job
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
    """A row per published run, and one per job (its name, rank 0's pid, its ranks, its folder);
    ``steps``: those recorded so far (a job's: its slowest rank's, in the run of most steps)."""
    rows, jobs = [], {}
    for entry in list_endpoints():
        if entry.get("job"):
            jobs.setdefault(entry["job"], []).append(entry)
        else:
            rows.append({**entry, "state": record_state(entry["record"], "running"), "ranks": "",
                         "steps": recorded_steps(entry.get("record"))})
    for entries in jobs.values():
        entries.sort(key=lambda e: e["rank"])
        first = entries[0]
        states = {record_state(e["record"], "running") for e in entries}
        folder = str(Path(first["record"]).parent) if first.get("record") else None
        ranks = ",".join(str(r) for r in sorted({e["rank"] for e in entries}))
        steps: dict[int, int] = {}
        for e in entries:
            steps[e["rank"]] = max(steps.get(e["rank"], 0), recorded_steps(e.get("record")))
        rows.append({"name": first.get("job_name") or first["name"], "pid": first["pid"],
                     "steps": min(steps.values()), "started": min(e["started"] for e in entries),
                     "runner": first["runner"],
                     "state": "running" if "running" in states else ", ".join(sorted(states)),
                     "record": folder, "ranks": f"{ranks} of {first.get('world_size') or '?'}"})
    return pd.DataFrame(sorted(rows, key=lambda r: r["started"]),
                        columns=["name", "pid", "started", "state", "steps", "runner", "record", "ranks"])


def open_record(path: str | os.PathLike) -> Any:
    """A run's record file as a RemoteSession (read only), live or ended, or a job's record folder
    as a JobSession: ``lab.open("spdl_lab_runs/resnet-4242.sqlite").frames()``."""
    return JobSession.from_dir(path) if Path(path).is_dir() else RemoteSession.from_record(path)
