"""The tuned configuration as Python a user pastes into their training script."""

from __future__ import annotations

from typing import Any

__all__ = ["loader_code"]


def loader_code(best: dict[str, Any], batches_per_s: float, speedup: float, from_dataloader: bool) -> str:
    """Code that builds the loader ``best`` describes; for a DataLoader under ``process``, its keywords."""
    head = (f"# spdl_lab tune: {best['runner']}, {batches_per_s:.3g} training batches/s, "
            f"{speedup:.2f}x the starting configuration (measured side by side)")
    options = best["options"]
    if best["runner"] == "process" and from_dataloader:
        kwargs = ", ".join(f"{k}={v!r}" for k, v in options.items())
        return "\n".join([head, "# keep your DataLoader; change only these keyword arguments:",
                          f"dataloader_kwargs = dict({kwargs})",
                          "loader = torch.utils.data.DataLoader(dataset, batch_size=..., **dataloader_kwargs)"])
    lines = [head, "import spdl_lab as lab", ""]
    if from_dataloader:
        lines += ["p = lab.from_dataloader(dataloader)  # the same dataset, sampler and collate_fn"]
    expr = "p"
    if best["runner"] != "process":
        for name, n in best["concurrency"].items():
            expr += f".with_concurrency({name!r}, {n})"
    args = [expr, f"runner={best['runner']!r}", *(f"{k}={v!r}" for k, v in options.items())]
    lines += ["loader = lab.Loader(", *(f"    {a}," for a in args), ")"]
    return "\n".join(lines)
