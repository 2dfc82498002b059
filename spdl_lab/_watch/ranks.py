"""Which rank of which data-parallel job this process is, from the environment ``torchrun`` sets
(RANK, LOCAL_RANK, WORLD_SIZE, TORCHELASTIC_RUN_ID), so that every rank's published run carries
its job and a notebook sees the job as one."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from .discovery import safe_name

__all__ = ["JOB_ENV", "RankIdentity", "job_record_path", "rank_identity"]

#: The job id ``spdl-lab watch`` gives what it runs, for a launcher that sets none of its own.
JOB_ENV = "SPDL_LAB_WATCH_JOB"


@dataclass(frozen=True)
class RankIdentity:
    job_id: str
    rank: int
    local_rank: int
    world_size: int

    def run_name(self, name: str) -> str:
        """The rank's run name: ``name-rankR`` (the job's name is ``name``)."""
        suffix = f"-rank{self.rank}"
        return name if name.endswith(suffix) else f"{name}{suffix}"

    def job_name(self, run_name: str) -> str:
        return run_name.removesuffix(f"-rank{self.rank}")

    def facts(self, job_name: str) -> dict[str, str | int]:
        """What a discovery file and a record's meta say of the rank."""
        return {"job": self.job_id, "job_name": job_name, "rank": self.rank, "local_rank": self.local_rank,
                "world_size": self.world_size}


def rank_identity(environ: Mapping[str, str] = os.environ) -> RankIdentity | None:
    """This process's rank, or None outside a multi-process job. The job id: torchrun's
    TORCHELASTIC_RUN_ID, else ``spdl-lab watch``'s own, else the launcher's pid (every rank of a
    job is a child of one torchrun agent)."""
    try:
        rank, world = int(environ["RANK"]), int(environ["WORLD_SIZE"])
        local = int(environ.get("LOCAL_RANK", rank))
    except (KeyError, ValueError):
        return None
    if not 0 <= rank < world:
        return None
    run_id = environ.get("TORCHELASTIC_RUN_ID", "")
    job = run_id if run_id and run_id != "none" else environ.get(JOB_ENV) or f"launcher-{os.getppid()}"
    return RankIdentity(safe_name(job), rank, local, world)


def job_record_path(job_name: str, identity: RankIdentity, override: str | None) -> Path:
    """Where a rank's record goes: ``rankR.sqlite`` in the job's directory, which is ``override``
    (``--record``, ``$SPDL_LAB_RECORD``; a ``.sqlite`` name stands for the folder of its stem) or
    ``spdl_lab_runs/NAME-JOBID``."""
    if override:
        folder = Path(override)
        folder = folder.with_suffix("") if folder.suffix == ".sqlite" else folder
    else:
        folder = Path("spdl_lab_runs") / f"{safe_name(job_name)}-{identity.job_id[:8]}"
    return folder / f"rank{identity.rank}.sqlite"
