"""Locks that survive ``fork()`` (a DataLoader forking while a lab thread holds one would hand the
child a lock nobody releases): taken before the fork, released after it in the parent, made anew
in the child (held if the forking thread held it)."""

from __future__ import annotations

import os
import threading
import time
import weakref

#: How long a fork waits for the locks other threads hold; past it the child still gets a fresh
#: lock for each one still busy, its guarded data perhaps half-written.
FORK_WAIT_S = 1.0

_locks: weakref.WeakSet = weakref.WeakSet()
_registry = threading.Lock()


class Lock:
    """``threading.Lock`` that survives fork: ``acquire``, ``release``, ``locked``, ``with``."""

    __slots__ = ("__weakref__", "_lock", "_owner", "_taken_for_fork")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owner: int | None = None
        self._taken_for_fork = False
        with _registry:
            _locks.add(self)

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if not self._lock.acquire(blocking, timeout):
            return False
        self._owner = threading.get_ident()
        return True

    def release(self) -> None:
        self._owner = None
        self._lock.release()

    def locked(self) -> bool:
        return self._lock.locked()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()

    def _after_fork_in_parent(self) -> None:
        if self._taken_for_fork:
            self._taken_for_fork = False
            self._lock.release()

    def _after_fork_in_child(self) -> None:
        mine = self._owner == threading.get_ident()  # the forking thread: it goes on holding it
        self._lock, self._taken_for_fork = threading.Lock(), False
        if mine:
            self._lock.acquire()
        else:
            self._owner = None


class RLock(Lock):
    """``threading.RLock`` that survives fork: the thread that holds it may take it again."""

    __slots__ = ("_count",)

    def __init__(self) -> None:
        super().__init__()
        self._count = 0

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if self._owner == threading.get_ident():
            self._count += 1
            return True
        if not super().acquire(blocking, timeout):
            return False
        self._count = 1
        return True

    def release(self) -> None:
        if self._owner != threading.get_ident():
            raise RuntimeError("cannot release un-acquired lock")
        self._count -= 1
        if not self._count:
            super().release()

    def _after_fork_in_child(self) -> None:
        super()._after_fork_in_child()
        if self._owner is None:
            self._count = 0


def _before_fork() -> None:
    """Take the registry and every lock the forking thread does not hold, all at once: a busy lock
    is waited for only while none is held (its holder may wait for one of them, or make a lock,
    which takes the registry). Past ``FORK_WAIT_S`` the fork goes on with those that are free."""
    me = threading.get_ident()
    deadline = time.monotonic() + FORK_WAIT_S
    while True:
        _registry.acquire()  # held only to add to the set: never long
        wanted = [lock for lock in list(_locks) if lock._owner != me]
        taken = [lock for lock in wanted if lock._lock.acquire(False)]
        left = deadline - time.monotonic()
        if len(taken) == len(wanted) or left <= 0:
            break
        for lock in taken:
            lock._lock.release()
        _registry.release()
        held = {id(lock) for lock in taken}
        busy = next(lock for lock in wanted if id(lock) not in held)
        if busy._lock.acquire(timeout=left):  # until it is free, holding nothing
            busy._lock.release()
    for lock in taken:
        lock._taken_for_fork = True


def _after_fork_in_parent() -> None:
    for lock in list(_locks):
        lock._after_fork_in_parent()
    _registry.release()


def _after_fork_in_child() -> None:
    global _registry
    _registry = threading.Lock()
    for lock in list(_locks):
        lock._after_fork_in_child()


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                    after_in_child=_after_fork_in_child)
