"""The wire format between a published run and its viewers: a 4-byte big-endian length, then
that many bytes of strict UTF-8 JSON (never pickle) of one of the pydantic models below."""

from __future__ import annotations

import socket
import struct
import time
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .. import _json
from .._pipeline import MAX_CONCURRENCY
from .._telemetry.frames import FrameChunk
from ..errors import SpdlLabError

MAX_REQUEST_BYTES = 64 * 1024
MAX_REPLY_BYTES = 64 * 2**20

_HEADER = struct.Struct(">I")


class ProtocolError(SpdlLabError):
    """A message broke the framing, the JSON rules or its model; the message says which."""


class PeerClosed(ProtocolError):
    """The other side closed the connection between two messages (a clean end)."""


class MessageTimeout(ProtocolError, TimeoutError):
    """A message did not arrive, or could not be sent, within its timeout."""


class Message(BaseModel):
    """Exactly its fields, each of exactly its type (no "3" for 3, no true for 1)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, ser_json_inf_nan="null")


class Reply(Message):
    """A request done: the whole reply to ``set_concurrency``; the others add their fields."""

    ok: Literal[True] = True


class Failure(Message):
    """A request refused, or its handler failed: ``error`` says why."""

    ok: Literal[False] = False
    error: str


Cursor = Annotated[int, Field(ge=0)]


class HelloReply(Reply):
    name: str
    pid: int
    runner: str | None
    version: int


def _nullable(values: np.ndarray) -> list[float | None]:
    values = np.asarray(values, dtype=np.float64)
    return np.where(np.isfinite(values), values, None).tolist()


class Column(Message):
    series: str
    stage: str
    values: list[float | None]


class Chunk(Message):
    """A FrameChunk: NaN as null, one column per (series, stage), each as long as ``times``."""

    cursor: Cursor
    times: list[float | None]
    columns: list[Column]

    @model_validator(mode="after")
    def _aligned(self) -> Chunk:
        seen: set[tuple[str, str]] = set()
        for i, column in enumerate(self.columns):
            if len(column.values) != len(self.times):
                raise ValueError(f"columns[{i}].values has {len(column.values)} values; "
                                 f"the chunk has {len(self.times)} times")
            if (column.series, column.stage) in seen:
                raise ValueError(f"columns[{i}]: ({column.series!r}, {column.stage!r}) appears twice")
            seen.add((column.series, column.stage))
        return self

    @classmethod
    def of(cls, chunk: FrameChunk) -> Chunk:
        return cls(cursor=int(chunk.cursor), times=_nullable(chunk.times),
                   columns=[Column(series=series, stage=stage, values=_nullable(values))
                            for (series, stage), values in chunk.columns.items()])

    def frame_chunk(self) -> FrameChunk:
        columns = {(c.series, c.stage): np.array(c.values, dtype=np.float64) for c in self.columns}
        return FrameChunk(self.cursor, np.array(self.times, dtype=np.float64), columns)


class FramesReply(Reply):
    chunk: Chunk


class StatsReply(Reply):
    stats: dict[str, Any]


class StateReply(Reply):
    state: str


class ControlsReply(Reply):
    controls: dict[str, int]


class Ask(Message):
    """A request of no fields: who is publishing (name, pid, runner, version), its stats, its
    state, or its controls (each stage's concurrency, as the run can set it live)."""

    op: Literal["hello", "stats", "state", "controls"]


class FramesSince(Message):
    """The ticks after ``cursor`` that the run still holds."""

    op: Literal["frames_since"] = "frames_since"
    cursor: Cursor


class SetConcurrency(Message):
    op: Literal["set_concurrency"] = "set_concurrency"
    stage: str = Field(min_length=1)
    n: int = Field(ge=1, le=MAX_CONCURRENCY)


Request = Ask | FramesSince | SetConcurrency
#: Each request's model and the model of its reply, by op.
REQUESTS: dict[str, tuple[type[Message], type[Reply]]] = {
    "hello": (Ask, HelloReply), "stats": (Ask, StatsReply), "state": (Ask, StateReply),
    "controls": (Ask, ControlsReply), "frames_since": (FramesSince, FramesReply),
    "set_concurrency": (SetConcurrency, Reply),
}


def read_request(message: dict) -> Request:
    """The request in ``message``; ProtocolError naming what is wrong with it."""
    op = message.get("op")
    if not isinstance(op, str) or op not in REQUESTS:
        raise ProtocolError(f"unknown op {op!r}; send one of {sorted(REQUESTS)} as "
                            '{"op": "...", ...fields}')
    try:
        return REQUESTS[op][0].model_validate(message)
    except ValidationError as exc:
        fields = sorted(set(REQUESTS[op][0].model_fields) - {"op"})
        raise ProtocolError(_explain(exc, f"op {op!r} takes the fields {fields}")) from None


def read_reply(op: str, message: dict) -> Reply | Failure:
    """The reply to ``op`` in ``message``: its op's reply, or a Failure."""
    model = REQUESTS[op][1] if message.get("ok") is True and op in REQUESTS else Failure
    try:
        return model.model_validate(message)
    except ValidationError as exc:
        raise ProtocolError(_explain(exc, f"the reply to {op!r}")) from None


def _explain(exc: ValidationError, what: str) -> str:
    """pydantic's errors about ``what`` in one line, each after the field it is about."""
    problems = []
    for error in exc.errors(include_url=False):
        loc = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error["loc"])
        about_value = error["type"] not in ("missing", "extra_forbidden", "value_error")
        shown = f", not {error['input']!r:.60}" if about_value else ""
        problems.append(f"{loc.lstrip('.')}: {error['msg']}{shown}".lstrip(": "))
    return f"{what}: {'; '.join(problems)}"


