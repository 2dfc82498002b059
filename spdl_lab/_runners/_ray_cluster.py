"""The Ray instance a ``ray`` runner uses: one the lab starts on this host (shut down when the last
runner using it closes), or a cluster it joins (left running)."""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

import psutil

from ..errors import PipelineSpecError, RunnerError

_LOCK = threading.Lock()
#: The local instance the lab started in this process, and how many runners use it.
_LOCAL: dict[str, Any] = {"users": 0, "temp_dir": None, "core": [], "parked": [], "warden": None}
#: The processes a local instance cannot run without.
_CORE_NAMES = ("gcs_server", "raylet")
#: Ray process names (``ray::IDLE``, ``raylet``, ``gcs_server``, ...) among this process's children.
_RAY_NAMES = ("raylet", "gcs_server", "ray::", "dashboard", "runtime_env", "log_monitor", "monitor.py",
              "default_worker", "ray_client_server")


def ray_processes() -> list[psutil.Process]:
    """This process's descendants that belong to a Ray instance: workers (``ray::...``) and the
    programs of this install's ray package. Another program whose command line only holds Ray's
    names (a user's ``monitor.py``) is not counted: a compare would take its CPU for idle Ray's."""
    spec = importlib.util.find_spec("ray")
    if spec is None or not spec.submodule_search_locations:
        return []  # no ray here: none of ours can be Ray's
    package = spec.submodule_search_locations[0]
    out = []
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            text = " ".join(child.cmdline())
            ray_program = package in text or not text  # no command line: exited, not yet reaped
            if text.startswith("ray::") or (ray_program and any(name in (text or child.name())
                                                                for name in _RAY_NAMES)):
                out.append(child)
    return out


class RayConnection:
    """Opens (or joins) a Ray instance for one runner; ``close()`` undoes exactly what ``open()`` did."""

    def __init__(self, address: str | None, init_kwargs: dict[str, Any] | None) -> None:
        if address is not None and not isinstance(address, str):
            raise PipelineSpecError(f"ray runner: address must be None, 'auto' or 'ray://host:port', got {address!r}")
        if init_kwargs is not None and not isinstance(init_kwargs, dict):
            raise PipelineSpecError(f"ray runner: ray_init_kwargs must be a dict, got {type(init_kwargs).__name__}")
        self.address = address
        self.init_kwargs = dict(init_kwargs or {})
        self.role = "none"  # "local" (ours, shared), "joined" (a cluster), "user" (the user's own)

    def open(self) -> None:
        import ray

        with _LOCK:
            if ray.is_initialized():
                self.role = "local" if _LOCAL["users"] > 0 else "user"
                if self.role == "local":
                    _LOCAL["users"] += 1
                    _resume()  # parked by its one user until now: this one must not wait on it
                return
            if self.address is None:
                self._start_local(ray)
                self.role = "local"
                _LOCAL["users"] = 1
            else:
                self._join(ray)
                self.role = "joined"

    def _join(self, ray: Any) -> None:
        """Connect as a driver; to a cluster on this host in Ray's single-machine mode, as it was
        started (else Ray looks for the cluster at this node's outside address)."""
        options = dict(log_to_driver=False, logging_level=logging.WARNING, configure_logging=False)
        options.update(self.init_kwargs)
        here = _on_this_host(self.address)
        _check_listening(self.address)
        try:
            with _initializing(ray, loopback=here):
                if here and "RAY_AUTH_MODE" not in os.environ:
                    # As ray.init does for "auto" alone: a cluster on this host, started by this
                    # user, takes this user's token (~/.ray/auth_token) when there is one.
                    from ray._private.authentication import authentication_token_setup as auth

                    auth.maybe_enable_token_auth_if_token_available(warn_if_disabled=False)
                ray.init(address=self.address, **options)
        except Exception as exc:
            with contextlib.suppress(Exception):
                ray.shutdown()
            text = f"{type(exc).__name__}: {exc}"
            hint = (" The cluster wants a token: run where `ray start` ran (its token is "
                    "~/.ray/auth_token), or set RAY_AUTH_TOKEN (or RAY_AUTH_TOKEN_PATH) to the "
                    "cluster's; `ray get-auth-token` prints it there."
                    if "auth" in text.lower() or "token" in text.lower() else "")
            raise RunnerError(f"ray runner: could not join the Ray cluster at {self.address!r}: {text}.{hint} "
                              f"Check the address and that the cluster runs ray {ray.__version__}") from exc

    def _start_local(self, ray: Any) -> None:
        # A short path: Ray's Unix sockets live under it, and socket paths are limited to 107 bytes.
        temp_dir = tempfile.mkdtemp(prefix="spdlray", dir="/tmp")
        # Workers import what this process imports (functions travel by reference), through the
        # raylet's environment: a runtime_env costs every worker seconds of set-up.
        path = os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))
        options = dict(num_cpus=psutil.cpu_count() or 1, include_dashboard=False, _temp_dir=temp_dir,
                       log_to_driver=False, logging_level=logging.WARNING, configure_logging=False)
        options.update(self.init_kwargs)
        try:
            with _initializing(ray, loopback=True, PYTHONPATH=path):
                ray.init(**options)
        except Exception as exc:
            shutil.rmtree(temp_dir, ignore_errors=True)
            raise RunnerError(f"ray runner: could not start a local Ray instance: {type(exc).__name__}: "
                              f"{exc}") from exc
        _LOCAL["temp_dir"] = temp_dir
        _LOCAL["core"] = [p for p in ray_processes() if any(n in p.name() for n in _CORE_NAMES)]
        _tell_warden(_instance_processes())

    def park(self, parked: bool) -> None:
        """Stop the lab's local instance (SIGSTOP), or resume it: idle, it still polls, noise in a
        compare. Only while this runner is its one user; the warden ends it if this process dies."""
        with _LOCK:
            if self.role != "local":
                return
            if not parked:
                _resume()
            elif _LOCAL["users"] == 1 and not _LOCAL["parked"]:
                _LOCAL["parked"] = _stop_all()

    def lost(self) -> str | None:
        """What of the lab's local instance (GCS, raylet) has died, or None."""
        for proc in _LOCAL["core"] if self.role == "local" else ():
            if not _alive(proc):
                return f"{proc.name()} (pid {proc.pid}) of the local Ray instance exited"
        return None

    def close(self, timeout: float = 5.0) -> None:
        import ray

        role, self.role = self.role, "none"
        with _LOCK:
            if role == "joined":
                ray.shutdown()  # disconnects this driver; the cluster goes on
            if role != "local":
                return
            _LOCAL["users"] -= 1
            if _LOCAL["users"] > 0:
                return
            _resume()
            temp_dir, _LOCAL["temp_dir"], _LOCAL["core"] = _LOCAL["temp_dir"], None, []
            ray.shutdown()
        _reap(timeout, temp_dir)
        with _LOCK:
            _tell_warden([])
            warden, _LOCAL["warden"] = _LOCAL["warden"], None
        if warden is not None:
            warden.stdin.close()
            with contextlib.suppress(subprocess.TimeoutExpired):
                warden.wait(timeout)
        shutil.rmtree(temp_dir, ignore_errors=True)


