"""The local endpoint: every op round-trips, hostile bytes are refused and counted, nothing stays."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import stat
import statistics
import struct
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from pydantic import ValidationError

from spdl_lab._telemetry.frames import FrameChunk
from spdl_lab._watch.attach import EndpointClient
from spdl_lab._watch.endpoint import THREAD_NAME, Endpoint, Handlers, list_endpoints, runtime_dir
from spdl_lab._watch.protocol import (
    MAX_REQUEST_BYTES,
    Chunk,
    ProtocolError,
    _explain,
    decode_message,
    recv_message,
    send_message,
)
from spdl_lab.errors import PipelineSpecError, SpdlLabError

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def rt(monkeypatch, tmp_path):
    path = tmp_path / "rt"
    monkeypatch.setenv("SPDL_LAB_RUNTIME_DIR", str(path))
    return path


def make_chunk() -> FrameChunk:
    return FrameChunk(
        7,
        np.array([0.1, 0.2, 0.3]),
        {("qps", "decode"): np.array([1.0, np.nan, 3.0]),
         ("queue_depth", "source→decode"): np.array([np.nan, np.nan, 2.0])},
    )


class FakePublisher:
    def __init__(self) -> None:
        self.concurrency = {"decode": 2}
        self.calls: list[tuple[str, int]] = []

    def set_concurrency(self, stage: str, n: int) -> None:
        if stage not in self.concurrency:
            raise PipelineSpecError(f"no stage named {stage!r}; the stages are ['decode']")
        self.calls.append((stage, n))
        self.concurrency[stage] = n

    def handlers(self) -> Handlers:
        return Handlers(
            frames_since=lambda cursor: make_chunk(),
            stats=lambda: {"decode": {"qps": 12.5, "p99_ms": float("nan")}},
            state=lambda: "running",
            set_concurrency=self.set_concurrency,
            controls=lambda: dict(self.concurrency),
        )


@pytest.fixture
def endpoint(rt, no_thread_leak):
    publisher = FakePublisher()
    ep = Endpoint("train.py:12", publisher.handlers(), record="/runs/x.sqlite", runner="thread",
                  request_timeout=1.0)
    ep.publisher = publisher
    yield ep
    ep.close()


def raw(ep: Endpoint) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(5.0)
    sock.connect(str(ep.socket_path))
    return sock


def read_reply_or_eof(sock: socket.socket) -> dict | None:
    """The reply to a bad message, or None if the server closed without one."""
    try:
        return recv_message(sock, 1 << 20, 5.0)
    except (ProtocolError, OSError):
        return None


def assert_closed(sock: socket.socket) -> None:
    sock.settimeout(5.0)
    try:
        while sock.recv(4096):
            pass
    except ConnectionResetError:
        pass


# -- framing ---------------------------------------------------------------------------


def chunk_from_json(data: object) -> FrameChunk:
    """The FrameChunk in ``data``, checked field by field as a viewer checks a reply's chunk."""
    try:
        return Chunk.model_validate(data).frame_chunk()
    except ValidationError as exc:
        raise ProtocolError(_explain(exc, "a frame chunk")) from None


def test_frame_chunk_with_nans_round_trips():
    chunk = make_chunk()
    data = json.loads(json.dumps(Chunk.of(chunk).model_dump(), allow_nan=False))
    back = chunk_from_json(data)
    assert back.cursor == 7
    np.testing.assert_array_equal(back.times, chunk.times)
    assert back.columns.keys() == chunk.columns.keys()
    for key, values in chunk.columns.items():
        np.testing.assert_array_equal(back.columns[key], values)  # NaN == NaN here


@pytest.mark.parametrize("data, words", [
    ({"cursor": True, "times": [], "columns": []}, "cursor"),
    ({"cursor": 1, "times": ["x"], "columns": []}, "chunk: times[0]"),
    ({"cursor": 1, "times": [1.0], "columns": [{"series": "q", "stage": "", "values": []}]},
     "has 0 values"),
    ({"cursor": 1, "times": [], "columns": [], "extra": 1}, "extra: Extra inputs"),
])
def test_bad_frame_chunk_is_refused(data, words):
    with pytest.raises(ProtocolError, match=words.replace("[", r"\[").replace("]", r"\]")):
        chunk_from_json(data)


