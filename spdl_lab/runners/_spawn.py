"""Spawn without running the user's script again in every worker.

``spawn`` starts a worker by re-running the parent's ``__main__`` (as
``__mp_main__``), so that functions defined there can be found by name. That is
why a script that starts DataLoader workers needs an ``if __name__ ==
"__main__":`` guard. The process runner's workers need nothing from
``__main__``: the pipeline travels by value (cloudpickle). So while a worker
is launched, ``__main__`` is shown to ``multiprocessing`` with a spec named
``"__main__"``, which the child takes as "nothing to import"
(``multiprocessing.spawn._fixup_main_from_name``); every other attribute is
the real module's, so a thread that looks at ``__main__`` in that moment sees
the same module. A user's own DataLoader (``lab.run(dl)``) keeps torch's
behaviour: only the runner's default context is this one.
"""

from __future__ import annotations

import sys
import threading
import types
from collections.abc import Iterator
from contextlib import contextmanager
from importlib.machinery import ModuleSpec
from multiprocessing.context import SpawnContext, SpawnProcess
from typing import Any

__all__ = ["MainFreeSpawnContext"]

_swapping = threading.Lock()


class _MainByName(types.ModuleType):
    """``__main__`` as multiprocessing should see it while launching: named, not a path."""

    def __init__(self, real: types.ModuleType) -> None:
        super().__init__("__main__")
        self.__dict__["_real_main"] = real
        self.__spec__ = ModuleSpec("__main__", None)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_real_main"], name)


@contextmanager
def _main_by_name() -> Iterator[None]:
    with _swapping:
        real = sys.modules.get("__main__")
        if real is None or getattr(getattr(real, "__spec__", None), "name", None) is not None:
            yield  # run with -m, or no main: spawn imports it by name, which the guard is not needed for
            return
        sys.modules["__main__"] = _MainByName(real)
        try:
            yield
        finally:
            sys.modules["__main__"] = real


class MainFreeProcess(SpawnProcess):
    def start(self) -> None:
        with _main_by_name():
            super().start()


class MainFreeSpawnContext(SpawnContext):
    """``multiprocessing.get_context("spawn")``, but workers do not re-run ``__main__``."""

    Process = MainFreeProcess
