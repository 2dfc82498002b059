"""The interpreter-start hook behind ``SPDL_LAB_WATCH=1``: publish a script's torch DataLoaders
and SPDL pipelines unchanged; standard library only, so that it loads before anything else."""

from __future__ import annotations

import functools
import gc
import importlib.abc
import inspect
import os
import sys
from typing import Any

ENV = "SPDL_LAB_WATCH"
#: A JSON object of keyword arguments given to every DataLoader the script builds, over its own
#: (``spdl-lab tune --script`` tries advice with it).
KWARGS_ENV = "SPDL_LAB_DATALOADER_KWARGS"
#: module -> (class, method) whose result is an epoch's iterator
TARGETS = {"torch.utils.data.dataloader": ("DataLoader", "__iter__"),
           "spdl.pipeline._pipeline": ("Pipeline", "get_iterator")}


def install() -> None:
    """Add the import hook when ``SPDL_LAB_WATCH=1`` (idempotent). Run at interpreter start as
    ``spdl_lab_watch_hook`` (by the ``.pth`` or ``boot/sitecustomize.py``)."""
    if os.environ.get(ENV, "") != "1":
        return
    # By a marker: ``import spdl_lab._watch.hook`` makes a second copy of the .pth's class.
    if not any(getattr(finder, "spdl_lab_watch", False) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
        for module in TARGETS:  # imported before the hook (a sitecustomize that imports torch)
            if module in sys.modules:
                _patch(sys.modules[module])


class _Finder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: it lets the other finders find a target, then wraps its loader."""

    spdl_lab_watch = True

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in TARGETS:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
                spec.loader = _PatchingLoader(spec.loader)
                return spec
        return None


class _PatchingLoader:
    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def exec_module(self, module: Any) -> None:
        self._loader.exec_module(module)
        _patch(module)

    def __getattr__(self, name: str) -> Any:  # create_module, get_source, get_code...
        if name == "_loader":
            raise AttributeError(name)
        return getattr(self._loader, name)


def dataloader_kwargs() -> dict[str, Any]:
    """``$SPDL_LAB_DATALOADER_KWARGS``, {} when unset; ValueError naming it when it is not valid."""
    import json

    text = os.environ.get(KWARGS_ENV, "")
    if not text.strip():
        return {}
    try:
        kwargs = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"${KWARGS_ENV} is not JSON ({exc}): give an object of DataLoader keyword "
                         f"arguments, e.g. {{\"num_workers\": 4}}") from None
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) and k.isidentifier() for k in kwargs):
        raise ValueError(f"${KWARGS_ENV} must be a JSON object of DataLoader keyword arguments, "
                         f"e.g. {{\"num_workers\": 4}}; got {text!r}")
    return kwargs


def _patch_init(cls: Any) -> None:
    """Give every DataLoader the keyword arguments of ``$SPDL_LAB_DATALOADER_KWARGS``, over the
    script's own (positional ones included); a combination torch rejects names the variable."""
    original = cls.__init__
    if getattr(original, "_spdl_lab_watch", False):
        return
    signature = inspect.signature(original)

    @functools.wraps(original)
    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        given = dataloader_kwargs()
        if not given or os.getpid() != _pid:
            return original(self, *args, **kwargs)
        bound = signature.bind_partial(self, *args, **kwargs)  # a call torch would refuse still fails there
        unknown = sorted(set(given) - set(signature.parameters))
        if unknown:
            raise TypeError(f"${KWARGS_ENV} names {', '.join(unknown)}, which DataLoader does not take")
        arguments = {**{k: v for k, v in bound.arguments.items() if k != "self"}, **given}
        try:
            return original(self, **arguments)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"the DataLoader rejects ${KWARGS_ENV}={os.environ.get(KWARGS_ENV)} with the "
                             f"script's own arguments: {exc}") from exc

    init._spdl_lab_watch = True  # type: ignore[attr-defined]
    cls.__init__ = init


def _patch(module: Any) -> None:
    class_name, method = TARGETS[module.__name__]
    cls = getattr(module, class_name, None)
    if class_name == "DataLoader" and cls is not None:
        _patch_init(cls)
    original = getattr(cls, method, None)
    if original is None or getattr(original, "_spdl_lab_watch", False):
        return

    @functools.wraps(original)
    def epoch(self: Any, *args: Any, **kwargs: Any) -> Any:
        # Not inspect.currentframe() in a local: that frame would hold itself and the caller's until
        # a GC, and a DataLoader iterator collected that way takes torch 5 s per worker to stop.
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if caller == "spdl_lab" or caller.startswith("spdl_lab.") or os.getpid() != _pid:
            return original(self, *args, **kwargs)
        if "spdl_lab._watch.publish" not in sys.modules:
            _import_the_lab()
        from spdl_lab._watch.publish import publish_once

        make = functools.partial(original, self, *args, **kwargs)
        return publish_once(self).source.open_epoch(make)

    epoch._spdl_lab_watch = True  # type: ignore[attr-defined]
    setattr(cls, method, epoch)


def _import_the_lab() -> None:
    """Import the lab at the script's first epoch, and collect now the garbage its modules' objects
    (some 49,000 in a torch process) would make a full collection of later: in the script's next
    epoch, 84-114 ms where it takes 32 ms without them (docs/measurements.md)."""
    import spdl_lab._watch.publish  # noqa: F401

    gc.collect()


#: the interpreter the hook was installed in: a forked worker iterating a loader is not the script
_pid = os.getpid()