@pytest.mark.parametrize("body, words", [
    (b"\xff\xfe", "UTF-8"),
    (b"{not json", "not valid JSON"),
    (b'{"x": NaN}', "NaN"),
    (b'{"x": -Infinity}', "Infinity"),
    (b"[1, 2]", "JSON list"),
    (b'{"a": 1, "a": 2}', "twice"),
])
def test_decode_refuses(body, words):
    with pytest.raises(ProtocolError, match=words):
        decode_message(body)


# -- the runtime directory -------------------------------------------------------------


def test_runtime_dir_is_private(rt):
    path = runtime_dir()
    assert path == rt
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o700


def test_runtime_dir_with_wrong_permissions_is_refused(rt):
    rt.mkdir(mode=0o755)
    os.chmod(rt, 0o755)
    with pytest.raises(SpdlLabError, match=r"mode 755.*chmod 700"):
        runtime_dir()


def test_runtime_dir_that_is_a_file_is_refused(rt):
    rt.write_text("")
    with pytest.raises(SpdlLabError, match="is not a directory"):
        runtime_dir()


# -- round trips -----------------------------------------------------------------------


def test_every_op_round_trips(endpoint):
    info = json.loads(endpoint.discovery_path.read_text())
    assert info["socket"] == str(endpoint.socket_path) and info["version"] == 1
    assert info["record"] == "/runs/x.sqlite" and info["runner"] == "thread"
    assert len(os.fsencode(str(endpoint.socket_path))) < 100
    with EndpointClient(info["socket"]) as client:
        hello = client.request("hello")
        assert hello.model_dump() == {"ok": True, "name": "train.py:12", "pid": os.getpid(),
                         "runner": "thread", "version": 1}
        chunk = client.request("frames_since", cursor=0).chunk.frame_chunk()
        assert chunk.cursor == 7 and np.isnan(chunk.columns[("qps", "decode")][1])
        assert client.request("stats").stats == {"decode": {"qps": 12.5, "p99_ms": None}}
        assert client.request("state").state == "running"
        assert client.request("controls").controls == {"decode": 2}
        assert client.request("set_concurrency", stage="decode", n=5).model_dump() == {"ok": True}
        assert endpoint.publisher.calls == [("decode", 5)]
        assert client.request("controls").controls == {"decode": 5}
    assert endpoint.rejected == 0


def test_handler_that_raises_answers_with_its_error(endpoint):
    with EndpointClient(endpoint.socket_path) as client:
        with pytest.raises(SpdlLabError, match=r"PipelineSpecError: no stage named 'nope'"):
            client.request("set_concurrency", stage="nope", n=2)
        assert client.request("state").state == "running"  # still serving
    assert endpoint.handler_errors == 1 and endpoint.rejected == 0


@pytest.mark.parametrize("fields, words", [
    ({"op": "launch"}, "unknown op 'launch'"),
    ({"no_op": 1}, "unknown op None"),
    ({"op": "frames_since"}, "cursor: Field required"),
    ({"op": "frames_since", "cursor": -1}, "cursor: Input should be greater than or equal to 0"),
    ({"op": "frames_since", "cursor": "0"}, "cursor: Input should be a valid integer"),
    ({"op": "set_concurrency", "stage": "decode", "n": True}, "n: Input should be a valid integer"),
    ({"op": "set_concurrency", "stage": "decode", "n": 0}, "n: Input should be greater than or equal to 1"),
    ({"op": "set_concurrency", "stage": "decode", "n": 1025}, "n: Input should be less than or equal to 1024"),
    ({"op": "set_concurrency", "stage": 3, "n": 2}, "stage: Input should be a valid string"),
    ({"op": "state", "extra": 1}, "extra: Extra inputs are not permitted"),
])
def test_bad_request_is_answered_and_the_connection_stays(endpoint, fields, words):
    sock = raw(endpoint)
    send_message(sock, fields)
    reply = recv_message(sock, 1 << 20, 5.0)
    assert reply["ok"] is False and re.search(words, reply["error"]), reply
    send_message(sock, {"op": "state"})
    assert recv_message(sock, 1 << 20, 5.0) == {"ok": True, "state": "running"}
    sock.close()
    assert endpoint.rejected == 1
    assert endpoint.publisher.calls == []


