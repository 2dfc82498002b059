"""The wire format between a published run and its viewers: length-prefixed JSON.

A message is a 4-byte big-endian length and that many bytes of UTF-8 JSON, always
an object. No pickle: whatever arrives is data, checked before it is used.
"""

from __future__ import annotations

import json
import math
import socket
import struct
import time
from typing import Any

import numpy as np

from ..errors import SpdlLabError
from ..telemetry.frames import FrameChunk

__all__ = [
    "MAX_REQUEST_BYTES",
    "MAX_REPLY_BYTES",
    "ProtocolError",
    "PeerClosed",
    "MessageTimeout",
    "send_message",
    "recv_message",
    "encode_message",
    "decode_message",
    "chunk_to_json",
    "chunk_from_json",
]

MAX_REQUEST_BYTES = 64 * 1024
MAX_REPLY_BYTES = 64 * 2**20

_HEADER = struct.Struct(">I")


class ProtocolError(SpdlLabError):
    """A message broke the framing or the JSON rules; the message says which."""


class PeerClosed(ProtocolError):
    """The other side closed the connection between two messages (a clean end)."""


class MessageTimeout(ProtocolError, TimeoutError):
    """A message did not arrive, or could not be sent, within its timeout."""


def _plain(value: Any, where: str) -> Any:
    """``value`` with NaN/inf floats as None and numpy scalars/arrays as Python values."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, np.generic):
        return _plain(value.item(), where)
    if isinstance(value, np.ndarray):
        return _plain(value.tolist(), where)
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise ProtocolError(
                    f"cannot send {where}: key {key!r} is a {type(key).__name__}; "
                    "JSON object keys must be strings"
                )
            out[key] = _plain(item, f"{where}.{key}")
        return out
    if isinstance(value, (list, tuple)):
        return [_plain(item, f"{where}[{i}]") for i, item in enumerate(value)]
    raise ProtocolError(
        f"cannot send {where}: a {type(value).__name__} is not JSON; "
        "send numbers, strings, lists and dicts only"
    )


def encode_message(obj: dict) -> bytes:
    """The bytes of one message (header and body) for the dict ``obj``."""
    if not isinstance(obj, dict):
        raise ProtocolError(f"a message must be a dict, not a {type(obj).__name__}")
    body = json.dumps(
        _plain(obj, "the message"), allow_nan=False, ensure_ascii=False, separators=(",", ":")
    ).encode("utf-8")
    if len(body) > 0xFFFFFFFF:
        raise ProtocolError(f"a message of {len(body)} bytes does not fit the 4-byte length")
    return _HEADER.pack(len(body)) + body


def _refuse_constant(token: str) -> Any:
    raise ValueError(f"{token} is not JSON (send null for a missing number)")


def _strict_object(pairs: list[tuple[str, Any]]) -> dict:
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"the key {key!r} appears twice in one object")
        out[key] = value
    return out


def decode_message(body: bytes) -> dict:
    """The dict in a message body; ProtocolError if it is not UTF-8 JSON of an object."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ProtocolError(f"the message is not valid UTF-8 ({exc.reason} at byte {exc.start})") from None
    try:
        obj = json.loads(text, parse_constant=_refuse_constant, object_pairs_hook=_strict_object)
    except (ValueError, RecursionError) as exc:
        raise ProtocolError(f"the message is not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise ProtocolError(
            f"the message is a JSON {type(obj).__name__}; send a JSON object such as "
            '{"op": "hello"}'
        )
    return obj


def send_message(sock: socket.socket, obj: dict, *, timeout: float | None = None,
                 limit: int | None = None) -> None:
    """Send ``obj`` as one message; ``limit`` caps the body size, ``timeout`` the whole send."""
    data = encode_message(obj)
    if limit is not None and len(data) - _HEADER.size > limit:
        raise ProtocolError(
            f"the message is {len(data) - _HEADER.size} bytes, over the limit of {limit} bytes"
        )
    if timeout is not None:
        sock.settimeout(timeout)
    try:
        sock.sendall(data)
    except TimeoutError:
        raise MessageTimeout(f"could not send a message within {timeout} s") from None


