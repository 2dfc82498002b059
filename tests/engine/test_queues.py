"""The engine's bounded queue: a put wakes a waiting reader, however often readers timed out."""

from __future__ import annotations

import threading

import pytest

from spdl_lab._engine.queues import TIMEOUT, BoundedQueue

pytestmark = pytest.mark.timeout(60)


def test_a_put_wakes_a_waiting_reader_after_a_storm_of_timed_out_gets():
    # A get whose wait times out just as a put notifies it takes that notify and gives up. Before,
    # it never uncounted itself: each such race left the queue believing a reader was on its way,
    # until no put woke anyone and every get waited out its timeout (a loader at one batch per
    # poll: CI's 100,000-item test ran past its 120 s).
    q = BoundedQueue("q", capacity=1_000_000)
    stop = threading.Event()

    def reader():
        while not stop.is_set():
            q.get(20e-6)

    readers = [threading.Thread(target=reader) for _ in range(2)]
    for t in readers:
        t.start()
    for i in range(30_000):  # thousands of near-simultaneous puts and time-outs
        q.put(i, i)
    stop.set()
    for t in readers:
        t.join(10)
    while q.get(0) is not TIMEOUT:
        pass

    got = threading.Event()
    waiting = threading.Thread(target=lambda: q.get(30.0) is not TIMEOUT and got.set())
    waiting.start()
    while not q._getters_waiting:  # it is in its wait
        threading.Event().wait(0.001)
    q.put(-1, "wake")
    # Woken by the put, not by its 30 s timeout (the test's own timeout is 60 s).
    assert got.wait(15), "the put did not wake the reader"
    waiting.join(5)
