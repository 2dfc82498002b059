"""The local endpoint of a published run: a Unix socket that viewers on this host ask for frames,
stats and state, and send ``set_concurrency``; viewers find it by its discovery file (a
``Discovery`` as JSON) beside it in the per-user 0700 runtime directory."""

from __future__ import annotations

import atexit
import contextlib
import datetime
import hashlib
import os
import re
import selectors
import socket
import stat
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import psutil
from pydantic import Field

from .. import _forksafe, _json
from .._telemetry.frames import FrameChunk
from ..errors import SpdlLabError
from . import protocol as wire

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


def safe_name(name: str, limit: int = 64) -> str:
    """``name`` as a file name: letters, digits, ``_.-`` only, at most ``limit`` characters; a longer
    one ends in a digest of the whole, so that ``train-2`` and ``train-3`` stay apart when cut."""
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("._-") or "run"
    if len(safe) <= limit:
        return safe
    return f"{safe[:max(0, limit - 9)]}-{hashlib.blake2s(name.encode(), digest_size=4).hexdigest()}"


def pid_alive(pid: int | str) -> bool:
    """Whether process ``pid`` runs; a zombie (killed, not yet reaped) counts as gone."""
    try:
        return psutil.Process(int(pid)).status() != psutil.STATUS_ZOMBIE
    except (ValueError, psutil.Error):
        return False


class Discovery(wire.Message):
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


def list_endpoints() -> list[dict]:
    """The published runs on this host whose process is alive, oldest first; the files of dead
    processes are removed with their socket, files that do not parse skipped."""
    found = []
    for path in sorted(runtime_dir().glob("*.json")):
        info = None  # unless it is a discovery file we wrote (pydantic's errors are ValueErrors)
        with contextlib.suppress(OSError, ValueError):
            if path.stat().st_size <= 64 * 1024:
                info = Discovery.model_validate(_json.loads(path.read_bytes())).model_dump()
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


THREAD_NAME = "spdl_lab:endpoint"
# sun_path is 108 bytes on Linux and 104 on macOS; stay clear of both.
_MAX_SOCKET_PATH = 99
_CLOSE_WAIT_S = 4.0
_POLL_S = 0.25


@dataclass(frozen=True)
class Handlers:
    """What the publisher answers with, called on the endpoint's threads; an exception one
    raises reaches the viewer as ``"<ExcType>: <message>"``."""

    frames_since: Callable[[int], FrameChunk]
    stats: Callable[[], dict]
    state: Callable[[], str]
    set_concurrency: Callable[[str, int], None]
    controls: Callable[[], dict[str, int]]


