"""Where generated data sets live: made once, reused by every later run and process."""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import PipelineSpecError

__all__ = ["cache_dir"]

CACHE_ENV = "SPDL_LAB_CACHE_DIR"


def cache_dir(root: str | os.PathLike | None, kind: str) -> Path:
    """``root`` if given, else ``$SPDL_LAB_CACHE_DIR/KIND``, else ``~/.cache/spdl_lab/KIND``
    (``$XDG_CACHE_HOME`` honoured); made now, with a clear error if it cannot be."""
    if root is not None:
        path = Path(root)
    elif os.environ.get(CACHE_ENV):
        path = Path(os.environ[CACHE_ENV]) / kind
    else:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
        path = base / "spdl_lab" / kind
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise PipelineSpecError(
            f"cannot make the data folder {path}: {exc.strerror or exc}; pass root= (a folder you "
            f"can write) or set ${CACHE_ENV}") from None
    if not path.is_dir():
        raise PipelineSpecError(f"{path} is not a folder; pass root= or set ${CACHE_ENV}")
    return path
