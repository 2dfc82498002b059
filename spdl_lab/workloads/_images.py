"""The image workload: photo-like JPEGs made once on this machine, read, decoded (PIL or
torchvision), cropped, flipped and normalized as training does, by a Pipeline or a DataLoader."""

from __future__ import annotations

import io
import math
import os
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from .._json import write_atomically
from .._pipeline import Pipeline, check_ints
from .._training import SimulatedDevice
from ..errors import PipelineSpecError
from ._steps import ModelStep, cache_dir, dataloader, seeded, step_for

DECODERS = ("pil", "torchvision")
MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)


def make_jpeg(index: int, size: tuple[int, int]) -> bytes:
    """One photo-like JPEG, the same bytes for the same ``index`` and ``size`` range."""
    from PIL import Image, ImageDraw, ImageFilter

    rng = np.random.default_rng(index)
    lo, hi = size
    w, h = (int(x) for x in rng.integers(lo, hi + 1, size=2))
    colours = rng.integers(0, 256, size=(4, 4, 3), dtype=np.uint8)
    image = Image.fromarray(colours).resize((w, h), Image.BICUBIC)  # smooth colour fields
    draw = ImageDraw.Draw(image)
    for _ in range(int(rng.integers(3, 9))):  # objects
        x, y = int(rng.integers(0, w)), int(rng.integers(0, h))
        r = int(rng.integers(min(w, h) // 12, min(w, h) // 3))
        fill = tuple(int(c) for c in rng.integers(0, 256, 3))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)([x - r, y - r, x + r, y + r], fill=fill)
    pixels = np.asarray(image.filter(ImageFilter.GaussianBlur(1.5)), dtype=np.int16)
    pixels = pixels + rng.normal(0, 10, size=pixels.shape).astype(np.int16)  # sensor noise
    out = io.BytesIO()
    Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(out, "JPEG", quality=90)
    return out.getvalue()


def image_files(n: int, size: tuple[int, int], root: str | os.PathLike | None) -> Path:
    """The folder holding at least ``n`` images of ``size``; the missing ones are made now."""
    folder = cache_dir(root, f"images-{size[0]}-{size[1]}")
    paths = {i: folder / f"img_{i:06d}.jpg" for i in range(n)}
    if missing := [i for i, path in paths.items() if not path.exists()]:
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1, thread_name_prefix="spdl_lab:images") as pool:
            list(pool.map(lambda i: write_atomically(paths[i], make_jpeg(i, size)), missing))
    return folder


class ListFiles:
    """The source: the first ``n`` JPEGs of ``folder``, listed each pass, ``epochs`` times."""

    def __init__(self, folder: Path, n: int, epochs: int = 1) -> None:
        self.folder, self.n, self.epochs = Path(folder), n, epochs

    def __iter__(self):
        names = sorted(e.name for e in os.scandir(self.folder) if e.name.endswith(".jpg"))
        paths = [str(self.folder / name) for name in names[: self.n]]
        return iter(paths * self.epochs)

    def __len__(self) -> int:
        return self.n * self.epochs

    def __repr__(self) -> str:
        return f"ListFiles({str(self.folder)!r}, n={self.n}, epochs={self.epochs})"


def read_bytes(path: str) -> bytes:
    return Path(path).read_bytes()


def decode_pil(data: bytes) -> Any:
    """JPEG bytes -> an RGB PIL image, decoded now (PIL decodes lazily otherwise)."""
    from PIL import Image

    image = Image.open(io.BytesIO(data))
    image.draft("RGB", image.size)  # no DCT scaling: the full image, as training reads it
    return image.convert("RGB")


def decode_torchvision(data: bytes) -> Any:
    """JPEG bytes -> a uint8 CHW tensor, with torchvision's ``decode_jpeg`` (libjpeg-turbo)."""
    import torch
    from torchvision.io import decode_jpeg

    return decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8))


class RandomResizedCropFlip:
    """torchvision's RandomResizedCrop (scale 0.08-1, ratio 3/4-4/3) then a horizontal flip
    half the time, on a PIL image or a CHW tensor; ``crop`` x ``crop`` out."""

    def __init__(self, crop: int) -> None:
        self.crop = crop

    def box(self, width: int, height: int) -> tuple[int, int, int, int]:
        area = width * height
        for _ in range(10):
            target = area * random.uniform(0.08, 1.0)
            ratio = math.exp(random.uniform(math.log(3 / 4), math.log(4 / 3)))
            w, h = round(math.sqrt(target * ratio)), round(math.sqrt(target / ratio))
            if 0 < w <= width and 0 < h <= height:
                x, y = random.randint(0, width - w), random.randint(0, height - h)
                return x, y, x + w, y + h
        side = min(width, height)  # the fallback: the centre square
        x, y = (width - side) // 2, (height - side) // 2
        return x, y, x + side, y + side

    def __call__(self, image: Any) -> Any:
        from PIL import Image

        if isinstance(image, Image.Image):
            out = image.resize((self.crop, self.crop), Image.BILINEAR, box=self.box(*image.size))
            return out.transpose(Image.FLIP_LEFT_RIGHT) if random.random() < 0.5 else out
        import torch.nn.functional as F

        x0, y0, x1, y1 = self.box(image.shape[2], image.shape[1])
        patch = image[None, :, y0:y1, x0:x1].float()
        out = F.interpolate(patch, size=(self.crop, self.crop), mode="bilinear", align_corners=False)[0]
        return out.flip(-1) if random.random() < 0.5 else out


