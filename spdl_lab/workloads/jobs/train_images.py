"""A real training job, as a user writes it, that knows nothing of spdl_lab: JPEGs decoded with
PIL, random crop and flip, normalized; a torch DataLoader with workers; a small conv net on the CPU
(or ``--device cuda``: pinned batches, its own CUDA event pair around each step); run under PyTorch
Lightning (``--trainer lightning``) or as a plain loop (``--trainer plain``).

``--timing`` writes its own figures (``Timing.write``; under Lightning from its profiler), which
``spdl-lab watch`` and ``spdl-lab tune --script`` hold the lab's against; see ``--help``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch import nn
from torch.utils.data import DataLoader, Dataset

SIZE = 160  # the JPEGs' side; crops are CROP x CROP
CROP = 128
MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)
STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)


def make_images(folder: Path, n: int) -> list[Path]:
    """``n`` JPEGs of random pixels (quality 90) in ``folder``, made once."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    paths = [folder / f"{i:05d}.jpg" for i in range(n)]
    for path in paths:
        if not path.exists():
            Image.fromarray(rng.integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8)).save(path, quality=90)
    return paths


class Jpegs(Dataset):
    def __init__(self, files: list[Path]) -> None:
        self.files = files

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        with Image.open(self.files[i]) as image:
            pixels = np.asarray(image.convert("RGB"), dtype=np.float32) / 255.0
        rng = np.random.default_rng()
        top, left = rng.integers(0, SIZE - CROP + 1, size=2)
        crop = pixels[top:top + CROP, left:left + CROP]
        if rng.random() < 0.5:
            crop = crop[:, ::-1]
        crop = (crop - MEAN) / STD
        return torch.from_numpy(np.ascontiguousarray(crop.transpose(2, 0, 1))), i % 10


def conv_net() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 16, 3, stride=2, padding=1), nn.ReLU(),
                         nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))


class Timing:
    """The job's own figures: a step is its batch's training, its data wait the time since the
    previous step's end (or the epoch's start)."""

    def __init__(self, cuda: bool = False) -> None:
        # The next step's pair is made ahead: making one is a driver call, not the step's GPU time.
        self.events: list[tuple[torch.cuda.Event, torch.cuda.Event]] | None = [] if cuda else None
        self._pair = self._new_pair() if cuda else None
        self.waits: list[float] = []
        self.steps: list[float] = []
        self.started: float | None = None
        self.ended = 0.0
        self._mark = 0.0
        self._begun = 0.0

    def epoch_start(self) -> None:
        self._mark = time.perf_counter()
        if self.started is None:
            self.started = self._mark

    def step_start(self) -> None:
        self._begun = time.perf_counter()
        self.waits.append(self._begun - self._mark)
        if self.events is not None:
            self.events.append(self._pair)
            self._pair[0].record()

    def step_end(self) -> None:
        if self.events is not None:
            self.events[-1][1].record()
        self._mark = self.ended = time.perf_counter()
        self.steps.append(self._mark - self._begun)
        if self.events is not None:
            self._pair = self._new_pair()

    @staticmethod
    def _new_pair() -> tuple[torch.cuda.Event, torch.cuda.Event]:
        return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def write(self, path: str) -> None:
        wall = self.ended - (self.started or self.ended)
        device = []
        if self.events:
            torch.cuda.synchronize()
            device = [start.elapsed_time(end) for start, end in self.events]
        Path(path).write_text(json.dumps({
            "device_ms": device, "device_p50_ms": statistics.median(device) if device else None,
            "steps": len(self.steps), "started": self.started, "ended": self.ended, "wall_s": wall,
            "steps_per_s": len(self.steps) / wall if wall > 0 else None,
            "step_p50_ms": statistics.median(self.steps) * 1e3 if self.steps else None,
            "data_wait_p50_ms": statistics.median(self.waits) * 1e3 if self.waits else None,
            "waits_ms": [w * 1e3 for w in self.waits], "steps_ms": [s * 1e3 for s in self.steps]}))


def train_plain(loader: DataLoader, steps: int, timing: Timing, device: str) -> None:
    model = conv_net().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    done = 0
    while done < steps:
        timing.epoch_start()
        for images, labels in loader:
            timing.step_start()
            images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
            loss = nn.functional.cross_entropy(model(images), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            del images, labels, loss  # the step is done with its batch: freeing it is the step's work
            timing.step_end()
            done += 1
            if done == steps:
                break


def train_lightning(loader: DataLoader, steps: int, timing: Timing, device: str) -> None:
    import lightning as L

    class Classifier(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = conv_net()

        def training_step(self, batch, batch_idx):
            images, labels = batch
            return nn.functional.cross_entropy(self.net(images), labels)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    class Timer(L.Callback):
        def on_train_epoch_start(self, trainer, module):
            timing.epoch_start()

        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            timing.step_start()

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            timing.step_end()

    # Lightning's own count: a batch's fetch (its profiler's mark) is the data wait, the time to the
    # next fetch the step (the callbacks' window leaves out Lightning's per-batch work, ~2 ms here).
    from lightning.pytorch.profilers import SimpleProfiler

    class FetchMarks(SimpleProfiler):
        fetch = "[_TrainingEpochLoop].train_dataloader_next"

        def __init__(self) -> None:
            super().__init__()
            self.marks: list[tuple[float, float]] = []  # (start, end) of every fetch

        def start(self, action_name: str) -> None:
            if action_name == self.fetch:
                self.marks.append((time.perf_counter(), math.nan))
            super().start(action_name)

        def stop(self, action_name: str) -> None:
            super().stop(action_name)
            if action_name == self.fetch and self.marks:
                self.marks[-1] = (self.marks[-1][0], time.perf_counter())

    profiler = FetchMarks()
    trainer = L.Trainer(max_steps=steps, accelerator="gpu" if device == "cuda" else "cpu", devices=1, logger=False, callbacks=[Timer()],
                        profiler=profiler, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(Classifier(), loader)
    marks = profiler.marks
    if len(marks) == len(timing.steps):
        timing.waits = [end - start for start, end in marks]
        timing.steps = [nxt[0] - end for (_, end), nxt in zip(marks, marks[1:])] + [timing.ended - marks[-1][1]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", required=True, help="folder of the JPEGs (made if missing)")
    parser.add_argument("--n", type=int, default=2000, help="images: an epoch is n / batch steps")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--trainer", choices=["lightning", "plain"], default="lightning")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--timing", help="write the job's own per-step figures here (JSON)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    dataset = Jpegs(make_images(Path(args.images), args.n))
    loader = DataLoader(dataset, batch_size=args.batch, shuffle=True, num_workers=args.workers, drop_last=True,
                        pin_memory=args.device == "cuda")
    timing = Timing(cuda=args.device == "cuda")
    (train_lightning if args.trainer == "lightning" else train_plain)(loader, args.steps, timing, args.device)
    if args.timing:
        timing.write(args.timing)
    print(f"trained {len(timing.steps)} steps", flush=True)


if __name__ == "__main__":
    main()