def _recv_exactly(sock: socket.socket, size: int, deadline: float, *, first: bool,
                  timeout: float) -> bytes:
    buf = bytearray(size)
    view = memoryview(buf)
    got = 0
    while got < size:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise MessageTimeout(
                f"a message did not arrive within {timeout} s ({got} of {size} bytes read)"
            )
        sock.settimeout(remaining)
        try:
            n = sock.recv_into(view[got:], min(size - got, 1 << 20))
        except TimeoutError:
            continue
        if n == 0:
            if first and got == 0:
                raise PeerClosed("the connection was closed")
            raise ProtocolError(
                f"the message is truncated: the connection closed after {got} of {size} bytes"
            )
        got += n
    return bytes(buf)


def recv_message(sock: socket.socket, limit: int, timeout: float) -> dict:
    """Read one message within ``timeout`` seconds; its body may be at most ``limit`` bytes.

    Raises PeerClosed on a clean end before the message, MessageTimeout when it
    does not arrive in time, and ProtocolError for anything malformed.
    """
    deadline = time.monotonic() + timeout
    (size,) = _HEADER.unpack(_recv_exactly(sock, _HEADER.size, deadline, first=True,
                                           timeout=timeout))
    if size > limit:
        raise ProtocolError(
            f"the message says it is {size} bytes, over the limit of {limit} bytes; "
            "send smaller messages"
        )
    return decode_message(_recv_exactly(sock, size, deadline, first=False, timeout=timeout))


def _nullable(values: np.ndarray) -> list:
    values = np.asarray(values, dtype=np.float64)
    out = values.tolist()
    if not np.isfinite(values).all():
        for i in np.flatnonzero(~np.isfinite(values)).tolist():
            out[i] = None
    return out


def chunk_to_json(chunk: FrameChunk) -> dict:
    """A FrameChunk as plain JSON values (NaN as null)."""
    return {
        "cursor": int(chunk.cursor),
        "times": _nullable(chunk.times),
        "columns": [
            {"series": series, "stage": stage, "values": _nullable(values)}
            for (series, stage), values in chunk.columns.items()
        ],
    }


def _floats(values: Any, where: str, length: int | None) -> np.ndarray:
    if not isinstance(values, list):
        raise ProtocolError(f"{where} must be a list of numbers or null, not {type(values).__name__}")
    if length is not None and len(values) != length:
        raise ProtocolError(f"{where} has {len(values)} values; the chunk has {length} times")
    for i, value in enumerate(values):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ProtocolError(f"{where}[{i}] is {value!r}; expected a number or null")
    return np.array([np.nan if v is None else float(v) for v in values], dtype=np.float64)


def chunk_from_json(data: Any) -> FrameChunk:
    """The FrameChunk in ``data`` (as made by chunk_to_json), checked field by field."""
    if not isinstance(data, dict):
        raise ProtocolError(f"a frame chunk must be an object, not {type(data).__name__}")
    if set(data) != {"cursor", "times", "columns"}:
        raise ProtocolError(
            f"a frame chunk has the fields cursor, times, columns; got {sorted(data)}"
        )
    cursor = data["cursor"]
    if isinstance(cursor, bool) or not isinstance(cursor, int) or cursor < 0:
        raise ProtocolError(f"chunk.cursor is {cursor!r}; expected an integer >= 0")
    times = _floats(data["times"], "chunk.times", None)
    if not isinstance(data["columns"], list):
        raise ProtocolError("chunk.columns must be a list of {series, stage, values} objects")
    columns: dict[tuple[str, str], np.ndarray] = {}
    for i, column in enumerate(data["columns"]):
        where = f"chunk.columns[{i}]"
        if not isinstance(column, dict) or set(column) != {"series", "stage", "values"}:
            raise ProtocolError(f"{where} must be an object with series, stage and values")
        series, stage = column["series"], column["stage"]
        if not isinstance(series, str) or not isinstance(stage, str):
            raise ProtocolError(f"{where}: series and stage must be strings")
        if (series, stage) in columns:
            raise ProtocolError(f"{where}: ({series!r}, {stage!r}) appears twice")
        columns[(series, stage)] = _floats(column["values"], f"{where}.values", len(times))
    return FrameChunk(cursor, times, columns)
