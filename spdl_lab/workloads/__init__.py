"""``lab.workloads``: pipelines to study, each with a training step: synthetic ones from the field
notes (here, small enough for CI), real ones (JPEGs, tokenizing). Runners import them by name."""

from __future__ import annotations

import functools
import time
import timeit
from pathlib import Path
from typing import Any

import numpy as np

from .._pipeline import Pipeline
from .._training import SimulatedDevice
from ._images import ImageFolder, image_dataloader, image_step, images
from ._text import DocumentTokens, text, text_dataloader, text_step

__all__ = ["DocumentTokens", "ImageFolder", "augment", "collate_list", "collate_stack", "decode_sample",
           "fetch_array", "image_dataloader", "image_step", "images", "ipc_overhead", "job_script",
           "noisy_neighbour", "read_sample", "text", "text_dataloader", "text_step"]

#: Training scripts that know nothing of the lab, to watch and tune as a user's own job.
JOBS = {"ddp": "train_ddp.py", "images": "train_images.py"}


def job_script(name: str = "images") -> Path:
    """The path of a real training script that never imports spdl_lab, for ``spdl-lab watch --
    python PATH`` (``images``: a DataLoader and a conv net, Lightning or a plain loop) or ``--
    torchrun ... PATH`` (``ddp``: data-parallel, one rank can be slowed); ``--help`` says how."""
    if name not in JOBS:
        raise ValueError(f"job_script: no job {name!r}; the jobs are: {', '.join(sorted(JOBS))}")
    return Path(__file__).with_name("jobs") / JOBS[name]


def fetch_array(index: int, *, shape: tuple[int, ...], fetch_s: float) -> np.ndarray:
    """One item of the IPC question: wait ``fetch_s`` (I/O), then make a random array."""
    time.sleep(fetch_s)
    return np.random.default_rng(index).random(shape)


def collate_list(items: list[Any]) -> list[Any]:
    """The question's collate: return the records as they are (a list of arrays)."""
    return items


def ipc_overhead(*, items: int = 10_000, shape: tuple[int, ...] = (1000, 150),
                 fetch_s: float = 0.003125, batch_size: int = 128,
                 concurrency: int = 16) -> Pipeline:
    """The seed question's loader: ``items`` float64 arrays of ``shape``, each after a ``fetch_s``
    wait, in batches collated into plain lists: big batches (154 MB by default) whose moves
    between processes make more ``num_workers`` stop helping."""
    fetch = functools.partial(fetch_array, shape=tuple(shape), fetch_s=fetch_s)
    return (Pipeline(range(items)).map(fetch, concurrency=concurrency, name="fetch")
            .batch(batch_size).map(collate_list, name="collate"))


def read_sample(index: int, *, read_ms: float) -> int:
    """Fetch a sample's bytes: I/O, which waits without holding the GIL."""
    time.sleep(read_ms / 1000)
    return index


def _checksum(seed: int, iterations: int) -> int:
    state = seed
    for k in range(iterations):
        state = (state * 1103515245 + k) & 0x7FFFFFFF
    return state


@functools.cache
def decode_iterations_per_us() -> float:
    """Speed of the decode loop on this machine (CPU time, best of 5; measured once)."""
    n = 200_000
    _checksum(0, n)
    best_s = min(timeit.repeat(lambda: _checksum(0, n), timer=time.thread_time, repeat=5, number=1))
    return n / (best_s * 1e6)


def decode_sample(index: int, *, decode_iterations: int, shape: tuple[int, ...]) -> np.ndarray:
    """Decode in Python, holding the GIL as pure-Python decoders do: a fixed amount of bytecode
    work (a checksum over the "compressed" stream), then the pixels as a uint8 array."""
    state = _checksum(index, decode_iterations)
    return np.random.default_rng(state).integers(0, 256, size=shape, dtype=np.uint8)


def augment(image: np.ndarray) -> np.ndarray:
    """Flip and normalise with numpy (most of it releases the GIL)."""
    out = image[:, :, ::-1].astype(np.float32)
    out -= 127.5
    out *= 1 / 127.5
    return out


def collate_stack(images: list[np.ndarray]) -> np.ndarray:
    return np.stack(images)


def noisy_neighbour(*, items: int = 100_000, batch_size: int = 16,
                    shape: tuple[int, ...] = (3, 96, 96), read_ms: float = 2.0,
                    decode_us: float = 2500.0, read_concurrency: int = 8,
                    decode_concurrency: int = 2, gil_release_every: int = 10,
                    device: SimulatedDevice | None = None) -> tuple[Pipeline, SimulatedDevice]:
    """The parallelism study on a CPU-only machine, ``(pipeline, step)``: reads (I/O wait), Python
    decodes (``decode_us`` of CPU, GIL held), numpy augments; a SimulatedDevice step, whose launches
    the decoders starve of the GIL under ``thread`` but not under ``subprocess-threads``."""
    iterations = round(decode_us * decode_iterations_per_us())
    pipeline = (
        Pipeline(range(items))
        .map(functools.partial(read_sample, read_ms=read_ms), concurrency=read_concurrency, name="read")
        .map(functools.partial(decode_sample, decode_iterations=iterations, shape=tuple(shape)),
             concurrency=decode_concurrency, name="decode")
        .map(augment, concurrency=decode_concurrency, name="augment")
        .batch(batch_size)
        .map(collate_stack, name="collate"))
    return pipeline, device or SimulatedDevice(gil_release_every=gil_release_every)
