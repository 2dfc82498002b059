"""What the real workloads share: the folder of their generated data, a small model trained on
CPU with SGD on made-up labels (or a SimulatedDevice), and the torch DataLoader over their Datasets."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .._training import SimulatedDevice
from ..errors import PipelineSpecError

CACHE_ENV = "SPDL_LAB_CACHE_DIR"


def cache_dir(root: str | os.PathLike | None, kind: str) -> Path:
    """``root`` if given, else ``$SPDL_LAB_CACHE_DIR/KIND``, else ``~/.cache/spdl_lab/KIND``
    (``$XDG_CACHE_HOME`` honoured); made now, with a clear error if it cannot be."""
    if root is not None:
        path = Path(root)
    elif os.environ.get(CACHE_ENV):
        path = Path(os.environ[CACHE_ENV]) / kind
    else:
        path = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "spdl_lab" / kind
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # a file in the way too: FileExistsError ("File exists")
        raise PipelineSpecError(
            f"cannot make the data folder {path}: {exc.strerror or exc}; pass root= (a folder you "
            f"can write) or set ${CACHE_ENV}") from None
    return path


class ModelStep:
    """Subclasses make ``parameters`` and define ``forward(batch)``, the logits; a call is one
    training step: cross-entropy on labels ``0, 1, ..`` (mod ``classes``), backward, SGD."""

    def __init__(self, parameters: list[Any], classes: int, lr: float) -> None:
        self.parameters = list(parameters)
        self.classes = classes
        self.lr = lr
        self.steps = 0

    def __call__(self, batch: Any) -> float:
        import torch
        import torch.nn.functional as F

        logits = self.forward(batch)
        loss = F.cross_entropy(logits, torch.arange(len(logits)) % self.classes)
        for p in self.parameters:
            p.grad = None
        loss.backward()
        # Plain SGD written out: torch.optim's first optimizer in a process imports torch._dynamo,
        # 3-4 s of a core before the first step of every process that makes a workload.
        with torch.no_grad():
            for p in self.parameters:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-self.lr)
        self.steps += 1
        return loss.item()


def step_for(device: SimulatedDevice | str | None, model: Callable[[], Any]) -> Any:
    """``model()`` for ``device=None``; a SimulatedDevice for ``"simulated"`` or one given."""
    if device is None:
        return model()
    if device == "simulated":
        return SimulatedDevice()
    if isinstance(device, SimulatedDevice):
        return device
    raise PipelineSpecError(f"device must be None (a small model on CPU), 'simulated' or a "
                            f"lab.SimulatedDevice, got {device!r}")


def seeded(seed: int, make: Callable[[], Any]) -> Any:
    """``make()`` with torch's generator at ``seed``, the caller's generator state kept."""
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return make()


def dataloader(dataset: Any, batch_size: int, num_workers: int, options: dict[str, Any]) -> Any:
    """A plain ``DataLoader`` over ``dataset``, whole batches only; ``options`` go to it."""
    from torch.utils.data import DataLoader

    return DataLoader(dataset, batch_size=batch_size, num_workers=num_workers, drop_last=True, **options)
