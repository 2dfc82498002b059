"""Which rank of which data-parallel job this process is, from the environment ``torchrun`` sets
(RANK, LOCAL_RANK, WORLD_SIZE, TORCHELASTIC_RUN_ID)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

from .discovery import safe_name

__all__ = ["JOB_ENV", "RankIdentity", "rank_identity"]

#: The job id ``spdl-lab watch`` gives what it runs, for a launcher that sets none of its own.
JOB_ENV = "SPDL_LAB_WATCH_JOB"


@dataclass(frozen=True)
class RankIdentity:
    job: str
    rank: int
    local_rank: int
    world_size: int

    def run(self, name: str, override: str | None) -> tuple[str, Path, dict[str, str | int]]:
        """The rank's run name (``name-rankR``; the job's is ``name``), its record (``rankR.sqlite``
        in the job's folder: ``override``, ``--record`` or ``$SPDL_LAB_RECORD``, where a ``.sqlite``
        name stands for the folder of its stem, else ``spdl_lab_runs/NAME-JOBID``), and what a
        discovery file and a record's meta say of it."""
        job_name = name.removesuffix(f"-rank{self.rank}")
        if override:
            folder = Path(override)
            folder = folder.with_suffix("") if folder.suffix == ".sqlite" else folder
        else:
            folder = Path("spdl_lab_runs") / f"{safe_name(job_name)}-{self.job[:8]}"
        facts = {"job_name": job_name, **asdict(self)}
        return f"{job_name}-rank{self.rank}", folder / f"rank{self.rank}.sqlite", facts


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
