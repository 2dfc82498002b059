"""Where results and sessions find the code that draws or drives them (registered by ``__init__``
as ``"module:function"``, imported on first use): no import goes up a layer, none loads Bokeh."""

from __future__ import annotations

from collections.abc import Callable
from importlib import import_module
from typing import Any

from .errors import SpdlLabError

_VIEWS: dict[str, str] = {}


def register(**views: str) -> None:
    """Name the function behind each view, as ``name="package.module:function"``."""
    _VIEWS.update(views)


def view(name: str) -> Callable[..., Any]:
    """The function registered as ``name``, its module imported now."""
    try:
        target = _VIEWS[name]
    except KeyError:
        raise SpdlLabError(
            f"nothing is registered to draw {name!r}; import spdl_lab (its __init__ registers "
            "every view) rather than one of its modules alone") from None
    module, _, function = target.partition(":")
    return getattr(import_module(module), function)
