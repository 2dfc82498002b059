"""``lab.workloads``: pipelines to study, made on this machine (nothing is downloaded).

Synthetic ones from the field notes (``noisy_neighbour()``, ``ipc_overhead()``) and real ones:
``images()`` / ``image_dataloader()`` (JPEG decoding) and ``text()`` / ``text_dataloader()``
(tokenizing), each with a matching training step. Functions are module-level so every runner
(threads, a child process, DataLoader workers) imports them by reference.
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

__all__ = ["DocumentTokens", "ImageFolder", "augment", "collate_list", "collate_stack", "decode_sample",
           "fetch_array", "image_dataloader", "image_step", "images", "ipc_overhead", "noisy_neighbour",
           "read_sample", "text", "text_dataloader", "text_step"]
