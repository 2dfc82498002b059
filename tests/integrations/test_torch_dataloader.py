"""A torch DataLoader in the lab: converted with from_dataloader, or run as it is and watched."""

from __future__ import annotations

import time

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

import spdl_lab as lab
from spdl_lab._integrations.torch_dataloader import from_dataloader

pytestmark = pytest.mark.usefixtures("no_thread_leak", "no_child_leak")


class Squares(Dataset):
    def __len__(self) -> int:
        return 22

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": torch.full((3,), float(i)), "y": torch.tensor(i * i)}


class Stream(IterableDataset):
    def __iter__(self):
        return iter(range(5))


def batches_equal(a: list, b: list) -> bool:
    return len(a) == len(b) and all(
        x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x) for x, y in zip(a, b))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("runner", ["thread", "subprocess-threads", "process"])
@pytest.mark.parametrize("drop_last", [False, True])
def test_the_converted_pipeline_makes_the_dataloaders_batches(runner, drop_last):
    dl = DataLoader(Squares(), batch_size=4, drop_last=drop_last)
    p = from_dataloader(dl)
    assert [s.name for s in p.stages] == ["fetch", "batch", "collate"]
    with lab.Loader(p, runner=runner) as loader:
        got = list(loader)
    assert batches_equal(got, list(dl))


@pytest.mark.timeout(60)
def test_concurrency_follows_num_workers_and_shuffles_anew_each_pass():
    dl = DataLoader(Squares(), batch_size=22, shuffle=True, num_workers=3)
    p = from_dataloader(dl)
    assert p.stages[0].concurrency == 3
    with lab.Loader(p) as loader:
        first = next(iter(loader))["y"].tolist()
    with lab.Loader(p) as loader:
        second = next(iter(loader))["y"].tolist()
    assert sorted(first) == sorted(second) == [i * i for i in range(22)]
    assert first != second  # a fresh shuffle per pass (1 in 22! to fail)


@pytest.mark.timeout(60)
def test_batch_sampler_and_no_batching():
    dl = DataLoader(Squares(), batch_sampler=[[0, 1], [5, 6, 7]])
    p = from_dataloader(dl)
    assert [s.name for s in p.stages] == ["fetch", "collate"]
    with lab.Loader(p) as loader:
        assert batches_equal(list(loader), list(dl))
    single = DataLoader(Squares(), batch_size=None)
    with lab.Loader(from_dataloader(single)) as loader:
        got = list(loader)
    assert len(got) == 22 and all(torch.equal(a["x"], b["x"]) for a, b in zip(got, single))


def test_what_cannot_be_converted_is_named():
    with pytest.raises(lab.PipelineSpecError, match="Stream is an IterableDataset.*lab.Pipeline"):
        from_dataloader(DataLoader(Stream(), batch_size=2))
    with pytest.raises(lab.PipelineSpecError, match="worker_init_fn"):
        from_dataloader(DataLoader(Squares(), worker_init_fn=print))
    with pytest.raises(lab.PipelineSpecError, match="takes a torch.utils.data.DataLoader, got list"):
        from_dataloader([1, 2])


@pytest.mark.timeout(120)
def test_a_dataloader_run_as_it_is_reports_its_workers_cpu():
    class Busy(Squares):
        def __getitem__(self, i):
            spin_until = time.process_time() + 0.03  # 30 ms of CPU an item: ~0.3 s of worker CPU in all
            while time.process_time() < spin_until:
                pass
            return super().__getitem__(i)

    dl = DataLoader(Busy(), batch_size=2, num_workers=2, persistent_workers=False)
    session = lab.run(dl, step=lambda batch: None, steps=11, sample_hz=20)
    assert session.wait(timeout=90)
    frames = session.frames()
    workers = frames[(frames["series"] == "processes") & (frames["stage"] == "workers")]["value"]
    assert workers.max() == 2
    cpu = frames[frames["series"] == "cpu_percent"]
    assert {"worker0", "worker1", "workers"} <= set(cpu["stage"])
    assert session.stats().step.steps == 11
