"""One published run's ticks on one clock, across the runs of what it publishes (a ``lab.Loader``
starts a new sampler each epoch): viewers and the record see one continuous run."""

from __future__ import annotations

import math
import time

import numpy as np

from .._telemetry.frames import FrameChunk, chunk_since
from .._telemetry.ring import Ring
from .._telemetry.sampler import DEFAULT_TICKS, Sampler


class Timeline:
    """The ticks of every sampler ``pull`` was given, times from ``started_at``; thread-safe reads.
    When the sampler changes, the old one's last ticks are taken first: an epoch's end is kept."""

    def __init__(self, capacity: int = DEFAULT_TICKS) -> None:
        self.ring = Ring(capacity)
        self.started_at = time.perf_counter()
        self._sampler: Sampler | None = None
        self._cursor = 0
        #: ticks viewers asked for after the ring had moved past them (a stalled viewer skips ahead)
        self.skipped_by_viewers = 0

    def pull(self, sampler: Sampler | None) -> None:
        """Append the ticks the current ``sampler`` added since the last pull."""
        if sampler is not self._sampler:
            if self._sampler is not None:
                self._take(self._sampler)  # the previous run's last ticks
            self._sampler, self._cursor = sampler, 0
        if sampler is not None:
            self._take(sampler)

    def frames_since(self, cursor: int) -> FrameChunk:
        """The ticks after ``cursor`` that the ring still holds (the oldest go first, counted)."""
        self.skipped_by_viewers += max(0, self.ring.count - len(self.ring) - cursor)
        return chunk_since(self.ring, cursor)

    def _take(self, sampler: Sampler) -> None:
        self._cursor, ticks, values = sampler.ring.since(self._cursor)
        append_ticks(self.ring, ticks, values, shift=sampler.started_at - self.started_at)


def append_ticks(ring: Ring, times: np.ndarray, columns: dict[tuple[str, str], np.ndarray],
                 shift: float = 0.0) -> None:
    """Append each tick of a chunk (``times`` and its ``columns``) to ``ring``, NaN left out."""
    for i, t in enumerate(times.tolist()):
        rows = [(series, stage, float(v[i])) for (series, stage), v in columns.items()]
        ring.append(t + shift, [row for row in rows if not math.isnan(row[2])])