def decode_message(body: bytes) -> dict:
    """The dict in a message body; ProtocolError if it is not strict UTF-8 JSON of an object."""
    try:
        obj = _json.loads(body)
    except ValueError as exc:
        raise ProtocolError(f"the message is not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise ProtocolError(f"the message is a JSON {type(obj).__name__}; "
                            'send a JSON object such as {"op": "hello"}')
    return obj


def send_message(sock: socket.socket, obj: dict | BaseModel, *, timeout: float | None = None,
                 limit: int | None = None) -> None:
    """Send ``obj`` as one message; ``limit`` caps the body size, ``timeout`` the whole send. A
    model goes through pydantic's serializer (NaN as null), several times faster than ``json``."""
    try:
        body = (obj.model_dump_json() if isinstance(obj, BaseModel) else _json.dumps(obj)).encode()
    except (TypeError, ValueError) as exc:
        raise ProtocolError(f"cannot send the message: {exc}; send numbers, strings, lists "
                            "and dicts only") from None
    most = min(limit, 0xFFFFFFFF) if limit is not None else 0xFFFFFFFF  # what 4 bytes can say
    if len(body) > most:
        raise ProtocolError(f"the message is {len(body)} bytes, over the limit of {most} bytes")
    if timeout is not None:
        sock.settimeout(timeout)
    try:
        sock.sendall(_HEADER.pack(len(body)) + body)
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
            raise MessageTimeout(f"a message did not arrive within {timeout} s "
                                 f"({got} of {size} bytes read)")
        sock.settimeout(remaining)
        try:
            n = sock.recv_into(view[got:], min(size - got, 1 << 20))
        except TimeoutError:
            continue
        if n == 0:
            if first and got == 0:
                raise PeerClosed("the connection was closed")
            raise ProtocolError(f"the message is truncated: the connection closed after {got} "
                                f"of {size} bytes")
        got += n
    return bytes(buf)


def recv_message(sock: socket.socket, limit: int, timeout: float) -> dict:
    """Read one message, of at most ``limit`` bytes, within ``timeout`` s: PeerClosed on a clean
    end before it, MessageTimeout when it is late, ProtocolError when it is malformed."""
    deadline = time.monotonic() + timeout
    (size,) = _HEADER.unpack(_recv_exactly(sock, _HEADER.size, deadline, first=True, timeout=timeout))
    if size > limit:
        raise ProtocolError(f"the message says it is {size} bytes, over the limit of {limit} bytes; "
                            "send smaller messages")
    return decode_message(_recv_exactly(sock, size, deadline, first=False, timeout=timeout))
