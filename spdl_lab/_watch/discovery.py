"""Where published runs are found: the per-user 0700 runtime directory, with a Unix socket and
a discovery file (a ``Discovery`` as JSON) for each."""

from __future__ import annotations

import os
import re
import stat
import tempfile
from pathlib import Path
from typing import Literal

import psutil
from pydantic import Field

from .. import _json
from ..errors import SpdlLabError
from .protocol import Message

__all__ = ["VERSION", "Discovery", "list_endpoints", "pid_alive", "runtime_dir", "safe_name"]

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
