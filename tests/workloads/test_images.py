"""The image workload: real JPEG files, made once; the pipeline and the DataLoader do the same work."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from PIL import Image

import spdl_lab as lab
from spdl_lab.workloads._images import RandomResizedCropFlip, image_files

pytestmark = pytest.mark.usefixtures("no_thread_leak")


def test_the_files_are_photo_like_jpegs_made_once(data_cache):
    folder = image_files(24, (256, 512), None)
    files = sorted(folder.glob("*.jpg"))
    assert len(files) == 24 and folder.parent == data_cache
    sizes = [f.stat().st_size for f in files]
    assert 15_000 < np.median(sizes) < 80_000, sizes
    for f in files[:5]:
        with Image.open(f) as image:
            assert image.format == "JPEG" and all(256 <= side <= 512 for side in image.size)
    stamps = [f.stat().st_mtime_ns for f in files]
    image_files(24, (256, 512), None)  # asked again: nothing rewritten
    assert [f.stat().st_mtime_ns for f in files] == stamps


def test_the_pipeline_yields_normalized_batches_and_the_step_trains():
    pipeline, step = lab.workloads.images(n=32, crop=64, batch_size=8)
    assert [s.name for s in pipeline.stages] == ["read", "decode", "augment", "normalize", "batch", "collate"]
    with lab.Loader(pipeline, runner="thread") as loader:
        batches = list(loader)
    assert len(batches) == 4
    batch = batches[0]
    assert batch.shape == (8, 3, 64, 64) and batch.dtype == torch.float32
    assert -3.0 < float(batch.mean()) < 3.0 and float(batch.std()) > 0.1  # normalized, not constant
    losses = [step(batch) for _ in range(3)]
    assert all(np.isfinite(losses)) and step.steps == 3


def test_the_dataloader_does_the_same_work_and_converts():
    dl = lab.workloads.image_dataloader(n=16, batch_size=4, num_workers=0, crop=48)
    batches = list(dl)
    assert len(batches) == 4 and batches[0].shape == (4, 3, 48, 48)
    pipeline = lab.from_dataloader(dl)
    with lab.Loader(pipeline, runner="thread") as loader:
        assert [b.shape for b in loader] == [(4, 3, 48, 48)] * 4


def test_random_resized_crop_stays_inside_the_image():
    crop = RandomResizedCropFlip(32)
    random.seed(0)
    for _ in range(500):
        w, h = random.randint(20, 600), random.randint(20, 600)
        x0, y0, x1, y1 = crop.box(w, h)
        assert 0 <= x0 < x1 <= w and 0 <= y0 < y1 <= h
    tensor = torch.randint(0, 256, (3, 50, 70), dtype=torch.uint8)
    assert crop(tensor).shape == (3, 32, 32)
    assert crop(Image.new("RGB", (70, 50))).size == (32, 32)


@pytest.mark.parametrize("kwargs, words", [
    ({"n": 0}, "n must be an int >= 1"),
    ({"size": (600, 300)}, "lo <= hi"),
    ({"decoder": "cv2"}, "decoder must be one of"),
    ({"concurrency": {"resize": 2}}, "no stage 'resize'"),
    ({"device": "gpu"}, "device must be None"),
])
def test_bad_arguments_say_what_to_do(kwargs, words):
    with pytest.raises(lab.PipelineSpecError, match=words):
        lab.workloads.images(**{"n": 4, **kwargs})


def test_the_torchvision_decoder_works_or_says_why_not():
    try:
        import torchvision.io  # noqa: F401
    except Exception:
        with pytest.raises(lab.PipelineSpecError, match="needs a torchvision built for torch"):
            lab.workloads.images(n=4, decoder="torchvision")
        return
    pipeline, _ = lab.workloads.images(n=8, decoder="torchvision", crop=32, batch_size=4)
    with lab.Loader(pipeline) as loader:
        assert [b.shape for b in loader] == [(4, 3, 32, 32)] * 2