def to_normalized_tensor(image: Any) -> Any:
    """A PIL image or a CHW tensor (0-255) -> float32 CHW, normalized by the ImageNet mean and std."""
    import torch

    if not isinstance(image, torch.Tensor):
        image = torch.from_numpy(np.array(image, dtype=np.uint8)).permute(2, 0, 1)  # a copy torch may own
    image = image.float().div_(255.0)
    return image.sub_(torch.tensor(MEAN).view(3, 1, 1)).div_(torch.tensor(STD).view(3, 1, 1)).contiguous()


def stack(images: list[Any]) -> Any:
    import torch

    return torch.stack(images)


def images(n: int = 256, size: tuple[int, int] | int = (256, 512),
           root: str | os.PathLike | None = None, decoder: str = "pil", *, crop: int = 224,
           batch_size: int = 16, epochs: int = 1, concurrency: dict[str, int] | None = None,
           device: SimulatedDevice | str | None = None) -> tuple[Pipeline, Any]:
    """The image workload: ``(pipeline, step)`` over ``n`` files of ``size`` px a side (an int or a
    ``(lo, hi)`` range), ``epochs`` passes; ``concurrency`` by stage name. Example::

        pipeline, step = lab.workloads.images(n=512, decoder="pil")
        lab.compare(pipeline, step=step)
    """
    size = _check(n, size, crop, batch_size, epochs)
    decode = _decoder(decoder)
    folder = image_files(n, size, root)
    threads = {"read": 4, "decode": 2, "augment": 2, "normalize": 2, **(concurrency or {})}
    if unknown := set(threads) - {"read", "decode", "augment", "normalize"}:
        raise PipelineSpecError(f"images: no stage {sorted(unknown)[0]!r}; the stages are read, "
                                f"decode, augment and normalize")
    pipeline = (
        Pipeline(ListFiles(folder, n, epochs))
        .map(read_bytes, concurrency=threads["read"], name="read")
        .map(decode, concurrency=threads["decode"], name="decode")
        .map(RandomResizedCropFlip(crop), concurrency=threads["augment"], name="augment")
        .map(to_normalized_tensor, concurrency=threads["normalize"], name="normalize")
        .batch(batch_size, drop_last=True)
        .map(stack, name="collate"))
    return pipeline, image_step(device=device)


class ImageFolder:
    """The image workload as a map-style torch Dataset, as a user's own would be: ``dataset[i]``
    reads, decodes, crops, flips and normalizes image ``i``."""

    def __init__(self, n: int = 256, size: tuple[int, int] | int = (256, 512),
                 root: str | os.PathLike | None = None, decoder: str = "pil", crop: int = 224) -> None:
        size = _check(n, size, crop, 1)
        self.decoder = decoder
        self._decode = _decoder(decoder)
        self.files = list(ListFiles(image_files(n, size, root), n))
        self._augment = RandomResizedCropFlip(crop)

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> Any:
        image = self._decode(read_bytes(self.files[index]))
        return to_normalized_tensor(self._augment(image))


def image_dataloader(n: int = 256, batch_size: int = 16, num_workers: int = 2, *,
                     size: tuple[int, int] | int = (256, 512), root: str | os.PathLike | None = None,
                     decoder: str = "pil", crop: int = 224, **dataloader_options: Any) -> Any:
    """The image workload as a plain DataLoader over ``ImageFolder``, for ``lab.run(dl, step=...)``
    and ``lab.from_dataloader(dl)``; other keyword arguments go to the DataLoader."""
    return dataloader(ImageFolder(n, size, root, decoder, crop), batch_size, num_workers, dataloader_options)


class ImageModelStep(ModelStep):
    """A training step on CPU: a small conv net (3 stride-2 convolutions, pooling, linear)."""

    def __init__(self, classes: int = 10, seed: int = 0) -> None:
        from torch import nn

        self.model = seeded(seed, lambda: nn.Sequential(
            nn.Conv2d(3, 16, 3, stride=2, padding=1), nn.ReLU(),
            nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU(),
            nn.Conv2d(32, 64, 3, stride=2, padding=1), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, classes),
        ))
        super().__init__(list(self.model.parameters()), classes, lr=0.01)

    def forward(self, batch: Any) -> Any:
        return self.model(batch)

    def __repr__(self) -> str:
        return f"ImageModelStep(conv net, {sum(p.numel() for p in self.model.parameters()):,} parameters)"


def image_step(device: SimulatedDevice | str | None = None) -> Any:
    """The step for the image workload: the CPU conv net, or a SimulatedDevice."""
    return step_for(device, ImageModelStep)


def _check(n: Any, size: Any, crop: Any, batch_size: Any, epochs: Any = 1) -> tuple[int, int]:
    check_ints("images", n=(n, 1), crop=(crop, 1), batch_size=(batch_size, 1), epochs=(epochs, 1))
    lo, hi = (size, size) if isinstance(size, int) and not isinstance(size, bool) else tuple(size)
    if not (isinstance(lo, int) and isinstance(hi, int) and 16 <= lo <= hi <= 4096):
        raise PipelineSpecError(f"images: size must be an int or a (lo, hi) pair of px between 16 "
                                f"and 4096, lo <= hi; got {size!r}")
    return lo, hi


def _decoder(name: str) -> Any:
    if name not in DECODERS:
        raise PipelineSpecError(f"decoder must be one of {DECODERS}, got {name!r}")
    if name == "pil":
        return decode_pil
    try:
        import torchvision.io  # noqa: F401
    except Exception as exc:  # ImportError, or torchvision's ops failing to load against torch
        import torch

        raise PipelineSpecError(
            f"decoder='torchvision' needs a torchvision built for torch {torch.__version__}; importing it "
            f"failed ({type(exc).__name__}: {exc}). Use decoder='pil', or install the matching build"
        ) from None
    return decode_torchvision
