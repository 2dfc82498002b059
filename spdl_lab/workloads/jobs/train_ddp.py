"""A data-parallel training job, as a user writes it for ``torchrun``: each rank builds its own
loader over its shard, a small conv net wrapped in DistributedDataParallel (gloo, on the CPU)
averages its gradients across ranks every step. It knows nothing of spdl_lab unless ``--loader lab``.

``--val-steps N`` first runs N batches of a second loader, as Lightning's sanity check does.
A straggler waits for data (``--slow-rank R --slow-ms X``) or computes more (``--compute-rank``).
Run it as ``torchrun --nproc_per_node=2 train_ddp.py ...``; see ``--help``.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset

SIDE = 32


class Shard(Dataset):
    """Rank ``rank``'s items: random images made from their index, each taking ``load_ms`` to
    load (a sleep: the wait of a read, which takes no CPU)."""

    def __init__(self, n: int, rank: int, load_ms: float) -> None:
        self.n, self.rank, self.load_s = n, rank, load_ms / 1e3

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return load_item(self.rank * self.n + i, self.load_s)


def load_item(index: int, load_s: float) -> tuple[torch.Tensor, int]:
    if load_s > 0:
        time.sleep(load_s)
    rng = np.random.default_rng(index)
    return torch.from_numpy(rng.standard_normal((3, SIDE, SIDE), dtype=np.float32)), index % 10


def collate(items: list[tuple[torch.Tensor, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.stack([x for x, _ in items]), torch.tensor([y for _, y in items])


def conv_net() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(32, 10))


def make_loader(args: argparse.Namespace, rank: int, load_ms: float):
    if args.loader == "dataloader":
        return DataLoader(Shard(args.n, rank, load_ms), batch_size=args.batch, shuffle=True,
                          num_workers=args.workers, collate_fn=collate, drop_last=True,
                          persistent_workers=args.workers > 0)
    import spdl_lab as lab  # only with --loader lab: a Loader whose concurrency a notebook can set

    load = functools.partial(load_item, load_s=load_ms / 1e3)
    offset = rank * args.n
    pipeline = (lab.Pipeline(range(offset, offset + args.n)).map(load, concurrency=args.workers, name="load")
                .batch(args.batch, drop_last=True).map(collate, name="collate"))
    return lab.Loader(pipeline, runner="thread")


def burn(seconds: float) -> None:
    """CPU work for ``seconds``: the extra compute of a slower rank."""
    a = torch.ones(64, 64)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        a = torch.tanh(a @ a / 64)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=400, help="steps per rank (unless --seconds)")
    parser.add_argument("--seconds", type=float, help="train this long instead of --steps")
    parser.add_argument("--loader", choices=["dataloader", "lab"], default="dataloader")
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers, or the lab load stage's threads")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--n", type=int, default=1024, help="items per rank: an epoch is n / batch steps")
    parser.add_argument("--load-ms", type=float, default=0.5, help="time to load one item, every rank")
    parser.add_argument("--slow-rank", type=int, default=-1)
    parser.add_argument("--slow-ms", type=float, default=0.0, help="added to every item the slow rank loads")
    parser.add_argument("--compute-rank", type=int, default=-1)
    parser.add_argument("--compute-ms", type=float, default=0.0, help="CPU work added to every step of that rank")
    parser.add_argument("--val-steps", type=int, default=0, help="batches of a validation loader before training")
    parser.add_argument("--timing", help="write each rank's steps, wall time, steps/s and steps/s "
                                         "after the first tenth to DIR/rankR.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    load_ms = args.load_ms + (args.slow_ms if rank == args.slow_rank else 0.0)
    compute_s = args.compute_ms / 1e3 if rank == args.compute_rank else 0.0
    loader = make_loader(args, rank, load_ms)
    model = DistributedDataParallel(conv_net())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    if args.val_steps:  # the validation loader: its own items, after the training shards
        with torch.no_grad():
            for images, _ in itertools.islice(make_loader(args, dist.get_world_size() + rank, load_ms),
                                              args.val_steps):
                model.module(images)
    end = time.perf_counter() + args.seconds if args.seconds else None
    started, steps = time.perf_counter(), 0
    ends = []

    def more() -> bool:
        # Every rank must take the same number of steps (each step is a collective): with
        # --seconds, rank 0's clock decides for all, broadcast to the others.
        if end is None:
            return steps < args.steps
        go = torch.tensor([1 if time.perf_counter() < end else 0])
        dist.broadcast(go, 0)
        return bool(go.item())

    batches = itertools.chain.from_iterable(itertools.repeat(loader))  # epoch after epoch
    while more():
        images, labels = next(batches)
        loss = nn.functional.cross_entropy(model(images), labels)
        optimizer.zero_grad()
        loss.backward()  # DDP's all-reduce of the gradients: every rank waits for the slowest
        optimizer.step()
        if compute_s:
            burn(compute_s)
        steps += 1
        ends.append(time.perf_counter())
    wall = time.perf_counter() - started
    if args.timing:
        Path(args.timing).mkdir(parents=True, exist_ok=True)
        skip = steps // 10
        warm = (steps - 1 - skip) / (ends[-1] - ends[skip]) if steps - 1 > skip else float("nan")
        Path(args.timing, f"rank{rank}.json").write_text(json.dumps(
            {"rank": rank, "steps": steps, "wall_s": wall, "steps_per_s": steps / wall, "warm_steps_per_s": warm}))
    print(f"rank {rank}: trained {steps} steps in {wall:.1f} s", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    if "RANK" not in os.environ:
        raise SystemExit("run it with torchrun, e.g.: torchrun --nproc_per_node=2 train_ddp.py")
    main()
