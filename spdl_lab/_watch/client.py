"""A viewer's side of a published run's endpoint."""

from __future__ import annotations

import os
import socket
import threading
from typing import Any

from ..errors import SpdlLabError
from . import protocol as wire

__all__ = ["EndpointClient"]


class EndpointClient:
    """A viewer's connection to a published run; ``request`` raises SpdlLabError on any failure:
    ``EndpointClient(list_endpoints()[0]["socket"]).request("state").state``."""

    def __init__(self, socket_path: str | os.PathLike, timeout: float = 5.0) -> None:
        self.socket_path = str(socket_path)
        self.timeout = timeout
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._connect()

    def _connect(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self.socket_path)
        except OSError as exc:
            sock.close()
            raise self._failure("connecting", exc) from None
        self._sock = sock
        return sock

    def request(self, op: str, **fields: Any) -> Any:
        """Send ``{"op": op, **fields}``; the reply, checked, as its model (``REQUESTS[op][1]``)."""
        with self._lock:
            sock = self._sock or self._connect()
            try:
                try:
                    wire.send_message(sock, {"op": op, **fields}, timeout=self.timeout,
                                      limit=wire.MAX_REQUEST_BYTES)
                except ConnectionError:
                    # The endpoint may have closed after saying why (too many viewers):
                    # that reply is still ours to read.
                    message = wire.recv_message(sock, wire.MAX_REPLY_BYTES, min(self.timeout, 1.0))
                    self._drop()
                else:
                    message = wire.recv_message(sock, wire.MAX_REPLY_BYTES, self.timeout)
                reply = wire.read_reply(op, message)
            except (wire.ProtocolError, OSError) as exc:
                self._drop()  # after a timeout, a late reply would be read as the next one's
                raise self._failure(f"request {op!r}", exc) from None
        if isinstance(reply, wire.Failure):
            raise SpdlLabError(reply.error)
        return reply

    def _failure(self, doing: str, exc: Exception) -> SpdlLabError:
        run = f"the published run {self.socket_path}"
        if isinstance(exc, (wire.PeerClosed, ConnectionError, FileNotFoundError)):
            return SpdlLabError(f"{run} is gone (the script ended or was killed)")
        if isinstance(exc, wire.MessageTimeout):
            return SpdlLabError(f"{doing}: no reply from {run} within {self.timeout} s; it may be busy: "
                                "try again, or use a longer timeout")
        return SpdlLabError(f"{doing}: talking to {run} failed: {exc}")

    def _drop(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def close(self) -> None:
        with self._lock:
            self._drop()

    def __enter__(self) -> EndpointClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
