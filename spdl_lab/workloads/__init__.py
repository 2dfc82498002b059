"""``lab.workloads``: pipelines to study, each with a training step: synthetic ones from the field
notes, real ones (JPEGs, tokenizing). Module-level functions: every runner imports them by name."""

from pathlib import Path

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
           "fetch_array", "image_dataloader", "image_step", "images", "ipc_overhead", "job_script",
           "noisy_neighbour", "read_sample", "text", "text_dataloader", "text_step"]

#: Training scripts that know nothing of the lab, to watch and tune as a user's own job.
JOBS = {"ddp": "train_ddp.py", "images": "train_images.py"}


def job_script(name: str = "images") -> Path:
    """The path of a real training script that never imports spdl_lab, for ``spdl-lab watch --
    python PATH`` (``images``: a DataLoader and a conv net, Lightning or a plain loop) or ``--
    torchrun ... PATH`` (``ddp``: data-parallel, one rank can be slowed); ``--help`` says how."""
    if name not in JOBS:
        raise ValueError(f"job_script: no job {name!r}; the jobs are: {', '.join(sorted(JOBS))}")
    return Path(__file__).with_name("jobs") / JOBS[name]