#: The local instance's warden, a small child told its pids (a line each time, empty once shut
#: down): it kills those still Ray's when this process dies (its pipe closes, or it is reparented).
#: Ray's agents would outlive a killed driver, and a parked (stopped) instance would stay so.
_WARDEN = """import os, select, signal
signal.signal(signal.SIGINT, signal.SIG_IGN)
parent, pids, buf = os.getppid(), [], b""
while os.getppid() == parent:
    if select.select([0], [], [], 1.0)[0]:
        chunk = os.read(0, 65536)
        if not chunk:
            break
        *lines, buf = (buf + chunk).split(b"\\n")
        pids = lines[-1].split() if lines else pids
for pid in pids:
    try:
        with open(f"/proc/{int(pid)}/cmdline", "rb") as f:
            if b"ray" in f.read():
                os.kill(int(pid), signal.SIGKILL)
    except OSError:
        pass
"""


def _tell_warden(procs: list[psutil.Process]) -> None:
    """Give the warden the instance's processes (under ``_LOCK``), starting it the first time."""
    if _LOCAL["warden"] is None:
        if not procs:
            return
        _LOCAL["warden"] = subprocess.Popen([sys.executable, "-S", "-c", _WARDEN], stdin=subprocess.PIPE,
                                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with contextlib.suppress(OSError):  # the warden gone: nothing to tell
        _LOCAL["warden"].stdin.write(" ".join(str(p.pid) for p in procs).encode() + b"\n")
        _LOCAL["warden"].stdin.flush()


def _instance_processes() -> list[psutil.Process]:
    """The local instance's processes (under ``_LOCK``): our children started in its temporary
    directory (GCS, raylet, monitors) and their descendants; never another, whatever its name."""
    found = []
    for child in psutil.Process().children():
        with contextlib.suppress(psutil.Error):
            if _LOCAL["temp_dir"] and _LOCAL["temp_dir"] in " ".join(child.cmdline()):
                found += [child, *child.children(recursive=True)]
    return found


def _stop_all() -> list[psutil.Process]:
    """SIGSTOP the local instance's processes (under ``_LOCK``), and those the raylet starts
    meanwhile, until all are stopped or 1 s has passed."""
    stopped: dict[int, psutil.Process] = {}
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        new = [p for p in _instance_processes() if p.pid not in stopped]
        if new:
            _tell_warden([*stopped.values(), *new])
        for p in new:
            with contextlib.suppress(psutil.Error):
                p.suspend()
                stopped[p.pid] = p
        if not new and all(_status(p) in (psutil.STATUS_STOPPED, None) for p in stopped.values()):
            break
        time.sleep(0.01)
    return list(stopped.values())


def _status(proc: psutil.Process) -> str | None:
    with contextlib.suppress(psutil.Error):
        return proc.status()
    return None


def _alive(proc: psutil.Process) -> bool:
    return proc.is_running() and _status(proc) not in (psutil.STATUS_ZOMBIE, None)


def _resume() -> None:
    """Resume a stopped local instance (under ``_LOCK``)."""
    for p in _LOCAL["parked"]:
        with contextlib.suppress(psutil.Error):
            p.resume()
    _LOCAL["parked"] = []


#: Ray's single-machine switch (macOS, Windows): the node is 127.0.0.1 and its servers listen on
#: loopback only. On Linux Ray would take its outside address and listen on every interface.
_LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


@contextlib.contextmanager
def _initializing(ray: Any, loopback: bool, **extra: str) -> Iterator[None]:
    """While ``ray.init`` runs, then as before: no token-auth banner (the lab keeps auth on), no
    note that Ray set no SIGTERM handler (a run starts Ray off the main thread, and the user's own
    handler is the one to keep); on ``loopback``, ``_LOOPBACK_ENV`` and ``extra`` in the
    environment, Ray's loopback switch on."""
    from ray._private import ray_constants

    banner = logging.getLogger("ray._private.authentication.authentication_token_setup")
    worker = logging.getLogger("ray._private.worker")
    env = {**_LOOPBACK_ENV, **extra} if loopback else {}
    saved = {k: os.environ.get(k) for k in env}
    level, switch = banner.level, ray_constants.ENABLE_RAY_CLUSTER
    banner.setLevel(logging.ERROR)
    worker.addFilter(_no_sigterm_note)
    os.environ.update(env)
    ray_constants.ENABLE_RAY_CLUSTER = switch and not loopback
    try:
        yield
    finally:
        banner.setLevel(level)
        worker.removeFilter(_no_sigterm_note)
        ray_constants.ENABLE_RAY_CLUSTER = switch
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _no_sigterm_note(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith("SIGTERM handler is not set")


def _check_listening(address: str) -> None:
    """A GCS address (host:port) nobody listens at fails now, not after Ray's minute of retries."""
    if address == "auto" or address.startswith("ray://") or ":" not in address:
        return
    host, port = address.rsplit(":", 1)
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=5.0).close()
    except (OSError, ValueError) as exc:
        raise RunnerError(f"ray runner: could not join the Ray cluster at {address!r}: nothing answers there "
                          f"({exc.strerror or exc}). Check the address (`ray status` on the head node "
                          f"prints it) and that the cluster is running") from None


def _on_this_host(address: str) -> bool:
    """"auto" (``ray start``'s own cluster) or a loopback address; never a client's ``ray://``."""
    if address.startswith("ray://"):
        return False
    host = address.rsplit(":", 1)[0].strip("[]")
    return address == "auto" or host in ("localhost", "::1") or host.startswith("127.")


def _reap(timeout: float, temp_dir: str) -> None:
    """Wait for the instance's processes to exit, then kill the rest; orphans (workers the raylet
    was starting: they would wait for it) are found by ``temp_dir`` and killed first."""
    ours = {os.getpid(), *(p.pid for p in psutil.Process().children(recursive=True))}
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if proc.pid not in ours and any(temp_dir in part for part in proc.cmdline()):
                proc.kill()
    deadline = time.monotonic() + timeout
    left = ray_processes()
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = [p for p in left if _alive(p)]
    for p in left:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    psutil.wait_procs(left, timeout=1.0)
