"""Workloads that reproduce the field notes, small enough for CI and notebooks.

Functions are module-level so every runner (threads, a child process,
DataLoader workers) can import them by reference.
"""

from __future__ import annotations

import time
from functools import partial
from typing import Any

import numpy as np

from .pipeline import Pipeline

__all__ = ["ipc_overhead", "fetch_array", "collate_list"]


def fetch_array(index: int, *, shape: tuple[int, ...], fetch_s: float) -> np.ndarray:
    """One item of the IPC question: wait ``fetch_s`` (I/O), then make a random array."""
    time.sleep(fetch_s)
    return np.random.default_rng(index).random(shape)


def collate_list(items: list[Any]) -> list[Any]:
    """The question's collate: return the records as they are (a list of arrays)."""
    return items


def ipc_overhead(
    *,
    items: int = 10_000,
    shape: tuple[int, ...] = (1000, 150),
    fetch_s: float = 0.003125,
    batch_size: int = 128,
    concurrency: int = 16,
) -> Pipeline:
    """The seed question's loader: ``items`` arrays of ``shape`` (float64), each after a
    ``fetch_s`` wait, in batches of ``batch_size`` collated into plain lists.

    With the defaults a batch is 128 x 1.2 MB = 154 MB: moving it between
    processes is what makes more ``num_workers`` stop helping.
    """
    fetch = partial(fetch_array, shape=tuple(shape), fetch_s=fetch_s)
    return (
        Pipeline(range(items))
        .map(fetch, concurrency=concurrency, name="fetch")
        .batch(batch_size)
        .map(collate_list, name="collate")
    )
