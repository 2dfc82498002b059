"""Table cells and fixed-width text tables for every table the lab prints: a missing number (NaN
or None) shows as "-", a rate with its spread as "3.8 [3.7-3.9]"."""

from __future__ import annotations

import math
from collections.abc import Sequence


def _missing(x: float | None) -> bool:
    return x is None or math.isnan(x)


def num(x: float | None, fmt: str = ".3g") -> str:
    """``x`` formatted by ``fmt``, "-" when missing."""
    return "-" if _missing(x) else format(x, fmt)


def pct(x: float | None) -> str:
    """A share (0..1) as a whole percentage."""
    return num(x, ".0%")


def amount(x: float | None, small: str = ".1f") -> str:
    """A rate or a count: thousands separated from 100 up, as ``small`` (one decimal) below."""
    return num(x, ",.0f" if not _missing(x) and abs(x) >= 100 else small)


def spread(x: float, lo: float, hi: float, fmt: str = ".3g", unit: str = "") -> str:
    """``x`` and, where there is one, its range: "3.8 [3.7-3.9]"."""
    shown = f"{format(x, fmt)}{unit}"
    return shown if _missing(lo) or lo == hi else f"{shown} [{format(lo, fmt)}-{format(hi, fmt)}]"


def text_table(headings: Sequence[str], rows: Sequence[Sequence[str]], left: Sequence[int] = (0,)) -> list[str]:
    """Lines of a fixed-width table: columns in ``left`` aligned left (text), the others right."""
    widths = [max(len(cell) for cell in column) for column in zip(headings, *rows)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) if i in left else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    return [line(headings), *map(line, rows)]
