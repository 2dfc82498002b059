"""Where published runs are found: the per-user 0700 runtime directory, with a Unix socket and
a discovery file (a ``Discovery`` as JSON) for each; and which rank of which data-parallel job
this process is, from the environment ``torchrun`` sets (RANK, LOCAL_RANK, WORLD_SIZE,
TORCHELASTIC_RUN_ID)."""

from __future__ import annotations

import os
import re
import stat
import tempfile
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import psutil
from pydantic import Field

from .. import _json
from ..errors import SpdlLabError
from .protocol import Message

VERSION = 1


def runtime_dir() -> Path:
    """The per-user directory for sockets and discovery files, mode 0700: ``$SPDL_LAB_RUNTIME_DIR``,
    else ``$XDG_RUNTIME_DIR/spdl_lab`` if writable, else ``<tempdir>/spdl_lab-<uid>``."""
    override = os.environ.get("SPDL_LAB_RUNTIME_DIR")
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if override:
        path = Path(override)
    elif xdg and os.path.isdir(xdg) and os.access(xdg, os.W_OK | os.X_OK):
        path = Path(xdg) / "spdl_lab"
    else:
        path = Path(tempfile.gettempdir()) / f"spdl_lab-{os.getuid()}"
    try:
        path.mkdir(mode=0o700, parents=True)
        os.chmod(path, 0o700)  # mkdir's mode is reduced by the umask
    except FileExistsError:
        pass
    except OSError as exc:
        raise SpdlLabError(f"cannot create the runtime directory {path}: {exc.strerror}; "
                           "set SPDL_LAB_RUNTIME_DIR to a directory you can write") from None
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode):
        problem = "is not a directory"
    elif info.st_uid != os.getuid():
        problem = f"belongs to uid {info.st_uid}, not you (uid {os.getuid()})"
    elif stat.S_IMODE(info.st_mode) != 0o700:
        problem = f"has mode {stat.S_IMODE(info.st_mode):o}, not 700"
    else:
        return path
    raise SpdlLabError(f"the runtime directory {path} {problem}, so other users could reach the "
                       f"published runs in it; remove it, or if it is yours run `chmod 700 {path}`")


def safe_name(name: str) -> str:
    """``name`` as a file name: letters, digits, ``_.-`` only, at most 64 characters."""
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("._-")
    return safe[:64] or "run"


def pid_alive(pid: int | str) -> bool:
    """Whether process ``pid`` runs; a zombie (killed, not yet reaped) counts as gone."""
    try:
        return psutil.Process(int(pid)).status() != psutil.STATUS_ZOMBIE
    except (ValueError, psutil.Error):
        return False


class Discovery(Message):
    name: str
    pid: int = Field(gt=0)
    started: str
    socket: str
    record: str | None
    runner: str | None
    version: Literal[VERSION] = VERSION
    # a rank of a data-parallel job: the job's id and name, rank, local rank, ranks in all
    job: str | None = None
    job_name: str | None = None
    rank: int | None = Field(default=None, ge=0)
    local_rank: int | None = Field(default=None, ge=0)
    world_size: int | None = Field(default=None, gt=0)


def _read_discovery(path: Path) -> dict | None:
    """The discovery file's fields, or None if it is not one we wrote."""
    try:
        if path.stat().st_size > 64 * 1024:
            return None
        return Discovery.model_validate(_json.loads(path.read_bytes())).model_dump()
    except (OSError, ValueError):  # pydantic's ValidationError is a ValueError
        return None


def list_endpoints() -> list[dict]:
    """The published runs on this host whose process is alive, oldest first; the files of dead
    processes are removed with their socket, files that do not parse skipped."""
    found = []
    for path in sorted(runtime_dir().glob("*.json")):
        info = _read_discovery(path)
        named = re.search(r"-(\d+)\.json$", path.name)  # the pid in the name, if the file is no use
        pid = info["pid"] if info is not None else int(named.group(1)) if named else None
        if pid is not None and not pid_alive(pid):
            # Only the socket beside it, never a path the file names: the file is data.
            path.with_suffix(".sock").unlink(missing_ok=True)
            path.unlink(missing_ok=True)
            continue
        if info is not None:
            found.append(info)
    return sorted(found, key=lambda info: info["started"])


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