def test_client_raises_the_servers_message(endpoint):
    with EndpointClient(endpoint.socket_path) as client:
        with pytest.raises(SpdlLabError, match="n: Input should be greater than or equal to 1"):
            client.request("set_concurrency", stage="decode", n=0)
        assert client.request("state").state == "running"


def _header(n: int) -> bytes:
    return struct.pack(">I", n)


@pytest.mark.parametrize("payload, words", [
    (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", "over the limit"),  # garbage as a length
    (_header(MAX_REQUEST_BYTES + 1), "over the limit"),
    (_header(9) + b"{not json", "not valid JSON"),
    (_header(10) + b'{"x": NaN}', "NaN"),
    (_header(2) + b"[]", "JSON list"),
    (_header(4) + b"\xff\xfe\xfd\xfc", "UTF-8"),
])
def test_bad_framing_is_rejected_and_closes_only_that_connection(endpoint, payload, words):
    with EndpointClient(endpoint.socket_path) as good:
        assert good.request("state").state == "running"
        bad = raw(endpoint)
        bad.sendall(payload)
        reply = read_reply_or_eof(bad)
        assert reply is not None and reply["ok"] is False and words in reply["error"]
        assert_closed(bad)
        bad.close()
        assert good.request("stats").ok
    assert endpoint.rejected == 1


def test_truncated_message_is_rejected(endpoint, wait_until):
    with EndpointClient(endpoint.socket_path) as good:
        bad = raw(endpoint)
        bad.sendall(_header(100) + b'{"op": "st')
        bad.shutdown(socket.SHUT_WR)  # EOF mid-message
        reply = read_reply_or_eof(bad)
        assert reply is not None and "truncated" in reply["error"]
        bad.close()
        assert good.request("state").state == "running"
    assert wait_until(lambda: endpoint.rejected == 1, 5.0)


def test_stalled_client_does_not_block_others(endpoint, wait_until):
    stalled = raw(endpoint)
    stalled.sendall(b"\x00\x00")  # half a header, then nothing
    with EndpointClient(endpoint.socket_path, timeout=2.0) as good:
        for _ in range(5):
            assert good.request("state").state == "running"
    # request_timeout=1.0: the stalled viewer is dropped and counted.
    reply = read_reply_or_eof(stalled)
    assert reply is not None and "did not arrive" in reply["error"]
    stalled.close()
    assert wait_until(lambda: endpoint.rejected == 1, 5.0)


def test_two_clients_at_once(endpoint):
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    def viewer() -> None:
        try:
            with EndpointClient(endpoint.socket_path) as client:
                start.wait(5.0)
                for cursor in range(50):
                    assert client.request("frames_since", cursor=cursor).chunk.cursor == 7
        except BaseException as exc:  # collected for the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=viewer) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30.0)
    assert errors == []


def test_viewers_over_the_limit_are_refused(rt, no_thread_leak, wait_until):
    with Endpoint("small", FakePublisher().handlers(), max_viewers=1) as ep:
        with EndpointClient(ep.socket_path) as first:
            assert first.request("state").ok
            with EndpointClient(ep.socket_path) as second:
                # Refused and closed before the request is sent: the reason is still read.
                assert wait_until(lambda: ep.rejected == 1, 5.0)
                with pytest.raises(SpdlLabError, match="already has 1 viewers"):
                    second.request("state")
            assert first.request("state").ok
        assert ep.rejected == 1


def test_names_cut_to_fit_the_socket_path_stay_apart(rt, no_thread_leak):
    """A script's second run is NAME-2: cut to the room a long runtime directory leaves, the two
    names would be one socket, and the second run failed to publish."""
    name = "tune-script-run01-start-" + "x" * 100
    with Endpoint(name, FakePublisher().handlers()) as first, \
            Endpoint(f"{name}-2", FakePublisher().handlers()) as second:
        assert first.socket_path != second.socket_path
        assert {e["name"] for e in list_endpoints()} == {name, f"{name}-2"}


# -- closing and discovery -------------------------------------------------------------


def test_close_removes_files_and_threads(rt, no_thread_leak, wait_until):
    ep = Endpoint("x" * 300, FakePublisher().handlers())  # a long name is shortened
    assert len(os.fsencode(str(ep.socket_path))) < 100
    client = EndpointClient(ep.socket_path)
    assert client.request("hello").ok
    stalled = raw(ep)
    stalled.sendall(b"\x00")
    assert [e["socket"] for e in list_endpoints()] == [str(ep.socket_path)]
    ep.close()
    ep.close()  # idempotent
    assert not ep.socket_path.exists() and not ep.discovery_path.exists()
    assert os.listdir(rt) == []
    assert wait_until(
        lambda: not any(t.name == THREAD_NAME for t in threading.enumerate()), 5.0)
    with pytest.raises(SpdlLabError, match="is gone"):
        client.request("state")
    with pytest.raises(SpdlLabError, match=r"the published run .* is gone \(the script ended"):
        EndpointClient(ep.socket_path)
    client.close()
    stalled.close()
    assert list_endpoints() == []


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")
def test_an_endpoint_closed_leaves_no_open_file(rt, no_thread_leak):
    before = _open_fds()
    Endpoint("fds", FakePublisher().handlers()).close()
    assert _open_fds() <= before


@pytest.mark.measurement
def test_close_does_not_wait_for_the_accept_loop(rt, no_thread_leak):
    """Its loop wakes on a pipe: a run's close (each epoch of a DataLoader built each epoch) waited
    out its 0.25 s accept timeout before, 126 ms a hand-over in a watched job (docs/measurements.md)."""
    took = []
    for i in range(10):
        ep = Endpoint(f"close-{i}", FakePublisher().handlers())
        t0 = time.perf_counter()
        ep.close()
        took.append(time.perf_counter() - t0)
    assert statistics.median(took) < 0.05, took


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_close_in_a_forked_child_leaves_the_parents_endpoint(endpoint):
    with EndpointClient(endpoint.socket_path) as client:
        assert client.request("state").ok
        pid = os.fork()
        if pid == 0:  # the child, as in a DataLoader worker that runs atexit
            signal.alarm(10)  # a child that hangs in close() must not outlive the test
            try:
                endpoint.close()
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
        assert endpoint.socket_path.exists() and endpoint.discovery_path.exists()
        assert client.request("state").state == "running"


def test_list_endpoints_cleans_dead_pids(rt, no_thread_leak):
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(30)  # reaped: its pid is dead
    directory = runtime_dir()
    dead = directory / f"old-{child.pid}.json"
    dead.write_text(json.dumps({
        "name": "old", "pid": child.pid, "started": "2020-01-01T00:00:00+00:00",
        "socket": str(directory / f"old-{child.pid}.sock"), "record": None, "runner": None,
        "version": 1,
    }))
    (directory / f"old-{child.pid}.sock").write_text("")
    garbage_dead = directory / f"junk-{child.pid}.json"
    garbage_dead.write_text("{nope")
    garbage_alive = directory / f"junk-{os.getpid()}.json"
    garbage_alive.write_text('{"pid": NaN}')
    with Endpoint("live", FakePublisher().handlers()) as ep:
        listed = list_endpoints()
        assert [e["name"] for e in listed] == ["live"]
        assert listed[0]["pid"] == os.getpid()
        assert sorted(os.listdir(directory)) == sorted(
            [ep.socket_path.name, ep.discovery_path.name, garbage_alive.name])
    garbage_alive.unlink()