class Endpoint(contextlib.AbstractContextManager):
    """Serves ``handlers`` (thread-safe, quick) on ``<runtime_dir>/<name>-<pid>.sock`` until ``close()``
    or the exit, from threads of its own: a viewer is dropped when a message is not whole
    ``request_timeout`` s after its first byte; ``rejected`` counts refused requests (answered with
    a ``Failure``), broken framing (the connection closes) and viewers over ``max_viewers``."""

    def __init__(self, name: str, handlers: Handlers, *, record: str | None = None,
                 runner: str | None = None, max_viewers: int = 16,
                 request_timeout: float = 5.0, job: dict[str, Any] | None = None) -> None:
        self.name = name
        self.handlers: Handlers | None = handlers
        self.runner = runner
        self.max_viewers = max_viewers
        self.request_timeout = request_timeout
        self.pid = os.getpid()
        self._lock = _forksafe.Lock()
        self._stop = threading.Event()
        self.rejected = 0  # malformed messages, unknown ops, bad fields; viewers refused
        self.handler_errors = 0  # requests whose handler raised (answered with the error)
        self._viewers: dict[socket.socket, threading.Thread] = {}

        directory = runtime_dir()
        room = _MAX_SOCKET_PATH - len(os.fsencode(str(directory / f"-{self.pid}.sock")))
        if room < 9:  # a cut name's digest
            raise SpdlLabError(f"the runtime directory {directory} is too long a path for a Unix "
                               f"socket (at most {_MAX_SOCKET_PATH} bytes in all); set "
                               "SPDL_LAB_RUNTIME_DIR to a shorter directory")
        stem = f"{safe_name(name, min(room, 64))}-{self.pid}"
        self.socket_path = directory / f"{stem}.sock"
        self.discovery_path = directory / f"{stem}.json"
        self._listener = self._listen()
        self._wake, self._waker = os.pipe()  # close() writes a byte: the accept loop wakes at once
        try:
            started = datetime.datetime.now(datetime.timezone.utc).isoformat()
            info = Discovery(name=name, pid=self.pid, started=started, socket=str(self.socket_path),
                             record=record, runner=runner, **(job or {}))
            _json.dump_file(info.model_dump(), self.discovery_path, compact=True)  # atomically
        except BaseException:
            self._listener.close()
            self._close_pipe()
            self.socket_path.unlink(missing_ok=True)
            raise
        self._accept_thread = threading.Thread(target=self._accept_loop, name=THREAD_NAME,
                                               daemon=True)
        self._accept_thread.start()
        atexit.register(self.close)

    def _listen(self) -> socket.socket:
        path = self.socket_path
        if path.exists() or path.is_symlink():
            if self._answers(path):
                raise SpdlLabError(f"an endpoint at {path} is already open in this process; "
                                   "close it or publish under another name")
            path.unlink()  # left by an earlier process with this pid
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(str(path))
            os.chmod(path, 0o600)
            listener.listen(self.max_viewers)
            listener.settimeout(_POLL_S)
        except OSError as exc:
            listener.close()
            path.unlink(missing_ok=True)
            raise SpdlLabError(f"cannot listen on {path}: {exc}") from None
        return listener

    @staticmethod
    def _answers(path: Path) -> bool:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.settimeout(1.0)
            return probe.connect_ex(str(path)) == 0

    def _count(self, counter: str) -> None:
        with self._lock:
            setattr(self, counter, getattr(self, counter) + 1)

    def _accept_loop(self) -> None:
        selector = selectors.DefaultSelector()
        try:
            selector.register(self._listener, selectors.EVENT_READ)
            selector.register(self._wake, selectors.EVENT_READ)
            while not self._stop.is_set():
                if not any(key.fileobj is self._listener for key, _ in selector.select(_POLL_S)):
                    continue
                try:
                    conn, _ = self._listener.accept()
                except TimeoutError:
                    continue
                except OSError:
                    if self._stop.is_set():
                        return
                    time.sleep(_POLL_S)  # e.g. out of file descriptors: try again later
                    continue
                self._admit(conn)
        finally:
            selector.close()
            self._listener.close()

    def _admit(self, conn: socket.socket) -> None:
        with self._lock:
            full = len(self._viewers) >= self.max_viewers or self._stop.is_set()
            if not full:
                thread = threading.Thread(target=self._serve, args=(conn,), name=THREAD_NAME,
                                          daemon=True)
                self._viewers[conn] = thread
                thread.start()  # under the lock, so close() never joins an unstarted thread
        if full:
            self._refuse(conn, f"the published run {self.name!r} already has {self.max_viewers} "
                               "viewers; close another viewer and attach again")
            conn.close()

    def _refuse(self, conn: socket.socket, error: str) -> None:
        self._count("rejected")
        with contextlib.suppress(OSError, wire.ProtocolError):
            wire.send_message(conn, wire.Failure(error=error), timeout=1.0)

    def _serve(self, conn: socket.socket) -> None:
        selector = selectors.DefaultSelector()
        try:
            selector.register(conn, selectors.EVENT_READ)
            while not self._stop.is_set():
                if not selector.select(_POLL_S):
                    continue
                try:
                    message = wire.recv_message(conn, wire.MAX_REQUEST_BYTES, self.request_timeout)
                except wire.PeerClosed:
                    return
                except wire.ProtocolError as exc:
                    if not self._stop.is_set():
                        self._refuse(conn, f"{exc}; closing the connection")
                    return
                reply = self._answer(message)
                try:
                    wire.send_message(conn, reply, timeout=self.request_timeout,
                                      limit=wire.MAX_REPLY_BYTES)
                except wire.ProtocolError as exc:
                    if isinstance(exc, wire.MessageTimeout):
                        return  # the viewer stopped reading: drop it
                    wire.send_message(conn, self._failure(exc), timeout=self.request_timeout)
        except (OSError, wire.ProtocolError):
            return
        finally:
            selector.close()
            with self._lock:
                self._viewers.pop(conn, None)
            conn.close()

    def _failure(self, exc: BaseException) -> wire.Failure:
        self._count("handler_errors")
        return wire.Failure(error=f"{type(exc).__name__}: {exc}")

    def _answer(self, message: dict) -> wire.Reply | wire.Failure:
        try:
            request = wire.read_request(message)
        except wire.ProtocolError as exc:  # a bad request: answered, and the connection stays
            self._count("rejected")
            return wire.Failure(error=str(exc))
        try:
            return self._call(request)
        except Exception as exc:  # a handler's failure is the viewer's answer, not ours
            return self._failure(exc)

    def _call(self, request: wire.Request) -> wire.Reply:
        handlers = self.handlers
        match request:
            case wire.Ask(op="hello"):
                return wire.HelloReply(name=self.name, pid=self.pid, runner=self.runner,
                                       version=VERSION)
            case _ if handlers is None:
                raise SpdlLabError("the run's endpoint is closed")
            case wire.Ask(op="stats"):
                return wire.StatsReply(stats=_json.plain(handlers.stats()))  # numpy numbers too
            case wire.Ask(op="state"):
                return wire.StateReply(state=str(handlers.state()))
            case wire.Ask(op="controls"):
                controls = {str(k): int(v) for k, v in handlers.controls().items()}
                return wire.ControlsReply(controls=controls)
            case wire.FramesSince(cursor=cursor):
                return wire.FramesReply(chunk=wire.Chunk.of(handlers.frames_since(cursor)))
            case wire.SetConcurrency(stage=stage, n=n):
                handlers.set_concurrency(stage, n)
                return wire.Reply()
        raise AssertionError(f"no handler for {request!r}")

    def close(self) -> None:
        """Stop serving, drop the viewers, remove the socket and discovery files (idempotent)."""
        if os.getpid() != self.pid:
            # A forked child (a DataLoader worker) shares the script's sockets and files. Checked
            # before the lock, which a fork can copy held by a viewer thread the child lacks.
            return
        with self._lock:
            if self._stop.is_set():
                return
            self._stop.set()
            viewers = dict(self._viewers)
        atexit.unregister(self.close)
        self.discovery_path.unlink(missing_ok=True)  # first, so no new viewer finds it
        self.socket_path.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            os.write(self._waker, b"\0")
        for conn in viewers:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        deadline = time.monotonic() + _CLOSE_WAIT_S
        for thread in [self._accept_thread, *viewers.values()]:
            if thread is not threading.current_thread():
                # A handler stuck forever keeps its daemon thread; we do not wait past this.
                thread.join(max(0.0, deadline - time.monotonic()))
        if not self._accept_thread.is_alive():  # else it may still select on the pipe
            self._close_pipe()
        self.handlers = None  # they hold the run (a DataLoader and its workers): let it go

    def _close_pipe(self) -> None:
        os.close(self._wake)
        os.close(self._waker)

    def __exit__(self, *exc: object) -> None:
        self.close()
