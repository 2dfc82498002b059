"""What a restarting runner has handed over: the numbers (source items, or chunks of them)
delivered or dropped, so a restart (a new worker count, a new concurrency) neither loses nor
repeats one. They mostly come in order: a contiguous prefix plus the few beyond it."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

__all__ = ["Delivered"]


class Delivered:
    """Numbers done with; written by one thread (the runner's pump), shipped as a ``copy``."""

    def __init__(self, below: int = 0, beyond: Iterable[int] = ()) -> None:
        self.below = below
        self._beyond = set(beyond)

    def __contains__(self, number: int) -> bool:
        return number < self.below or number in self._beyond

    def seen(self, numbers: Sequence[int]) -> bool:
        return bool(numbers) and all(n in self for n in numbers)

    def add(self, numbers: Iterable[int]) -> None:
        self._beyond.update(numbers)
        self._advance()

    def cover(self, end: int) -> None:
        """Every number below ``end`` is done with (delivered, or dropped as a failure)."""
        if end > self.below:
            self.below = end
            self._beyond = {n for n in self._beyond if n >= end}
            self._advance()

    def copy(self) -> Delivered:
        return Delivered(self.below, self._beyond)

    def _advance(self) -> None:
        while self.below in self._beyond:
            self._beyond.discard(self.below)
            self.below += 1
