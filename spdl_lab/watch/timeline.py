"""One published run's ticks on one clock, across the runs of what it publishes: a
``lab.Loader`` starts a new run, with a new sampler and ring, each epoch; viewers and the
record see one continuous run.
"""

from __future__ import annotations

import math
import time

import numpy as np

from ..telemetry.frames import FrameChunk, chunk_since
from ..telemetry.ring import Ring
from ..telemetry.sampler import DEFAULT_TICKS, Sampler

__all__ = ["Timeline"]


class Timeline:
    """The ticks of every sampler ``pull`` was given, times from ``started_at``; thread-safe reads.

    When the sampler changes, the old one's last ticks are taken first: an epoch's end is kept.
    """

    def __init__(self, capacity: int = DEFAULT_TICKS) -> None:
        self.ring = Ring(capacity)
        self.started_at = time.perf_counter()
        self._sampler: Sampler | None = None
        self._cursor = 0
        #: ticks viewers asked for after the ring had moved past them (a stalled viewer skips ahead)
        self.skipped_by_viewers = 0

    def pull(self, sampler: Sampler | None) -> FrameChunk:
        """The ticks ``sampler`` (the current one) added since the last pull, now in the ring too."""
        times: list[np.ndarray] = []
        columns: list[dict] = []
        if sampler is not self._sampler and self._sampler is not None:
            self._take(self._sampler, times, columns)  # the previous run's last ticks
        if sampler is not self._sampler:
            self._sampler, self._cursor = sampler, 0
        if sampler is not None:
            self._take(sampler, times, columns)
        return _joined(times, columns)

    def frames_since(self, cursor: int) -> FrameChunk:
        """The ticks after ``cursor`` that the ring still holds (the oldest go first, counted)."""
        oldest = self.ring.count - len(self.ring)
        if cursor < oldest:
            self.skipped_by_viewers += oldest - cursor
        return chunk_since(self.ring, cursor)

    def _take(self, sampler: Sampler, times: list[np.ndarray], columns: list[dict]) -> None:
        self._cursor, ticks, values = sampler.ring.since(self._cursor)
        if not len(ticks):
            return
        ticks = ticks + (sampler.started_at - self.started_at)
        for i, t in enumerate(ticks):
            self.ring.append(float(t), [(series, stage, float(v[i])) for (series, stage), v in values.items()
                                        if not math.isnan(v[i])])
        times.append(ticks)
        columns.append(values)


def _joined(times: list[np.ndarray], columns: list[dict]) -> FrameChunk:
    if not times:
        return FrameChunk(0, np.empty(0), {})
    if len(times) == 1:
        return FrameChunk(0, times[0], columns[0])
    keys = {k for c in columns for k in c}
    joined = {k: np.concatenate([c.get(k, np.full(len(t), np.nan)) for t, c in zip(times, columns)])
              for k in keys}
    return FrameChunk(0, np.concatenate(times), joined)
