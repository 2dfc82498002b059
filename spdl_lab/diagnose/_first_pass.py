"""The first pass of ``lab.diagnose``: each stage once over its inputs, in threads, in order.

Its outputs feed the next stage; what raised or hung is reported, not swept.
"""

from __future__ import annotations

import itertools
import threading
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["StageRun", "run_once"]


@dataclass
class StageRun:
    """One pass of a stage over its inputs: what the next stage gets, and what went wrong."""

    outputs: list[Any]
    ok_inputs: list[Any]  # the inputs that did not raise: what the sweep is fed
    failures: int
    first_error: str | None  # traceback text of the first failure
    hung: bool  # an item did not finish within the timeout
    abandoned_threads: int


def run_once(fn: Callable[[Any], Any], inputs: Sequence[Any], *, workers: int, timeout_s: float) -> StageRun:
    """Apply ``fn`` to every input, ``workers`` at a time, keeping order; failing items are dropped."""
    n = len(inputs)
    results: list[Any] = [_MISSING] * n
    errors: list[str | None] = [None] * n
    counter = itertools.count()
    progress = threading.Event()
    done = threading.Event()

    def work() -> None:
        while not done.is_set():
            i = next(counter)
            if i >= n:
                return
            try:
                results[i] = fn(inputs[i])
            except Exception:
                errors[i] = traceback.format_exc()
            progress.set()

    threads = [threading.Thread(target=work, name=f"spdl_lab:diagnose-pass-{i}", daemon=True)
               for i in range(min(workers, max(1, n)))]
    for t in threads:
        t.start()
    hung = False
    while any(t.is_alive() for t in threads):
        progress.clear()
        if not progress.wait(timeout_s) and any(t.is_alive() for t in threads):
            hung = True
            break
    done.set()
    alive = sum(t.is_alive() for t in threads)
    failures = sum(e is not None for e in errors)
    ok = [i for i in range(n) if errors[i] is None and results[i] is not _MISSING]
    outputs = [results[i] for i in ok]
    first_error = next((e for e in errors if e is not None), None)
    return StageRun(outputs, [inputs[i] for i in ok], failures, first_error, hung, alive)


_MISSING = object()
