"""``lab.workloads``: pipelines to study, made on this machine, each with a training step: synthetic
ones from the field notes and real ones (JPEG decoding, tokenizing). Functions are module-level
so every runner (threads, a child process, DataLoader workers) imports them by reference.
"""

from ._images import ImageFolder, image_dataloader, image_step, images
from ._synthetic import (
    augment,
    collate_list,
    collate_stack,
    decode_sample,
    fetch_array,
    ipc_overhead,
    noisy_neighbour,
    read_sample,
)
from ._text import DocumentTokens, text, text_dataloader, text_step

__all__ = ["DocumentTokens", "ImageFolder", "augment", "collate_list", "collate_stack", "decode_sample",
           "fetch_array", "image_dataloader", "image_step", "images", "ipc_overhead", "noisy_neighbour",
           "read_sample", "text", "text_dataloader", "text_step"]
