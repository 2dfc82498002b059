"""Datasets and worker_init_fns for the DataLoader meter tests, at module level: ``spawn`` and
``forkserver`` workers import them by name."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import torch
from torch.utils.data import Dataset

ITEMS = 24


class Squares(Dataset):
    def __len__(self) -> int:
        return ITEMS

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((3,), float(i * i))


class Batched(Squares):
    """Fetches a whole batch in one ``__getitems__`` call."""

    def __getitems__(self, indices: list[int]) -> list[torch.Tensor]:
        return [self[i] for i in indices]


class Faulty(Squares):
    def __getitem__(self, i: int) -> torch.Tensor:
        if i == 13:
            raise ValueError(f"item {i} cannot be read")
        return super().__getitem__(i)


class Killed(Squares):
    """Its worker dies by SIGKILL at item 13, as under the kernel's OOM killer."""

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == 13:
            os.kill(os.getpid(), signal.SIGKILL)
        return super().__getitem__(i)


def mark_started(directory: str, worker_id: int) -> None:
    """A user's worker_init_fn: leaves a file per worker start (bind ``directory`` with partial)."""
    Path(directory, f"worker{worker_id}-{os.getpid()}").touch()
