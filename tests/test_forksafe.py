"""Locks that survive fork(): a lock another thread holds at the fork is free in the child; one
the forking thread holds, it still holds there; a published run does nothing in a forked child."""

from __future__ import annotations

import os
import threading
import time

import pytest

from spdl_lab import _forksafe

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")]


def _in_child(check) -> int:
    """Fork; the child runs ``check()`` (True: exit 0) and exits at once; the child's exit status."""
    pid = os.fork()
    if pid == 0:
        try:
            code = 0 if check() else 1
        except BaseException:
            code = 2
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def _held_by_a_thread(lock, seconds: float) -> threading.Thread:
    taken = threading.Event()

    def hold():
        with lock:
            taken.set()
            time.sleep(seconds)

    thread = threading.Thread(target=hold)
    thread.start()
    taken.wait(5)
    return thread


@pytest.mark.parametrize("kind", [_forksafe.Lock, _forksafe.RLock])
def test_a_lock_another_thread_holds_is_waited_for_then_free_in_the_child(kind):
    lock = kind()
    thread = _held_by_a_thread(lock, 0.3)  # released within FORK_WAIT_S: the fork waits for it
    assert _in_child(lambda: lock.acquire(timeout=2)) == 0
    thread.join()
    assert lock.acquire(timeout=2)  # and the parent's is free again
    lock.release()


def test_a_lock_held_past_the_forks_wait_is_still_free_in_the_child(monkeypatch):
    monkeypatch.setattr(_forksafe, "FORK_WAIT_S", 0.2)
    lock = _forksafe.Lock()
    thread = _held_by_a_thread(lock, 2.0)
    assert _in_child(lambda: lock.acquire(timeout=2)) == 0  # a plain threading.Lock would be held forever
    assert lock.locked()  # the parent's holder still holds it
    thread.join()


def _forked_while_a_thread_holds(lock, then) -> bool:
    """A thread takes ``lock``, and 0.3 s later (the fork has started) calls ``then()`` still
    holding it: whether the child saw ``then()`` done (the fork waited for the thread)."""
    done: list[object] = []
    holding = threading.Event()

    def work():
        with lock:
            holding.set()
            time.sleep(0.3)
            done.append(then())

    thread = threading.Thread(target=work)
    thread.start()
    holding.wait(5)
    seen = _in_child(lambda: len(done) == 1) == 0
    thread.join()
    return seen


def test_a_thread_holding_one_lock_and_waiting_for_another_finishes_before_the_fork(monkeypatch):
    """Nested locks: a thread holds one and waits for a second the fork would take first. Taking
    the locks one by one, the fork held the second while it waited for the first, until its wait ran
    out: the child got the first one's data half-written (a stall of FORK_WAIT_S per fork, seen as
    a stalled epoch). Taken all at once or none, the thread finishes first."""
    monkeypatch.setattr(_forksafe, "FORK_WAIT_S", 3.0)
    one, two = _forksafe.Lock(), _forksafe.Lock()
    first, last = [lock for lock in list(_forksafe._locks) if lock is one or lock is two]

    def take_first():
        with first:
            return "done"

    assert _forked_while_a_thread_holds(last, take_first)


def test_a_thread_making_a_lock_while_it_holds_one_finishes_before_the_fork(monkeypatch):
    """Making a lock takes the registry (a publisher starts under a lock): a fork that held the
    registry while it waited for that thread's lock stalled until its wait ran out."""
    monkeypatch.setattr(_forksafe, "FORK_WAIT_S", 3.0)
    assert _forked_while_a_thread_holds(_forksafe.Lock(), _forksafe.Lock)


@pytest.mark.parametrize("kind", [_forksafe.Lock, _forksafe.RLock])
def test_the_forking_thread_still_holds_its_lock_in_the_child(kind):
    lock = kind()
    with lock:
        def check():
            if not lock.locked():
                return False
            lock.release()  # its own: releasing works
            return lock.acquire(timeout=1)
        assert _in_child(check) == 0
    assert not lock.locked()


def test_an_rlock_is_reentrant_and_only_its_holder_releases_it():
    lock = _forksafe.RLock()
    with lock, lock:
        assert lock.locked()
        other = threading.Thread(target=lambda: results.append(lock.acquire(timeout=0.1)))
        results: list[bool] = []
        other.start()
        other.join()
        assert results == [False]
    assert not lock.locked()
    with pytest.raises(RuntimeError):
        lock.release()


def test_a_published_run_does_nothing_in_a_forked_child(tmp_path, monkeypatch):
    import spdl_lab as lab
    from spdl_lab._watch.publish import published_by

    monkeypatch.setenv("SPDL_LAB_RUNTIME_DIR", str(tmp_path / "rt"))
    monkeypatch.setenv("SPDL_LAB_RECORD", str(tmp_path / "run.sqlite"))
    items = list(range(100))
    lab.publish(items, name="forked")
    publisher = published_by(items)
    files = sorted(p.name for p in (tmp_path / "rt").iterdir())
    try:
        assert _in_child(lambda: (publisher.close(), publisher.flush(), True)[-1]) == 0
        assert sorted(p.name for p in (tmp_path / "rt").iterdir()) == files  # its endpoint is still there
        assert not publisher.writer.closed and publisher.state() == "running"
    finally:
        publisher.close()
    assert lab.open(tmp_path / "run.sqlite").state == "finished"
