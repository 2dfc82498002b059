"""``lab.workloads``: pipelines to study, made on this machine (nothing is downloaded).

* synthetic ones from the field notes: ``noisy_neighbour()``, ``ipc_overhead()``;
* real ones: ``images()`` (JPEG files -> read -> decode -> random-resized-crop + flip ->
  normalized tensors), ``image_dataloader()`` (the same as a plain torch DataLoader) and
  ``text()`` (generated documents -> a real tokenizer, Rust or pure Python -> padded ids)
  and ``text_dataloader()``.

Each pipeline comes with a matching training step. Functions are module-level so every
runner (threads, a child process, DataLoader workers) imports them by reference.
"""

from .images import ImageFolder, image_dataloader, image_step, images
from .synthetic import (
    augment,
    collate_list,
    collate_stack,
    decode_sample,
    fetch_array,
    ipc_overhead,
    noisy_neighbour,
    read_sample,
)
from .text import DocumentTokens, text, text_dataloader, text_step

__all__ = [
    "ImageFolder",
    "augment",
    "collate_list",
    "collate_stack",
    "decode_sample",
    "fetch_array",
    "image_dataloader",
    "image_step",
    "images",
    "ipc_overhead",
    "noisy_neighbour",
    "read_sample",
    "DocumentTokens",
    "text",
    "text_dataloader",
    "text_step",
]
