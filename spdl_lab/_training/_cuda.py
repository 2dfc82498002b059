"""CUDA timing for the StepClock: event pairs on the current stream around each step, resolved
without serializing CPU and GPU."""

from __future__ import annotations

from collections import deque
from typing import Any, Generic, TypeVar

Token = TypeVar("Token")

#: Pairs pending before the oldest is waited for: only bounds memory (a real stream's launch queue
#: fills first).
MAX_PENDING = 1024


def cuda_available() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:  # no torch, or a broken driver: no CUDA, not a crash in a clock
        return False


class CudaStepTimer(Generic[Token]):
    """A start and an end event on the current stream around each step. Waiting for one would
    serialize CPU and GPU, so pairs stay pending until ``query()`` says the GPU passed the end;
    only ``drain()`` synchronizes. A pair spans the stream's gaps: busy only while it stays fed."""

    def __init__(self) -> None:
        import torch

        self._event_type: Any = torch.cuda.Event
        self._pending: deque[tuple[Any, Any, Token]] = deque()
        self._free: list[Any] = []  # recycled events: creating one costs a driver call

    def _event(self) -> Any:
        return self._free.pop() if self._free else self._event_type(enable_timing=True)

    def start(self) -> Any:
        event = self._event()
        event.record()
        return event

    def end(self, start: Any, token: Token) -> None:
        event = self._event()
        event.record()
        self._pending.append((start, event, token))
        if len(self._pending) > MAX_PENDING:
            self._pending[0][1].synchronize()

    def cancel(self, start: Any) -> None:
        """Give back the start event of a step that failed."""
        self._free.append(start)

    def poll(self) -> list[tuple[Token, float]]:
        """(token, seconds) for every pair the GPU has finished, oldest first."""
        resolved: list[tuple[Token, float]] = []
        pending = self._pending
        while pending and pending[0][1].query():
            start, end, token = pending.popleft()
            resolved.append((token, start.elapsed_time(end) / 1e3))
            self._free += (start, end)
        return resolved

    def drain(self) -> list[tuple[Token, float]]:
        """Wait once for the newest event, then resolve everything pending."""
        if self._pending:
            self._pending[-1][1].synchronize()
        return self.poll()

    @property
    def pending(self) -> int:
        return len(self._pending)
